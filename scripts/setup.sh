#!/usr/bin/env bash
# Create .venv (if needed) and install quantplug, its plugins and, with --test, the test tools.
# torch==2.13.0 is installed FIRST: a bare torch requirement would pull the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
pip_install() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
"$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || pip_install torch==2.13.0
# quantplug's native histogram kernels (C) are built with the package where a compiler is
# present; without one quantplug runs its torch code paths (same results, slower calibration)
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null; } \
      || echo "setup: gcc could not be installed; quantplug's native kernels will not be built" >&2
  else
    echo "setup: no C compiler; quantplug's native kernels will not be built (calibration is slower)" >&2
  fi
fi
PKGS=(-e ".[report]" -e plugins/reference)
[ -f plugins/qnn_htp/pyproject.toml ] && PKGS+=(-e plugins/qnn_htp)
pip_install "${PKGS[@]}"
if [ "${1:-}" = "--test" ]; then
  pip_install pytest hypothesis numpy scikit-learn jsonschema ruff==0.17.6 mypy==2.4.1 -e tests/example_plugin
  # peers used only as test oracles, never as product dependencies
  pip_install torchao==0.18.0 --no-deps
  pip_install executorch==1.5.1 --no-deps
  pip_install flatbuffers packaging pyyaml ruamel.yaml tabulate sympy typing-extensions expecttest parameterized
  # model zoo (tests/zoo), random weights, nothing downloaded: torchvision's model definitions
  # (--no-deps: it depends on torch) and transformers (its dependencies do not include torch;
  # naming torch==2.13.0 beside it keeps pip from ever replacing it)
  pip_install torchvision==0.28.0 --no-deps
  pip_install transformers==5.23.0 torch==2.13.0
  # tests/cli: rendering report.html in headless Chromium (Debian package)
  if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "setup: chromium could not be installed; the report rendering tests will be skipped" >&2
    else
      echo "setup: chromium is absent and needs root to install (apt-get install chromium);" \
        "the report rendering tests will be skipped" >&2
    fi
  fi
fi
