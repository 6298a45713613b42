#!/usr/bin/env bash
# Create .venv (if needed) and install quantplug, its plugins and, with --test, the test tools.
# torch==2.13.0 is installed FIRST: a bare torch requirement would pull the CUDA build.
#
# What it installs outside .venv (only as root, with apt-get, and it says so first):
#   gcc       when no C compiler is present (quantplug's optional native kernels)
#   chromium  with --test, when absent (the report rendering tests; Debian pulls ~130 packages)
#   qemu-user with --test, when absent (ONNX Runtime on an emulated AVX2 CPU without VNNI)
# QUANTPLUG_NO_SYSTEM_PACKAGES=1 installs nothing outside .venv (those tests are then skipped).
# The example vendor plugin (tests/example_plugin) is never installed: the test session makes
# it visible to the tests only (tests/conftest.py).
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
system_install() {  # system_install PACKAGE WHY: apt-get install, announced, where allowed
  if [ -n "${QUANTPLUG_NO_SYSTEM_PACKAGES:-}" ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    return 1
  fi
  echo "setup: installing the Debian package $1 and its dependencies on this system ($2);" \
    "QUANTPLUG_NO_SYSTEM_PACKAGES=1 skips it" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null; }
}
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  if [ -z "${QUANTPLUG_NO_SYSTEM_PACKAGES:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    system_install gcc "a C compiler for quantplug's native kernels" \
      || echo "setup: gcc could not be installed; quantplug's native kernels will not be built" >&2
  else
    echo "setup: no C compiler; quantplug's native kernels will not be built (calibration is slower)" >&2
  fi
fi
PKGS=(-e ".[report]" -e plugins/reference)
[ -f plugins/qnn_htp/pyproject.toml ] && PKGS+=(-e plugins/qnn_htp)
pip_install "${PKGS[@]}"
if [ "${1:-}" = "--test" ]; then
  pip_install pytest hypothesis numpy scikit-learn jsonschema ruff==0.17.6 mypy==2.4.1
  # earlier versions of this script installed the example plugin into .venv: take it out again
  if "$VPY" -m pip show -q quantplug-example-vendor >/dev/null 2>&1; then
    "$VPY" -m pip uninstall -y -q quantplug-example-vendor
  fi
  # peers used only as test oracles, never as product dependencies
  pip_install torchao==0.18.0 --no-deps
  pip_install executorch==1.5.1 --no-deps
  pip_install flatbuffers packaging pyyaml ruamel.yaml tabulate sympy typing-extensions expecttest parameterized
  # real architectures for the tests (random weights, no downloads): torchvision 0.28.0, the
  # release for torch 2.13, without its torch pin. PyPI's wheel is built for PyPI's (CUDA) torch;
  # next to a CPU build of torch its C ops do not load and `import torchvision` fails
  # (`operator torchvision::nms does not exist`), and transformers imports it wherever it is
  # installed. So it goes into .venv only where it imports there; otherwise .venv keeps none
  # (a user's own models then say "No module named torchvision" instead of failing half-way
  # through an import) and the tests get their copy in .test-packages/, which only the test
  # session puts on its path (tests/conftest.py, with tests/torchvision_compat.py).
  if ! "$VPY" -c "import torchvision" >/dev/null 2>&1; then
    if "$VPY" -m pip show -q torchvision >/dev/null 2>&1; then  # an earlier setup's unusable copy
      "$VPY" -m pip uninstall -y -q torchvision
    fi
    pip_install torchvision==0.28.0 --no-deps
    if ! "$VPY" -c "import torchvision" >/dev/null 2>&1; then
      "$VPY" -m pip uninstall -y -q torchvision
      echo "setup: torchvision 0.28.0 from the package index does not match this torch build" \
        "($("$VPY" -c 'import torch; print(torch.__version__)')); .venv keeps none, the tests get" \
        "theirs in .test-packages/ (install a build matching your torch to use torchvision)" >&2
      [ -d .test-packages/torchvision-0.28.0.dist-info ] \
        || pip_install --no-deps --upgrade --target .test-packages torchvision==0.28.0
    fi
  fi
  pip_install transformers==5.23.0
  # the versions the reference backend's ONNX Runtime pieces were read on
  # (plugins/reference/quantplug_reference/peers); a newer ORT is checked there first
  pip_install onnxruntime==1.32.0 onnx==1.23.2 onnxscript==0.7.2
  # tests/cli: rendering report.html in headless Chromium (Debian package)
  if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    system_install chromium "headless rendering of report.html in tests/cli" \
      || echo "setup: chromium is absent (root: apt-get install chromium);" \
        "the report rendering tests will be skipped" >&2
  fi
  # tests/reference/test_reference_qemu.py: ONNX Runtime on an emulated AVX2 CPU without VNNI
  # (qemu-x86_64 -cpu Haswell; Debian package qemu-user, QEMU >= 7.2)
  if ! command -v qemu-x86_64 >/dev/null 2>&1; then
    system_install qemu-user "ONNX Runtime on an emulated AVX2 CPU without VNNI in tests/reference" \
      || echo "setup: qemu-x86_64 is absent (root: apt-get install qemu-user);" \
        "the emulated-AVX2 test will be skipped" >&2
  fi
fi
