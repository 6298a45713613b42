"""PT2E's reference representation: a converted Q/DQ program rewritten as integer arithmetic.

``convert(prepared, use_reference_representation=True)`` gives what torchao's
``convert_pt2e(..., use_reference_representation=True)`` gives: the quantized ops of the program
written out in the integer arithmetic an int8 kernel performs, so that the program itself says
what a backend must compute (rounding, the int32 accumulator, the requantization multiplier),
and runs anywhere torch runs. It is the representation of int8 quantization PT2E defines:

- ``dequantize -> op -> quantize`` chains of the ops an int8 kernel computes: a static linear or 2-d
  convolution (int16 operands minus their zero points into an int32 accumulator through
  ``out_dtype``, the bias as int32 at ``x_scale * w_scale``, the requantization multiplier
  ``x_scale * w_scale / out_scale``), a dynamically quantized linear (the activation's qparams
  chosen at run time), add and add + relu (each input rescaled to the output's scale), and
  max-pool with its indices (the pool on the zero-centred integers);
- every other int8 quantize and dequantize, per tensor and per channel, as its formula
  (``round(x / scale) + zero_point`` clamped; ``(q - zero_point) * scale``).

The rules, their order and each rule's conditions are torchao 0.18's (each rule rewrites the whole
program before the next looks): a chain is rewritten only where torchao's pattern matches it (an
int8 ``dtype``, nodes inside the chain used only inside it, shared ranges equal where torchao's
pattern shares them), and each rewrite emits the ops torchao's replacement emits, in its order and
with its arguments, so the numbers are torchao's to the bit (``tests/pt2e/test_reference_representation.py``
runs both side by side). The ops are ``OpOverload``\\ s (torchao leaves some as overload packets:
``aten.clamp``). Where torchao's rewrite produces a program that cannot run, quantplug does
what the arithmetic says instead (documented in ``docs/migrating-from-torchao.md``): a linear or
convolution without bias gets no bias term (torchao divides ``None``), and a convolution is
rewritten only when its output is 4-d (torchao's bias broadcast is a 2-d convolution's).

What the representation cannot express is refused, naming the node: a quantize or dequantize of
another dtype (uint8, int16, int32, float8), per-block, per-token or affine ops. torchao leaves
those as they are, so its "reference representation" still holds quantized ops there; quantplug
raises a :class:`ConversionError` instead, since a reference that is partly not integer
arithmetic is not what the caller asked for.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._higher_order_ops.out_dtype import out_dtype
from torch.fx import Graph, GraphModule, Node

from _quantplug.errors import ConversionError
from _quantplug.flow.loop_bodies import loop_bodies
from _quantplug.graph.attrs import fetch_attr
from _quantplug.graph.working_copy import code_counter, release_code_with

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

QUANTIZE_PER_TENSOR = (
    qd.quantize_per_tensor.default,
    qd.quantize_per_tensor.tensor,
    qd.quantize_per_tensor.tensor2,
)
DEQUANTIZE_PER_TENSOR = (
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_tensor.tensor,
    qd.dequantize_per_tensor.tensor2,
)

#: the meta an emitted node takes from the node it replaces (where it came from in the model)
_PORTED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node", "quantization_tag")


def to_reference_representation(gm: GraphModule) -> GraphModule:
    """Rewrite ``gm`` (a converted program, changed in place) and its loop bodies into PT2E's
    integer-arithmetic reference representation; returns ``gm``.

    Raises:
        ConversionError: a quantize or dequantize op the representation cannot express, named.
    """
    graphs = [gm] + [
        body for path in loop_bodies(gm) if isinstance(body := fetch_attr(gm, path), GraphModule)
    ]
    for module in graphs:
        for rule in RULES:
            for node in list(module.graph.nodes):
                if node.op == "call_function" and not getattr(node, "_erased", False):
                    _apply(rule, module.graph, node)
        _refuse_remaining(module)
        since = code_counter()
        module.recompile()
        release_code_with(module, since=since)
    return gm


# ------------------------------------------------------------------------------ reading nodes


@dataclass(frozen=True)
class _Quant:
    """An int8 per-tensor quantize or dequantize node and its arguments."""

    node: Node
    input: Any
    scale: Any
    zero_point: Any
    quant_min: Any
    quant_max: Any


def _arguments(node: Node) -> dict[str, Any] | None:
    """``node``'s arguments by their schema names, defaults filled in (None: not an OpOverload),
    so that a call spelled with keywords or defaults matches as torchao's matcher matches it."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    schema = node.target._schema.arguments
    named: dict[str, Any] = {}
    for position, argument in enumerate(schema):
        if argument.name in node.kwargs:
            named[argument.name] = node.kwargs[argument.name]
        elif not argument.kwarg_only and position < len(node.args):
            named[argument.name] = node.args[position]
        elif argument.has_default_value():
            named[argument.name] = argument.default_value
    return named


