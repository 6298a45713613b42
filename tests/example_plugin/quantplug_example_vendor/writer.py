"""The example vendor's artifact: one JSON file of encodings its (imaginary) compiler reads."""

from __future__ import annotations

import json

from torch.fx import GraphModule

from quantplug.backend import Artifact, BackendContext, backend_node_data, encodings
from quantplug_example_vendor.configs import UNIT

ENCODINGS_FILE = "example_vendor_encodings.json"
FORMAT = "example-vendor-encodings/1"


def write_artifact(program: GraphModule, context: BackendContext) -> Artifact:
    """Encodings of every quantized tensor, the unit running each node, the chip they are for."""
    table = encodings(program)
    # what the rules and the annotation stage put on the nodes, kept through prepare and convert
    units = {n.name: backend_node_data(n, UNIT) for n in program.graph.nodes if backend_node_data(n, UNIT)}
    document = {
        "format": FORMAT,
        "chip": context.option("chip"),
        "arch": context.state.get("arch"),
        "precision": context.option("precision"),
        "encodings": table,
        "units": units,
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
