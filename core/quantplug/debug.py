"""The numeric debugger: where does a quantized program lose accuracy?

```python
report = quantplug.debug.compare(exported_program, quantized_gm, calibration_batches[:4])
print(report.format())
for node in report.worst(5):
    print(node.node, node.op, node.sqnr_db, node.max_abs_error)
# what ships: the backend's artifact measured beside the program (any artifact with run())
report = quantplug.debug.compare(exported_program, quantized_gm, batches, artifact=artifact)
print(report.artifact.sqnr_db, report.artifact.program_sqnr_db, report.artifact.flagged)
```
"""

from __future__ import annotations

from _quantplug import lazy as _lazy

_DECLARATION: dict[str, tuple[str, ...]] = {
    "_quantplug.debug.artifact": ("ARTIFACT_GAP_DB", "ArtifactComparison"),
    "_quantplug.debug.compare": (
        "DebugReport",
        "FloatNode",
        "NodeComparison",
        "SharingGroupInfo",
        "compare",
        "sharing_groups",
        "tensor_bytes",
    ),
    "_quantplug.graph.calls": ("Call",),
}

__path__: list[str] = []  # the 0.1.0 submodules (quantplug.debug.compare ...) resolve, deprecated
__all__ = _lazy.install(__name__, _DECLARATION)
