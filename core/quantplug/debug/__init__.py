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

from quantplug.debug.artifact import ARTIFACT_GAP_DB, ArtifactComparison
from quantplug.debug.compare import (
    DebugReport,
    FloatNode,
    NodeComparison,
    SharingGroupInfo,
    compare,
    sharing_groups,
    tensor_bytes,
)
from quantplug.flow.calls import Call

__all__ = [
    "ARTIFACT_GAP_DB",
    "ArtifactComparison",
    "Call",
    "DebugReport",
    "FloatNode",
    "NodeComparison",
    "SharingGroupInfo",
    "compare",
    "sharing_groups",
    "tensor_bytes",
]
