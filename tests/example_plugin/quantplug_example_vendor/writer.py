"""The example vendor's artifact: one JSON file of encodings its (imaginary) compiler reads."""

from __future__ import annotations

import json

from torch.fx import GraphModule

from quantplug.backend import Artifact, BackendContext, encodings

ENCODINGS_FILE = "example_vendor_encodings.json"
FORMAT = "example-vendor-encodings/1"


def write_artifact(program: GraphModule, context: BackendContext) -> Artifact:
    """Encodings of every quantized tensor, plus the chip they were made for."""
    table = encodings(program)
    document = {
        "format": FORMAT,
        "chip": context.option("chip"),
        "arch": context.state.get("arch"),
        "precision": context.option("precision"),
        "encodings": table,
    }
    return Artifact(
        backend=context.backend,
        files={ENCODINGS_FILE: json.dumps(document, indent=2, allow_nan=False)},
        metadata={
            "options": dict(context.options),
            "quantized_tensors": len(table),
            "dropped_relus": list(program.meta.get("example_vendor_dropped_relus", [])),
        },
    )