def _int8_per_tensor(node: Any, ops: tuple[Any, ...]) -> _Quant | None:
    """``node`` as an int8 per-tensor quantize/dequantize (one of ``ops``), or None."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target not in ops:
        return None
    args = _arguments(node)
    if args is None or args["dtype"] != torch.int8 or args.get("out_dtype") is not None:
        return None
    return _Quant(
        node, args["input"], args["scale"], args["zero_point"], args["quant_min"], args["quant_max"]
    )


def _only_used_by(node: Node, *users: Node) -> bool:
    return set(node.users) <= set(users)


def _dequantized_input(node: Any, consumer: Node) -> _Quant | None:
    """The int8 per-tensor dequantize ``node`` read only by ``consumer`` (a chain's input)."""
    dq = _int8_per_tensor(node, DEQUANTIZE_PER_TENSOR)
    return dq if dq is not None and _only_used_by(dq.node, consumer) else None


def _quantized_output(anchor: Node, *targets: Any) -> tuple[_Quant, Node, dict[str, Any]] | None:
    """``anchor`` as an int8 quantize of an op (one of ``targets``) used by nothing else: the
    quantize, the op and the op's arguments."""
    q = _int8_per_tensor(anchor, QUANTIZE_PER_TENSOR)
    if q is None or not isinstance(q.input, Node) or q.input.target not in targets:
        return None
    op = q.input
    args = _arguments(op)
    if args is None or not _only_used_by(op, anchor):
        return None
    return q, op, args


# ------------------------------------------------------------------------------ emitting nodes


class _Emitter:
    """Adds call_function nodes before the node a rewrite replaces, with that node's origin."""

    def __init__(self, graph: Graph, origin: Node) -> None:
        self.graph = graph
        self.origin = origin

    def __call__(self, target: Any, *args: Any) -> Node:
        with self.graph.inserting_before(self.origin):
            node = self.graph.call_function(target, args)
        node.meta.update({k: self.origin.meta[k] for k in _PORTED_META if k in self.origin.meta})
        return node

    def to(self, x: Node, dtype: torch.dtype) -> Node:
        return self(aten.to.dtype, x, dtype)

    def clamp(self, x: Node, low: Any, high: Any) -> Node:
        tensors = isinstance(low, Node) or isinstance(high, Node)
        return self(aten.clamp.Tensor if tensors else aten.clamp.default, x, low, high)

    def quantize(self, x: Any, scale: Any, zero_point: Any, low: Any, high: Any) -> Node:
        """``clamp(round(x / scale) + zero_point)`` as int8."""
        q = self(
            aten.add.Tensor,
            self.to(self(aten.round.default, self(aten.div.Tensor, x, scale)), torch.int32),
            zero_point,
        )
        return self.to(self.clamp(q, low, high), torch.int8)

    def add_bias(self, acc: Node, bias: Any, x: _Quant, w: _Quant, unsqueeze: int) -> Node:
        """The int32 accumulator plus the bias quantized at ``x_scale * w_scale`` (broadcast over
        ``unsqueeze`` trailing dimensions); no bias term without a bias."""
        if bias is None:
            return acc
        bias_i32 = self(
            out_dtype, aten.div.Tensor, torch.int32, bias, self(aten.mul.Tensor, x.scale, w.scale)
        )
        for _ in range(unsqueeze):
            bias_i32 = self(aten.unsqueeze.default, bias_i32, -1)
        return self(aten.add.Tensor, acc, bias_i32)


# ------------------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class _Match:
    """A chain to rewrite: the node whose uses the replacement takes over, and every node the
    replacement makes dead (erased if nothing else reads them)."""

    anchor: Node
    nodes: tuple[Node, ...]
    emit: Callable[[_Emitter], Node]


def _apply(rule: Callable[[Node], _Match | None], graph: Graph, node: Node) -> None:
    match = rule(node)
    if match is None:
        return
    out = match.emit(_Emitter(graph, match.anchor))
    match.anchor.replace_all_uses_with(out)
    for dead in (match.anchor, *match.nodes):
        if not dead.users:
            graph.erase_node(dead)


def _int_operands(emit: _Emitter, x: _Quant, w: _Quant) -> tuple[Node, Node]:
    """The activation and weight as int16 minus their zero points (int8 * int8 sums fit int32)."""
    x16 = emit.to(emit.clamp(x.input, x.quant_min, x.quant_max), torch.int16)
    w16 = emit.to(emit.clamp(w.input, w.quant_min, w.quant_max), torch.int16)
    return emit(aten.sub.Tensor, x16, x.zero_point), emit(aten.sub.Tensor, w16, w.zero_point)


def _requantize(emit: _Emitter, acc: Node, x: _Quant, w: _Quant, out: _Quant) -> Node:
    """The int32 accumulator at ``x_scale * w_scale`` requantized to the output's int8."""
    multiplier = emit(aten.div.Tensor, emit(aten.mul.Tensor, x.scale, w.scale), out.scale)
    acc = emit(
        aten.add.Tensor, emit(out_dtype, aten.mul.Tensor, torch.int32, acc, multiplier), out.zero_point
    )
    return emit.to(emit.clamp(acc, out.quant_min, out.quant_max), torch.int8)


def _static_linear(anchor: Node) -> _Match | None:
    found = _quantized_output(anchor, aten.linear.default)
    if found is None:
        return None
    out, linear, args = found
    x = _dequantized_input(args["input"], linear)
    w = _dequantized_input(args["weight"], linear)
    if x is None or w is None or x.node is w.node:
        return None

    def emit(e: _Emitter) -> Node:
        xs, ws = _int_operands(e, x, w)
        acc = e(out_dtype, aten.linear.default, torch.int32, xs, ws, None)
        return _requantize(e, e.add_bias(acc, args["bias"], x, w, 0), x, w, out)

    return _Match(anchor, (linear, x.node, w.node), emit)


def _static_conv2d(anchor: Node) -> _Match | None:
    found = _quantized_output(anchor, aten.convolution.default)
    if found is None:
        return None
    out, conv, args = found
    value = conv.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 4:  # the bias broadcast is 2-d conv's
        return None
    x = _dequantized_input(args["input"], conv)
    w = _dequantized_input(args["weight"], conv)
    if x is None or w is None or x.node is w.node:
        return None
    layout = [args[k] for k in ("stride", "padding", "dilation", "transposed", "output_padding", "groups")]

    def emit(e: _Emitter) -> Node:
        xs, ws = _int_operands(e, x, w)
        acc = e(out_dtype, aten.convolution.default, torch.int32, xs, ws, None, *layout)
        return _requantize(e, e.add_bias(acc, args["bias"], x, w, 2), x, w, out)

    return _Match(anchor, (conv, x.node, w.node), emit)


def _dynamic_linear(anchor: Node) -> _Match | None:
    """``choose_qparams -> quantize -> dequantize -> linear`` (activation) with an int8 per-tensor
    weight: integer linear, float output at ``x_scale * w_scale``."""
    if anchor.op != "call_function" or anchor.target != aten.linear.default:
        return None
    args = _arguments(anchor)
    assert args is not None
    x_dq = _dequantized_input(args["input"], anchor)
    w = _dequantized_input(args["weight"], anchor)
    if x_dq is None or w is None or x_dq.node is w.node:
        return None
    x_q = _int8_per_tensor(x_dq.input, QUANTIZE_PER_TENSOR)
    if x_q is None or not _only_used_by(x_q.node, x_dq.node):
        return None
    scale, zero_point = x_q.scale, x_q.zero_point
    if not (
        _is_item(scale, 0)
        and _is_item(zero_point, 1)
        and scale.args[0] is zero_point.args[0]
        and (scale, zero_point) == (x_dq.scale, x_dq.zero_point)
    ):
        return None
    choose = scale.args[0]
    choose_args = _arguments(choose) if choose.target == qd.choose_qparams.tensor else None
    ranges = {(q.quant_min, q.quant_max) for q in (x_q, x_dq)}
    if (
        choose_args is None
        or choose_args["dtype"] != torch.int8
        or choose_args["input"] is not x_q.input
        or ranges != {(choose_args["quant_min"], choose_args["quant_max"])}
        or not _only_used_by(scale, x_q.node, x_dq.node)
        or not _only_used_by(zero_point, x_q.node, x_dq.node)
        or not _only_used_by(choose, scale, zero_point)
    ):
        return None

    def emit(e: _Emitter) -> Node:  # the qparams chosen at run time stay: read by the integers
        x_i8 = e.quantize(x_q.input, scale, zero_point, x_q.quant_min, x_q.quant_max)
        x = _Quant(x_dq.node, x_i8, scale, zero_point, x_q.quant_min, x_q.quant_max)
        w16 = e.to(e.clamp(w.input, w.quant_min, w.quant_max), torch.int16)
        xs = e(aten.sub.Tensor, e.to(x_i8, torch.int16), zero_point)
        ws = e(aten.sub.Tensor, w16, w.zero_point)
        acc = e(out_dtype, aten.linear.default, torch.int32, xs, ws, None)
        acc = e.add_bias(acc, args["bias"], x, w, 0)
        return e(aten.mul.Tensor, acc, e(aten.mul.Tensor, scale, w.scale))

    return _Match(anchor, (x_dq.node, x_q.node, w.node), emit)


def _is_item(node: Any, index: int) -> bool:
    """``node`` is ``producer[index]`` of a node ``producer``."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], Node)
        and isinstance(node.args[1], int)
        and node.args[1] == index
    )


def _add_inputs(add: Node, args: dict[str, Any], out: _Quant) -> tuple[_Quant, _Quant] | None:
    """The two dequantized inputs of an int8 add whose ranges are its output's (torchao's pattern
    shares one quant_min/quant_max among the three)."""
    x = _dequantized_input(args["self"], add)
    y = _dequantized_input(args["other"], add)
    if x is None or y is None or x.node is y.node or args["alpha"] != 1:
        return None
    if {(q.quant_min, q.quant_max) for q in (x, y, out)} != {(out.quant_min, out.quant_max)}:
        return None
    return x, y


def _add_relu(anchor: Node) -> _Match | None:
    found = _quantized_output(anchor, aten.relu.default)
    if found is None:
        return None
    out, relu, relu_args = found
    add = relu_args["self"]
    if not isinstance(add, Node) or add.target != aten.add.Tensor or not _only_used_by(add, relu):
        return None
    args = _arguments(add)
    inputs = _add_inputs(add, args, out) if args is not None else None
    if inputs is None:
        return None
    x, y = inputs

    def emit(e: _Emitter) -> Node:
        def rescaled(q: _Quant) -> Node:
            centred = e(aten.sub.Tensor, e.to(q.input, torch.int32), q.zero_point)
            return e(out_dtype, aten.mul.Tensor, torch.int32, centred, e(aten.div.Tensor, q.scale, out.scale))

        total = e(aten.add.Tensor, e(aten.add.Tensor, rescaled(x), rescaled(y)), out.zero_point)
        return e.to(e.clamp(total, out.zero_point, out.quant_max), torch.int8)  # relu: at the zero point

    return _Match(anchor, (relu, add, x.node, y.node), emit)


def _add(anchor: Node) -> _Match | None:
    found = _quantized_output(anchor, aten.add.Tensor)
    if found is None:
        return None
    out, add, args = found
    inputs = _add_inputs(add, args, out)
    if inputs is None:
        return None
    x, y = inputs

    def emit(e: _Emitter) -> Node:
        def rescaled(q: _Quant) -> Node:
            ratio = e(aten.div.Tensor, q.scale, out.scale)
            product = e(aten.mul.Tensor, ratio, e(aten.sub.Tensor, e.to(q.input, torch.int32), q.zero_point))
            return e.to(e(aten.round.default, product), torch.int32)

        total = e(aten.add.Tensor, e(aten.add.Tensor, rescaled(x), rescaled(y)), out.zero_point)
        return e.to(e.clamp(total, -128, 127), torch.int8)  # torchao clamps to int8's range here

    return _Match(anchor, (add, x.node, y.node), emit)


def _max_pool2d(anchor: Node) -> _Match | None:
    """``dequantize -> max_pool2d_with_indices -> [0] -> quantize``: the pool on the zero-centred
    integers, rescaled to the output's scale (truncated to int8, as torchao's replacement)."""
    q = _int8_per_tensor(anchor, QUANTIZE_PER_TENSOR)
    if q is None or not _is_item(q.input, 0) or not _only_used_by(q.input, anchor):
        return None
    item: Node = q.input
    pool = item.args[0]
    assert isinstance(pool, Node)
    if pool.target != aten.max_pool2d_with_indices.default or not _only_used_by(pool, item):
        return None
    x = _dequantized_input(pool.args[0] if pool.args else None, pool)
    if x is None:
        return None

    def emit(e: _Emitter) -> Node:
        centred = e(
            aten.sub.Tensor, e.to(e.clamp(x.input, x.quant_min, x.quant_max), torch.int32), x.zero_point
        )
        pooled = e(aten.max_pool2d_with_indices.default, centred, *pool.args[1:])
        pooled.kwargs = dict(pool.kwargs)
        values = e(operator.getitem, pooled, 0)
        rescaled = e(
            aten.add.Tensor, e(aten.mul.Tensor, values, e(aten.div.Tensor, x.scale, q.scale)), q.zero_point
        )
        return e.to(e.clamp(rescaled, q.quant_min, q.quant_max), torch.int8)

    return _Match(anchor, (item, pool, x.node), emit)


def _quantize_per_tensor(anchor: Node) -> _Match | None:
    q = _int8_per_tensor(anchor, QUANTIZE_PER_TENSOR)
    if q is None:
        return None
    return _Match(anchor, (), lambda e: e.quantize(q.input, q.scale, q.zero_point, q.quant_min, q.quant_max))


def _dequantize_per_tensor(anchor: Node) -> _Match | None:
    dq = _int8_per_tensor(anchor, DEQUANTIZE_PER_TENSOR)
    if dq is None:
        return None

    def emit(e: _Emitter) -> Node:
        centred = e(
            aten.sub.Tensor, e.to(e.clamp(dq.input, dq.quant_min, dq.quant_max), torch.float32), dq.zero_point
        )
        return e.to(e(aten.mul.Tensor, centred, dq.scale), torch.float32)

    return _Match(anchor, (), emit)


def _int8_per_channel(anchor: Node, op: Any) -> dict[str, Any] | None:
    if anchor.op != "call_function" or anchor.target != op:
        return None
    args = _arguments(anchor)
    if args is None or args["dtype"] != torch.int8 or args.get("out_dtype") is not None:
        return None
    return args if args["zero_points"] is not None else None


def _quantize_per_channel(anchor: Node) -> _Match | None:
    args = _int8_per_channel(anchor, qd.quantize_per_channel.default)
    if args is None:
        return None

    def emit(e: _Emitter) -> Node:
        moved = e(aten.transpose.int, args["input"], args["axis"], -1)  # channels last: broadcast
        q = e(
            aten.add.Tensor,
            e.to(e(aten.round.default, e(aten.div.Tensor, moved, args["scales"])), torch.int32),
            args["zero_points"],
        )
        q = e(aten.transpose.int, e.clamp(q, args["quant_min"], args["quant_max"]), args["axis"], -1)
        return e.to(q, torch.int8)

    return _Match(anchor, (), emit)


def _dequantize_per_channel(anchor: Node) -> _Match | None:
    args = _int8_per_channel(anchor, qd.dequantize_per_channel.default)
    if args is None:
        return None

    def emit(e: _Emitter) -> Node:
        moved = e(
            aten.transpose.int, e.clamp(args["input"], args["quant_min"], args["quant_max"]), args["axis"], -1
        )
        centred = e.to(e(aten.sub.Tensor, e.to(moved, torch.int32), args["zero_points"]), torch.float32)
        return e(aten.transpose.int, e(aten.mul.Tensor, centred, args["scales"]), args["axis"], -1)

    return _Match(anchor, (), emit)


#: torchao 0.18's rules in its order (its 4-bit group-wise dynamic linear becomes a torchao op:
#: not representable without torchao, refused with the rest below)
RULES: tuple[Callable[[Node], _Match | None], ...] = (
    _dynamic_linear,
    _static_linear,
    _static_conv2d,
    _add_relu,
    _add,
    _max_pool2d,
    _quantize_per_tensor,
    _dequantize_per_tensor,
    _quantize_per_channel,
    _dequantize_per_channel,
)


# ------------------------------------------------------------------------------ what is left


def _is_quantization_op(target: Any) -> bool:
    """A quantize/dequantize op of PT2E's (``quantized_decomposed``), torchao's or quantplug's."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._schema.name  # "namespace::op"
    namespace, _, op = name.partition("::")
    return namespace in {"quantized_decomposed", "torchao", "quantplug"} and "quantize" in op


def _refuse_remaining(gm: GraphModule) -> None:
    left = [n for n in gm.graph.nodes if n.op == "call_function" and _is_quantization_op(n.target)]
    if not left:
        return
    node = left[0]
    more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
    raise ConversionError(
        f"convert(use_reference_representation=True): node {node.name!r} ({_describe(node)}){more} has "
        "no integer-arithmetic reference representation: PT2E's covers int8 quantize/dequantize per "
        "tensor and per channel (with zero points) only. Quantize that edge as int8 with a "
        "per-tensor or per-channel spec, or convert without use_reference_representation (the Q/DQ "
        "program)"
    )


def _describe(node: Node) -> str:
    args = _arguments(node) or {}
    dtype = args.get("dtype", args.get("output_dtype"))
    return f"{node.target}" + (f", dtype {dtype}" if dtype is not None else "")
