"""``Graph.create_node`` in one step where torch's takes three, for the graphs quantplug builds.

torch 2.13's ``Graph.create_node`` makes a node with empty arguments and files it in the graph;
:func:`_quantplug.graph.working_copy.add_node` (which skips its scan of every argument for raw
SymInts, see there) then gives the node its arguments, a second pass over the same node. Building
a converted decoder creates about 500 nodes this way, a tenth of convert. :func:`create_node`
takes torch's steps in torch's order, with the node constructed with its arguments at once (what
``Node.__init__`` does with them is what the later assignment did): the same name from the
graph's namespace, the same node, filed in the same list position and lookup table.

It applies to a plain ``torch.fx.Graph`` (a subclass may create nodes its own way) whose owning
module has no node-creation hooks (a hook would see the node before its arguments are set, as
torch runs it); anything else, and every graph on a torch version this was not verified on, goes
through ``Graph.create_node``. Importing this module installs it in ``add_node``.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Graph, Node
from torch.fx.immutable_collections import immutable_dict
from torch.fx.node import Argument, Target

from _quantplug.graph import working_copy
from _quantplug.peers.versions import verified


def create_node(
    graph: Graph,
    op: str,
    target: Target,
    args: tuple[Argument, ...],
    kwargs: dict[str, Argument] | None,
    name: str | None,
    type_expr: Any | None,
) -> Node | None:
    """``add_node(graph, op, target, args, kwargs, name, type_expr)``'s node, or None (nothing
    done) where torch's ``create_node`` must make it (module docstring)."""
    if type(graph) is not Graph or "create_node" in graph.__dict__:
        return None
    owner = graph._owning_module
    if owner is not None and getattr(owner, "_create_node_hooks", None):
        return None
    namespace = graph._graph_namespace
    # torch 2.13 Graph.create_node, after its argument checks and SymInt scan
    candidate = name if name is not None else graph._target_to_str(target)
    name = namespace.create_name(candidate, None)
    node = Node(graph, name, op, target, args or (), kwargs if kwargs else immutable_dict(), type_expr)
    namespace.associate_name_with_obj(name, node)
    graph._insert(node)
    graph._find_nodes_lookup_table.insert(node)
    graph._len += 1
    return node


if verified("torch_node_create"):
    working_copy.node_creator = create_node
