"""Float arithmetic whose result is cast to integers (index arithmetic), which no quantize may touch.

Programs compute indices in float: OPT builds its position ids as ``(cumsum(mask) * mask -
1).long()`` on a float mask of ones, then looks them up in the position table. The values are
whole numbers held in float, and the cast truncates: a quantize/dequantize that returns 2.99998
for 3 makes the cast give 2, so token 3 reads position 2's embedding. Every preset does it, 16-bit
too (OPT at ``qnn_htp`` 16a16w: 5 dB against float where its peers score 35), because the error
is not the grid's size but the truncation's edge, which every integer sits on.

So the float nodes of such a computation stay float: the cast itself and, backwards from it, each
node of :data:`INDEX_OPS` whose every reader is a cast or another such node. The search stops at
any other op (a convolution, a matmul, a sigmoid...): ``(sigmoid(conv(x)) * 255).to(torch.uint8)``
keeps its network quantized and only the scaling before the cast in float. A quantized node whose
output also reaches the index arithmetic gives it the float value (:mod:`_quantplug.flow.prepare`).
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from _quantplug.graph.op_names import op_name

#: dtype conversions (``.long()``, ``.to(torch.int32)``, ``type_as``...) as ``torch.export`` writes them
CASTS = frozenset(
    {
        "aten.to.dtype",
        "aten.to.dtype_layout",
        "aten.to.device",
        "aten.to.other",
        "aten._to_copy.default",
        "aten.type_as.default",
        "prims.convert_element_type.default",
    }
)

#: ops an index computation is made of: elementwise arithmetic and rounding, running sums,
#: tensor factories and views. Nothing with weights, nothing nonlinear
INDEX_OPS = frozenset(
    name
    for base, overloads in {
        "add": ("Tensor", "Scalar"),
        "sub": ("Tensor", "Scalar"),
        "rsub": ("Tensor", "Scalar"),
        "mul": ("Tensor", "Scalar"),
        "div": ("Tensor", "Scalar", "Tensor_mode", "Scalar_mode"),
        "floor_divide": ("default", "Scalar"),
        "remainder": ("Tensor", "Scalar"),
        "fmod": ("Tensor", "Scalar"),
        "neg": ("default",),
        "abs": ("default",),
        "floor": ("default",),
        "ceil": ("default",),
        "round": ("default", "decimals"),
        "trunc": ("default",),
        "clamp": ("default", "Tensor"),
        "clamp_min": ("default",),
        "clamp_max": ("default",),
        "minimum": ("default",),
        "maximum": ("default",),
        "where": ("self", "ScalarSelf", "ScalarOther", "Scalar"),
        "cumsum": ("default",),
        "ones": ("default",),
        "zeros": ("default",),
        "full": ("default",),
        "ones_like": ("default",),
        "zeros_like": ("default",),
        "full_like": ("default",),
        "arange": ("default", "start", "start_step"),
        "alias": ("default",),
        "clone": ("default",),
        "view": ("default",),
        "reshape": ("default",),
        "_unsafe_view": ("default",),
        "unsqueeze": ("default",),
        "squeeze": ("default", "dim", "dims"),
        "expand": ("default",),
        "permute": ("default",),
        "transpose": ("int",),
        "t": ("default",),
        "slice": ("Tensor",),
        "select": ("int",),
        "flatten": ("using_ints",),
        "repeat": ("default",),
        "cat": ("default",),
        "stack": ("default",),
    }.items()
    for name in (f"aten.{base}.{overload}" for overload in overloads)
)

#: readers that only check a tensor's metadata: they neither compute with it nor keep it
CHECKS = frozenset({"aten._assert_tensor_metadata.default", "aten.sym_size.int", "aten.sym_numel.default"})


def _dtype(node: Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _is_float(node: Node) -> bool:
    dtype = _dtype(node)
    return dtype is not None and dtype.is_floating_point


def is_integer_cast(node: Node) -> bool:
    """A conversion of a float tensor to an integer dtype (not bool: ``x != 0`` survives a grid
    that holds 0 exactly, which every quantplug grid does)."""
    return node.op == "call_function" and op_name(node.target) in CASTS and _casts_float_to_integer(node)


def _casts_float_to_integer(node: Node) -> bool:
    dtype = _dtype(node)
    source = node.args[0] if node.args else None
    return (
        dtype is not None
        and not dtype.is_floating_point
        and not dtype.is_complex
        and dtype != torch.bool
        and isinstance(source, Node)
        and _is_float(source)
    )


def index_arithmetic(graph: Graph) -> dict[Node, str]:
    """Node -> why it stays float: the integer casts of float tensors and, backwards from them,
    the :data:`INDEX_OPS` nodes whose every reader is one of those (checks aside)."""
    found: dict[Node, str] = {}
    names = _OpNames()
    for node in reversed(list(graph.nodes)):  # readers before the nodes they read
        if node.op != "call_function":
            continue
        name = names(node.target)
        if name in CASTS and _casts_float_to_integer(node):
            found[node] = (
                f"casts a float tensor to {_dtype(node)}: a quantize before it would move whole "
                "numbers off the truncation's edge (index arithmetic stays float)"
            )
            continue
        if name not in INDEX_OPS or not _is_float(node):
            continue
        readers = [
            user for user in node.users if not (user.op == "call_function" and names(user.target) in CHECKS)
        ]
        if readers and all(reader in found for reader in readers):
            found[node] = (
                "index arithmetic: its value only reaches casts to integers, which a quantize "
                "would shift by one wherever a whole number comes back just below itself"
            )
    return found


class _OpNames:
    """:func:`op_name` of the targets of one graph, each worked out once: a graph calls a few dozen
    ops from hundreds of nodes, and an ``OpOverload``'s text is formatted in Python at every ask
    (a third of the search). Keyed by identity (an ``OpOverload`` hashes in Python); holding the
    target keeps its id from being reused while the table lives."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[int, tuple[object, str]] = {}

    def __call__(self, target: object) -> str:
        known = self._known.get(id(target))
        if known is None or known[0] is not target:
            known = self._known[id(target)] = (target, op_name(target))
        return known[1]
