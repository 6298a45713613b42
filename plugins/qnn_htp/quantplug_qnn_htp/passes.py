"""Graph passes run before annotation (``quantplug_passes_before_annotation``).

They mirror the part of ExecuTorch's ``QnnHtpPassManager.transform_for_annotation_pipeline``
(anchor section 5.5) that changes what gets quantized, so both flows annotate the same graph with
the same node names:

1. ``remove_asserts`` -- drop ``_assert_tensor_metadata`` (ExecuTorch ``RemoveRedundancy`` in
   annotation mode), inference-mode ``dropout`` and casts to a tensor's own dtype;
1b. ``fold_constant_views`` -- slices and views of constants (``in_proj_weight.chunk(3)``) become
   constants, so the weights they are get weight quantization;
1c. ``unroll_recurrent`` -- LSTM/GRU/RNN ops with a static sequence length unrolled over their
   steps into linears, gates and the cell arithmetic, each quantized (ExecuTorch has no rule for
   them: they stayed float; ``quantplug_qnn_htp.recurrent``);
1d. ``decompose_composites`` -- ops the ONNX exporter would expand into several ONNX ops
   (attention, addmm, rsqrt, rms_norm...), rewritten into ops HTP runs one by one, each quantized
   (``quantplug_qnn_htp.decompositions``);
2. ``decompose`` -- ops HTP has no rule for, rewritten into ops it has (``DecomposeSilu``,
   ``DecomposeReciprocal``, ``DecomposeExpM1``, ``DecomposeBinaryAlpha``);
3. ``lift_scalars`` -- scalar operands of binary/compare/select ops become 0-d tensor constants
   (``_tensor_constant_N`` buffers) so they are observed and quantized like any other tensor
   (``LiftConstantScalarOperands``, same op table and names);
4. ``mark_masks`` -- constants holding ``±inf`` (or values beyond the fp16 range, e.g. ``-1e9``)
   that feed ``masked_fill`` / ``where`` / ``add`` / ``sub`` are recorded on the consumer, whose rule
   then observes its output without the mask values and lets the mask share that encoding (see
   ``observers.MaskAwareObserver``). ExecuTorch's ``_replace_inf`` instead rewrites the mask to
   ``-255`` / ``-65535`` after annotation, which ruins the masked tensor's scale.

Every pass edits the working copy ``prepare`` made (never the caller's program) and returns None.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Number
from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug.backend import BackendContext, OptionError, writes_in_place
from quantplug_qnn_htp.configs import BLOCK_MAP_STATE
from quantplug_qnn_htp.decompositions import cast_bool_operands, decompose_composites
from quantplug_qnn_htp.observers import MASK_THRESHOLD
from quantplug_qnn_htp.recurrent import unroll_recurrent
from quantplug_qnn_htp.rules.common import MASK_ARGS_KEY

aten = torch.ops.aten


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


#: casts that only change a dtype (and device) and take no layout or memory-format arguments
_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default})


def _same_dtype_cast(node: Node) -> bool:
    """A cast to the dtype its input already has (``x.to(torch.float32)`` on float32 data): an
    identity that would otherwise be quantized as a Cast op of its own (a requantization)."""
    if node.target not in _CASTS or not isinstance(node.args[0] if node.args else None, Node):
        return False
    if set(node.kwargs) - {"dtype", "layout", "device", "copy", "non_blocking", "pin_memory"}:
        return False  # memory_format and friends change more than the dtype
    before, after = node.args[0].meta.get("val"), node.meta.get("val")  # type: ignore[union-attr]
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
        and before.device == after.device
        and before.shape == after.shape
    )


def _copy_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "quantization_annotation"}


def _finish(gm: GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.recompile()


# --- 1. redundant nodes --------------------------------------------------------------------------


def remove_asserts(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Drop ``aten._assert_tensor_metadata`` nodes (they pin dtypes the quantized graph changes),
    inference-mode ``dropout`` (an identity no HTP op runs: left in, it would sit unquantized
    between two encodings) and casts to the dtype a tensor already has (HF's RMSNorm
    ``x.to(torch.float32)``: quantized as a Cast, each would requantize its tensor)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            changed = True
        elif (node.target is aten.dropout.default and not _arg(node, 2, "train", True)) or _same_dtype_cast(
            node
        ):
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            gm.graph.erase_node(node)
            changed = True
    if changed:
        _finish(gm)


# --- 1c. constants sliced from constants ------------------------------------------------------------

#: ops that only select or rearrange values: applied to a constant, their result is a constant
_VIEW_OPS = frozenset(
    {
        aten.chunk.default,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.unbind.int,
        aten.slice.Tensor,
        aten.select.int,
        aten.narrow.default,
        aten.t.default,
        aten.numpy_T.default,  # W.T
        aten.mT.default,
        aten.transpose.int,
        aten.permute.default,
        aten.view.default,
        aten.reshape.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.contiguous.default,
        aten.clone.default,
    }
)


def fold_constant_views(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Replace slices and views of constants by constants (``nn.MultiheadAttention``'s
    ``in_proj_weight.chunk(3)`` when query, key and value differ): a weight reached through
    ``chunk`` + ``getitem`` is a computed tensor to the annotator, so it would be quantized at run
    time (and its derived bias, a 32-bit activation, could not be encoded at all)."""
    graph = gm.graph
    values: dict[Node, Any] = {}
    changed = False
    for node in list(graph.nodes):
        if node.op == "get_attr":
            value = _constant_value(gm, node)
            if value is not None:
                values[node] = value
            continue
        if node.op != "call_function" or not node.users:
            continue
        foldable = node.target in _VIEW_OPS or (node.target is operator.getitem and node.args[0] in values)
        sources = [a for a in node.all_input_nodes]
        if not foldable or not sources or any(a not in values for a in sources):
            continue
        args = torch.fx.node.map_arg(node.args, lambda a: values[a])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: values[a])
        result = node.target(*args, **kwargs)  # type: ignore[operator]
        if not isinstance(result, torch.Tensor):
            values[node] = result  # a tuple of pieces: its getitems fold next
            continue
        name = _new_constant_name(gm, "_qnn_folded_")
        gm.register_buffer(name, result.detach().clone().contiguous())
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        attr.meta = _copy_meta(node.meta)
        node.replace_all_uses_with(attr)
        values[attr] = getattr(gm, name)
        changed = True
    if changed:
        _finish(gm)


