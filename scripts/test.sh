#!/usr/bin/env bash
# Quick start 2: set up (with test dependencies), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that is a failure of the suite, not a pass
if [ "$rc" -eq 5 ]; then echo "no tests were collected"; exit 1; fi
exit "$rc"
