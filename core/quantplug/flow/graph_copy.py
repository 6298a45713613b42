"""Getting a GraphModule we may change without touching the caller's model."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from quantplug.errors import QuantplugError


def working_copy(program: torch.export.ExportedProgram | GraphModule) -> GraphModule:
    """A GraphModule with its own graph; parameters are shared, never written.

    ``ExportedProgram.module()`` already builds a fresh graph. A GraphModule gets its graph
    copied (node meta included) so annotations and observers never reach the caller's graph.
    Passes must replace tensors (new attributes), not modify them in place.
    """
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    if isinstance(program, GraphModule):
        graph = torch.fx.Graph(owning_module=None, tracer_cls=program.graph._tracer_cls)
        graph._codegen = program.graph._codegen
        value_map: dict[torch.fx.Node, torch.fx.Node] = {}
        out = graph.graph_copy(program.graph, value_map)
        if out is not None:
            graph.output(out)
        copy = GraphModule(program, graph, class_name=type(program).__name__)
        copy.meta.update({k: v for k, v in program.meta.items() if not k.startswith("quantplug")})
        return copy
    raise QuantplugError(
        f"expected a torch.export.ExportedProgram or a torch.fx.GraphModule, got {type(program).__name__}; "
        "capture the model with torch.export.export(model, example_inputs) first"
    )


class AttrNamer:
    """Fresh attribute names in O(1): a counter per prefix instead of probing prefix0, prefix1..."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._counters: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        prefix = prefix.replace(".", "_")
        i = self._counters.get(prefix, 0)
        while True:
            name = f"{prefix}{i}"
            i += 1
            if not hasattr(self._module, name):
                self._counters[prefix] = i
                return name