# --- 2. decompositions ---------------------------------------------------------------------------


def _replace(node: Node, new: Node, order: dict[Node, int] | None = None) -> None:
    """Route ``node``'s uses to ``new``. An in-place op (``silu_``) also changed its input for
    every later reader, so those read ``new`` too; the op itself is then erased (dead code
    elimination keeps ops that write in place, and it would still run on every call)."""
    for user in list(node.users):
        user.replace_input_with(node, new)
    if order is None or not writes_in_place(node):
        return
    written = node.args[0]
    if isinstance(written, Node):
        for reader in list(written.users):
            if order.get(reader, -1) > order[node]:
                reader.replace_input_with(written, new)
    node.graph.erase_node(node)


def decompose(gm: GraphModule, context: BackendContext | None = None) -> None:
    """silu -> x * sigmoid(x); reciprocal -> 1 / x; expm1 -> exp(x) - 1; add/sub alpha -> mul first."""
    graph = gm.graph
    changed = False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if target in (aten.silu.default, aten.silu_.default):
            x = node.args[0]
            with graph.inserting_after(x):  # type: ignore[arg-type]
                sig = graph.create_node("call_function", aten.sigmoid.default, (x,))
                sig.meta = _copy_meta(node.meta)
                with graph.inserting_after(sig):
                    mul = graph.create_node("call_function", aten.mul.Tensor, (x, sig))
                    mul.meta = _copy_meta(node.meta)
            _replace(node, mul, order)
            changed = True
        elif target is aten.reciprocal.default:
            x = node.args[0]
            with graph.inserting_after(x):  # type: ignore[arg-type]
                div = graph.call_function(aten.div.Tensor, (1, x))
            div.meta = _copy_meta(node.meta)
            _replace(node, div)
            changed = True
        elif target in (aten.expm1.default, aten.special_expm1.default):
            x = node.args[0]
            with graph.inserting_after(x):  # type: ignore[arg-type]
                exp = graph.create_node("call_function", aten.exp.default, (x,))
                exp.meta = _copy_meta(node.meta)
                with graph.inserting_after(exp):
                    sub = graph.create_node("call_function", aten.sub.Tensor, (exp, 1))
                    sub.meta = _copy_meta(node.meta)
            _replace(node, sub)
            changed = True
        elif (
            target in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor)
            and node.kwargs.get("alpha", 1) != 1
        ):
            alpha = node.kwargs["alpha"]
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
            other = node.args[1]
            if isinstance(other, Number):
                node.args = (node.args[0], other * alpha)  # type: ignore[operator]
            else:
                with graph.inserting_before(node):
                    mul = graph.create_node("call_function", aten.mul.Scalar, (other, alpha))
                    mul.meta = _copy_meta(node.meta)
                node.args = (node.args[0], mul)
            changed = True
    if changed:
        _finish(gm)


# --- 3. lifting scalar operands ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Lift:
    target: Any  # the tensor overload the op becomes
    use_schema_args: bool = False  # also lift Number parameters left at their defaults
    use_self_dtype: bool = False  # the constant takes the output dtype even for bool outputs


