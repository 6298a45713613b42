"""torch.fx's dead-code elimination without its whole-graph lint, where that removes the same nodes.

``Graph.eliminate_dead_code`` lints the whole graph first (every ``get_attr`` target looked up
again: a seventh of folding a ResNet's batch norms) to be sure it is topologically sorted. A
working copy of an exported program is, and a rewrite that only re-points arguments at nodes made
before their users keeps it so. Where torch's pass would do more (a subgraph module to clean as
well, or a tracing context that decides whether random ops are pure), or on a torch version this
was not verified on, torch's own pass runs (``tests/core/test_rewrite_pipeline.py`` compares the
two on a folded program).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from _quantplug.peers.versions import verified


def eliminate_dead_code(gm: GraphModule) -> None:
    """``gm.graph.eliminate_dead_code()``, the same nodes removed, for a topologically sorted graph."""
    graph = gm.graph
    subgraphs = any(isinstance(m, GraphModule) for m in gm.children())
    if subgraphs or torch._guards.TracingContext.try_get() is not None or not verified("torch_dead_code"):
        graph.eliminate_dead_code()
        return
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure(True):
            graph.erase_node(node)
