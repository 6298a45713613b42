#!/usr/bin/env bash
# Install the benchmark's peers into the project's venv (.venv at the repo root).
# torch==2.13.0 goes FIRST: torchao and executorch are installed with --no-deps so they cannot
# pull another torch, and a bare torch requirement could pull the CUDA build.
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
pip_install torchao==0.18.0 --no-deps
# ExecuTorch's QnnQuantizer (the peer of the qnn_htp flow): --no-deps keeps its pinned torch out;
# these are the packages its quantizer imports need
pip_install executorch==1.5.1 --no-deps
pip_install flatbuffers packaging pyyaml ruamel.yaml tabulate sympy typing-extensions expecttest parameterized
pip_install matplotlib || echo "matplotlib could not be installed: the bench will skip its plot" >&2
pip_install -e . -e plugins/reference -e plugins/qnn_htp
"$VPY" -c "from quantplug.observers import kernels; assert kernels.available()" 2>/dev/null \
  || echo "bench: quantplug's native kernels are not built (no C compiler?): calibration runs its torch path" >&2
echo "ready: .venv/bin/python -m bench --help"