#: ExecuTorch ``lift_constant_scalar_operands.SCALAR_OPS`` (same ops, same rewrites)
SCALAR_OPS: dict[Any, _Lift] = {
    aten.eq.Scalar: _Lift(aten.eq.Tensor),
    aten.eq.Tensor: _Lift(aten.eq.Tensor),
    aten.ge.Scalar: _Lift(aten.ge.Tensor),
    aten.ge.Tensor: _Lift(aten.ge.Tensor),
    aten.gt.Scalar: _Lift(aten.gt.Tensor),
    aten.gt.Tensor: _Lift(aten.gt.Tensor),
    aten.le.Scalar: _Lift(aten.le.Tensor),
    aten.le.Tensor: _Lift(aten.le.Tensor),
    aten.lt.Scalar: _Lift(aten.lt.Tensor),
    aten.lt.Tensor: _Lift(aten.lt.Tensor),
    aten.ne.Scalar: _Lift(aten.ne.Tensor),
    aten.ne.Tensor: _Lift(aten.ne.Tensor),
    aten.add.Scalar: _Lift(aten.add.Tensor),
    aten.add_.Scalar: _Lift(aten.add_.Tensor),
    aten.add.Tensor: _Lift(aten.add.Tensor),
    aten.div.Scalar: _Lift(aten.div.Tensor),
    aten.div.Scalar_mode: _Lift(aten.div.Tensor_mode),
    aten.mul.Scalar: _Lift(aten.mul.Tensor),
    aten.rsub.Scalar: _Lift(aten.rsub.Tensor),
    aten.sub.Scalar: _Lift(aten.sub.Tensor),
    aten.sub.Tensor: _Lift(aten.sub.Tensor),
    aten.pow.Tensor_Scalar: _Lift(aten.pow.Tensor_Tensor),
    aten.pow.Scalar: _Lift(aten.pow.Tensor_Tensor),
    aten.leaky_relu.default: _Lift(aten.prelu.default, use_schema_args=True),
    aten.leaky_relu_.default: _Lift(aten.prelu.default, use_schema_args=True),
    aten.where.ScalarSelf: _Lift(aten.where.self, use_self_dtype=True),
    aten.where.ScalarOther: _Lift(aten.where.self, use_self_dtype=True),
    aten.where.Scalar: _Lift(aten.where.self, use_self_dtype=True),
    aten.masked_fill.Scalar: _Lift(aten.masked_fill.Tensor),
    aten.masked_fill_.Scalar: _Lift(aten.masked_fill.Tensor),
    aten.bitwise_xor.Scalar: _Lift(aten.bitwise_xor.Tensor),
}

#: ops whose Number arguments are parameters, not operands (ExecuTorch ``SKIP_LIFT_OPS``)
SKIP_LIFT_OPS = frozenset(
    {
        aten.full_like.default,
        aten.full.default,
        aten.arange.start_step,
        aten.arange.default,
        aten.scalar_tensor.default,
        aten.elu.default,
        aten.hardtanh.default,
        aten.scatter.value,
    }
)


