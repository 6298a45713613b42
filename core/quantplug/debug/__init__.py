"""The numeric debugger: where does a quantized program lose accuracy?

```python
report = quantplug.debug.compare(exported_program, quantized_gm, calibration_batches[:4])
print(report.format())
for node in report.worst(5):
    print(node.node, node.op, node.sqnr_db, node.max_abs_error)
```
"""

from __future__ import annotations

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
    "Call",
    "DebugReport",
    "FloatNode",
    "NodeComparison",
    "SharingGroupInfo",
    "compare",
    "sharing_groups",
    "tensor_bytes",
]
