"""In-place writes into tensors the program made and never reads, taken out before annotation.

Hugging Face's Mamba (its PyTorch path) allocates a state with ``torch.zeros`` inside ``forward``
and ``copy_``\\ s the step's state into it for a cache the exported program does not return. The
write is dead, but torch.export keeps it (an in-place op counts as a side effect) and so does
``Graph.eliminate_dead_code``. Annotated, the state and what it copies get quantize nodes; the
ONNX exporter then drops the whole dead subgraph, and ``qnn_htp`` refused to lower: six quantized
tensors were not in the exported model. Quantizing them also cost observers and calibration time
for values nothing uses.

A write is dropped only when nothing can see it: its result is unused, and the tensor it writes
is a fresh allocation (``zeros``, ``empty_like``, ``clone``...) that nothing else reads, not a
view of an input, a parameter or a buffer (whose mutation is the program's business). Then what
only the write read goes too, as pure dead code.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from _quantplug.graph.mutation import written_args

aten = torch.ops.aten

#: ops whose output is a new tensor that aliases nothing the caller can see
FRESH_ALLOCATIONS = frozenset(
    {
        aten.zeros.default,
        aten.zeros_like.default,
        aten.ones.default,
        aten.ones_like.default,
        aten.full.default,
        aten.full_like.default,
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
        aten.new_empty.default,
        aten.clone.default,
    }
)


def _writes_an_unread_allocation(node: Node) -> bool:
    """``node`` writes only its first argument, a fresh allocation nothing but such unused writes reads."""
    target = node.args[0] if node.args else None
    if written_args(node) != [target] or not isinstance(target, Node):
        return False
    if target.op != "call_function" or target.target not in FRESH_ALLOCATIONS:
        return False
    return all(not user.users and written_args(user) == [target] for user in target.users)


def drop_unread_writes(gm: GraphModule) -> int:
    """Erase in-place writes nothing can see, the allocations they wrote and what only they read;
    returns how many writes went. The program's outputs are unchanged by construction."""
    writes = [n for n in gm.graph.nodes if not n.users and _writes_an_unread_allocation(n)]
    for node in writes:
        gm.graph.erase_node(node)
    if writes:
        gm.graph.eliminate_dead_code()  # the allocations, and what only the writes read
        gm.recompile()
    return len(writes)