def _is_float_output(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _new_constant_name(gm: GraphModule, prefix: str = "_tensor_constant_") -> str:
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


def _constant_node(gm: GraphModule, node: Node, value: Any) -> Node:
    first = node.args[0] if node.args else None
    lift = SCALAR_OPS.get(node.target)
    out_val = node.meta["val"]
    if (
        isinstance(first, Node)
        and not _is_float_output(node)
        and lift is not None
        and not lift.use_self_dtype
    ):
        dtype = first.meta["val"].dtype
    else:
        dtype = out_val.dtype
    tensor = torch.tensor(value, dtype=dtype, device=out_val.device)
    name = _new_constant_name(gm)
    gm.register_buffer(name, tensor)
    with gm.graph.inserting_before(node):
        attr = gm.graph.get_attr(name)
    fake_mode = getattr(out_val, "fake_mode", None)
    attr.meta["val"] = fake_mode.from_tensor(tensor) if fake_mode is not None else tensor
    return attr


def lift_scalars(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Turn scalar operands into 0-d tensor constants so the quantizer observes them."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in SKIP_LIFT_OPS:
            continue
        schema_args = node.target._schema.arguments
        lift = SCALAR_OPS.get(node.target)
        lifted: dict[int, Node] = {}
        for i, arg in enumerate(node.args):
            if i >= len(schema_args):
                break
            typ = schema_args[i].type
            tensor_got_number = isinstance(typ, torch.TensorType) and isinstance(arg, Number)
            scalar_arg = isinstance(typ, torch.NumberType) and lift is not None
            if (tensor_got_number or scalar_arg) and not isinstance(arg, bool):
                lifted[i] = _constant_node(gm, node, arg)
        if lift is not None and lift.use_schema_args:
            for i, sa in enumerate(schema_args):
                if isinstance(sa.type, torch.NumberType) and i not in lifted and i >= len(node.args):
                    lifted[i] = _constant_node(gm, node, sa.default_value)
        if not lifted:
            continue
        args = list(node.args)
        if lift is not None and lift.use_schema_args:
            args += [None] * max(0, len(schema_args) - len(args))
        for i, attr in lifted.items():
            args[i] = attr
        node.args = tuple(args)
        if lift is not None:
            node.target = lift.target
        changed = True
    if changed:
        _finish(gm)


# --- 4. masks ------------------------------------------------------------------------------------

#: op -> positions of arguments that may hold a mask constant
MASK_CANDIDATES: dict[Any, tuple[int, ...]] = {
    aten.masked_fill.Tensor: (2,),
    aten.where.self: (1, 2),
    aten.add.Tensor: (0, 1),
    aten.sub.Tensor: (0, 1),
}


def _constant_value(gm: GraphModule, node: Any) -> torch.Tensor | None:
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) else None


def is_mask_constant(value: torch.Tensor) -> bool:
    """A float constant with ±inf (or fp16-overflowing) entries: a mask, not data."""
    if not value.dtype.is_floating_point or value.numel() == 0:
        return False
    return bool((value.detach().abs() >= MASK_THRESHOLD).any())


#: ops whose output holds their first argument's values, mask entries included (data movement)
MASK_MOVERS = frozenset(
    {
        aten.contiguous.default,
        aten.clone.default,
        aten.expand.default,
        aten.view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.transpose.int,
        aten.slice.Tensor,
        aten.to.dtype,
        aten._to_copy.default,
    }
)


def mark_masks(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Record the mask arguments of the ops that consume them (``node.meta[MASK_ARGS_KEY]``):
    mask constants, and tensors that carry a mask made at run time -- the output of a masked op,
    moved by data movement. T5's decoder builds ``where(causal, position_bias, finfo.min)`` and
    adds it to the attention scores (``attn_mask`` of sdpa, an ``add`` once decomposed): that add
    must leave the mask values out of its range too, or its grid spans 3e38 and every score
    rounds to zero (7 dB SQNR on 16a8w)."""
    carriers: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in MASK_MOVERS and node.args and node.args[0] in carriers:
            carriers.add(node)
            continue
        positions = MASK_CANDIDATES.get(node.target, ())
        found = tuple(i for i in positions if i < len(node.args) and _holds_mask(gm, node.args[i], carriers))
        if found:
            node.meta[MASK_ARGS_KEY] = found
            carriers.add(node)


def _holds_mask(gm: GraphModule, arg: Any, carriers: set[Node]) -> bool:
    if arg in carriers:
        return True
    value = _constant_value(gm, arg)
    return value is not None and is_mask_constant(value)


# --- block size map check --------------------------------------------------------------------------

_WEIGHTED = {
    aten.linear.default,
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv2d.padding,
    aten.conv3d.default,
    aten.convolution.default,
}


def check_block_size_map(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Every node named in ``block_size_map`` must be a conv/linear of this graph."""
    mapping = context.state.get(BLOCK_MAP_STATE) if context is not None else None
    if not mapping:
        return
    nodes = {n.name: n for n in gm.graph.nodes}
    bad = [name for name in mapping if name not in nodes or nodes[name].target not in _WEIGHTED]
    if bad:
        candidates = sorted(
            n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in _WEIGHTED
        )
        raise OptionError(
            f"block_size_map names {', '.join(map(repr, sorted(bad)))}, which are not conv/linear nodes of "
            "this graph (names after the qnn_htp passes); conv/linear nodes: "
            + (", ".join(candidates) or "none")
        )


PassFn = Callable[[GraphModule, "BackendContext | None"], None]

#: in order (ExecuTorch runs its decompositions before LiftConstantScalarOperands)
PASSES: tuple[tuple[str, PassFn], ...] = (
    ("qnn_htp.remove_asserts", remove_asserts),
    ("qnn_htp.fold_constant_views", fold_constant_views),
    ("qnn_htp.unroll_recurrent", unroll_recurrent),
    ("qnn_htp.decompose_composites", decompose_composites),
    ("qnn_htp.decompose", decompose),
    ("qnn_htp.cast_bool_operands", cast_bool_operands),
    ("qnn_htp.lift_scalars", lift_scalars),
    ("qnn_htp.mark_masks", mark_masks),
    ("qnn_htp.check_block_size_map", check_block_size_map),
)

__all__ = [
    "MASK_CANDIDATES",
    "PASSES",
    "SCALAR_OPS",
    "cast_bool_operands",
    "check_block_size_map",
    "decompose",
    "is_mask_constant",
    "lift_scalars",
    "mark_masks",
    "remove_asserts",
]
