"""Build an ONNX Runtime session of a model with control flow in a child process first.

ONNX Runtime 1.32's graph optimizer dies with a segmentation fault on some quantized graphs with
a ``Loop`` (``nn.EmbeddingBag`` with per-sample offsets in ``mean`` mode, which torch's exporter
writes as a Loop over the bags): the user's whole Python process would die in ``quantplug.lower``
without a word. Models without control flow never went near that code, so only models with a
``Loop``, ``Scan`` or ``If`` pay for the probe (a child that imports onnxruntime, not torch).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

from quantplug.backend import LoweringError

CONTROL_FLOW = frozenset({"Loop", "Scan", "If"})

#: reads the model from stdin and builds the session ``InferenceSession(path)`` would build
_PROBE = (
    "import sys, onnxruntime as ort\n"
    "ort.InferenceSession(sys.stdin.buffer.read(), providers=['CPUExecutionProvider'])\n"
)


def control_flow_nodes(model: Any) -> list[str]:
    """``op 'name'`` of every control-flow node of the main graph."""
    return [f"{n.op_type} {n.name!r}" for n in model.graph.node if n.op_type in CONTROL_FLOW]


def ensure_session_survives(model: Any, model_bytes: bytes, timeout_s: float = 600.0) -> None:
    """Raise a :class:`LoweringError` where building a session of ``model_bytes`` kills the process
    that tries; a child that fails otherwise is left to the in-process session to report."""
    nodes = control_flow_nodes(model)
    if not nodes:
        return
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], input=model_bytes, capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        raise LoweringError(
            f"ONNX Runtime did not finish building a session of model.onnx in {timeout_s:.0f} s "
            f"(control flow: {', '.join(nodes)})"
        ) from exc
    if done.returncode >= 0:
        return
    import onnxruntime as ort

    name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else "a signal"
    raise LoweringError(
        f"ONNX Runtime {ort.__version__} crashes ({name}) building a session of this model.onnx, "
        f"in its control flow ({', '.join(nodes)}): the artifact would kill any process that loads it. "
        "torch's exporter writes nn.EmbeddingBag with per-sample offsets as such a Loop: pass "
        "fixed-size bags as a 2-D tensor of ids ([batch, bag], which quantplug rewrites into an "
        "embedding and a reduction), or lower with another backend"
    )
