"""Writing the reference artifact: the quantized program (``model.pt2``) and its encodings."""

from __future__ import annotations

import io
import json

import torch
from torch.fx import GraphModule

from quantplug import Artifact, BackendContext
from quantplug.flow.inspect import encodings, example_inputs


def write_artifact(program: GraphModule, context: BackendContext) -> Artifact:
    """Re-export the Q/DQ program (so any PT2 runtime can load it) and list its encodings."""
    args = example_inputs(program)
    exported = torch.export.export(program, args)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    table = encodings(program)
    return Artifact(
        backend=context.backend,
        files={
            "model.pt2": buffer.getvalue(),
            "encodings.json": json.dumps({"version": 1, "encodings": table}, indent=2),
        },
        metadata={"options": dict(context.options), "quantized_tensors": len(table)},
    )
