"""What ``quantplug conformance qnn_htp`` may expect of this backend.

The SQNR floors below the kit's default are ExecuTorch-parity annotations with a known
numerical cost, stated here rather than hidden:

* ``stack`` (QNN Pack): the other inputs and the output share the first input's edge observer,
  a moving average that the first batch initialises; inputs of different ranges are clipped to
  the first one's (``cat`` uses the concat observer instead and keeps the full range).
* ``scatter_add`` / ``scatter_reduce``: the output shares ``self``'s encoding, although adding
  ``src`` widens the range.
"""

from __future__ import annotations

from quantplug.conformance.profile import ConformanceProfile

PROFILE = ConformanceProfile(
    artifact_files=("model.onnx", "model.encodings"),
    op_sqnr_floor_db={
        "aten.stack.default": 5.0,
        "aten.scatter_add.default": 8.0,
        "aten.scatter_reduce.two": 8.0,
    },
)
