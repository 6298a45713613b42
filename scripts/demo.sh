#!/usr/bin/env bash
# Quick start 1: set up, then quantize the built-in demo model with the reference backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/quantplug quantize "$@"
