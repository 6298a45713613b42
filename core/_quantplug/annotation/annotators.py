"""Writing annotations: the ``register_annotator`` decorator and the common annotation patterns.

A backend's ``xxx_rules`` module is a list of functions ``annotate(node, config)`` (or
``annotate(node, config, context)``) decorated with ``@register_annotator([ops], backend_op=...)``.
The decorator only tags the function; the core collects tagged functions from a module when it
imports it, so importing a rules module has no global side effects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch.fx import Node

from _quantplug.annotation.specs import (
    PER_CHANNEL_QSCHEMES,
    DerivedQuantizationSpec,
    QuantizationConfig,
    QuantizationSpecBase,
    SharedQuantizationSpec,
    annotate_node,
    get_annotation,
    is_annotated,
)
from _quantplug.graph.op_names import op_name

RULE_ATTR = "__quantplug_rules__"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Annotator = Callable[..., None]


@dataclass(frozen=True)
class AnnotatorRule:
    """One op's rule: the annotate function and the backend op it maps to (for validation)."""

    op: str
    fn: Annotator
    backend_op: str | None = None
    takes_context: bool = False


def register_annotator(ops: Iterable[Any], backend_op: str | None = None) -> Callable[[Annotator], Annotator]:
    """Mark ``fn`` as the annotation rule of ``ops`` (ATen overloads or their names).

    ``backend_op`` names the hardware op the rule targets (``"Conv2d"``); the validation engine
    asks the backend for that op's constraints. One function may be registered for many ops.
    """
    names = tuple(op_name(op) for op in ops)

    def decorate(fn: Annotator) -> Annotator:
        import inspect

        takes_context = len(inspect.signature(fn).parameters) >= 3
        rules = tuple(
            AnnotatorRule(op=n, fn=fn, backend_op=backend_op, takes_context=takes_context) for n in names
        )
        setattr(fn, RULE_ATTR, getattr(fn, RULE_ATTR, ()) + rules)
        return fn

    return decorate


def rules_in_module(module: Any) -> dict[str, AnnotatorRule]:
    """The rules a rules module defines, keyed by op name (later definitions win)."""
    found: dict[str, AnnotatorRule] = {}
    for value in vars(module).values():
        for rule in getattr(value, RULE_ATTR, ()):
            found[rule.op] = rule
    return found


# --- predicates -------------------------------------------------------------------------------


def is_float_tensor(node: Any) -> TypeGuard[Node]:
    """True for a node producing one floating-point tensor (what can be quantized)."""
    if not isinstance(node, Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in FLOAT_DTYPES


def output_spec_of(node: Node) -> QuantizationSpecBase | None:
    ann = get_annotation(node)
    return None if ann is None else ann.output_qspec


# --- common patterns ----------------------------------------------------------------------------


def annotate_single_in_single_out(node: Node, config: QuantizationConfig) -> None:
    """First input and output quantized with the activation specs (relu, softmax, pooling...)."""
    if is_annotated(node):
        return
    inputs = {}
    arg = node.args[0] if node.args else None
    if is_float_tensor(arg) and config.input_activation is not None:
        inputs[arg] = config.input_activation
    out = config.output_activation if is_float_tensor(node) else None
    if inputs or out is not None:
        annotate_node(node, inputs, out)


def annotate_single_in(node: Node, config: QuantizationConfig) -> None:
    """Only the first input is quantized (ops with integer or index outputs: argmax...)."""
    if is_annotated(node):
        return
    arg = node.args[0] if node.args else None
    if is_float_tensor(arg) and config.input_activation is not None:
        annotate_node(node, {arg: config.input_activation})


def annotate_binary(node: Node, config: QuantizationConfig) -> None:
    """Both tensor operands and the output quantized (add, mul, matmul...). Scalars stay as is."""
    if is_annotated(node):
        return
    inputs = {}
    for arg in node.args[:2]:
        if is_float_tensor(arg) and config.input_activation is not None:
            inputs[arg] = config.input_activation
    out = config.output_activation if is_float_tensor(node) else None
    if inputs or out is not None:
        annotate_node(node, inputs, out)


def annotate_shared_in_out(node: Node, config: QuantizationConfig) -> None:
    """Input and output share one encoding (view, transpose, max-pool: values only move).

    The input edge shares the producer's output observer when the producer is quantized;
    otherwise it gets the activation spec. The output always shares the input edge.
    """
    if is_annotated(node):
        return
    arg = node.args[0] if node.args else None
    if not is_float_tensor(arg) or not is_float_tensor(node):
        return
    producer_spec = output_spec_of(arg)
    if producer_spec is not None:
        in_spec: QuantizationSpecBase | None = SharedQuantizationSpec(arg)
    else:
        in_spec = config.input_activation
    if in_spec is None:
        return
    annotate_node(node, {arg: in_spec}, SharedQuantizationSpec((arg, node)))


def annotate_weighted(
    node: Node,
    config: QuantizationConfig,
    *,
    input_index: int = 0,
    weight_index: int = 1,
    bias_index: int | None = 2,
    quantize_output: bool = True,
) -> None:
    """Conv / linear: activation, weight, bias (derived int32 when the config asks) and output."""
    if is_annotated(node):
        return
    args = node.args
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    act = args[input_index] if len(args) > input_index else None
    weight = args[weight_index] if len(args) > weight_index else None
    if is_float_tensor(act) and config.input_activation is not None:
        inputs[act] = config.input_activation
    if is_float_tensor(weight) and config.weight is not None:
        inputs[weight] = config.weight
    bias = args[bias_index] if bias_index is not None and len(args) > bias_index else None
    if is_float_tensor(bias):
        bias_spec = config.bias_spec(node)
        if bias_spec is not None:
            inputs[bias] = bias_spec
    out = config.output_activation if quantize_output and is_float_tensor(node) else None
    if inputs or out is not None:
        annotate_node(node, inputs, out)


def constant_value(node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads from its graph's module (None for anything else).

    The tensor object itself, not a copy: a derive function holding it sees the values the
    prepared module holds when qparams are computed (QAT trains them in place).
    """
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    value: Any = node.graph.owning_module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) else None


def floor_bias_scale(
    scale: torch.Tensor, bias: torch.Tensor | None, qmax: int = torch.iinfo(torch.int32).max
) -> torch.Tensor:
    """``scale``, raised where the bias would not fit its integer grid.

    A derived bias scale is input scale x weight scale. Where a weight (channel) is all zero,
    denormal or pruned, its scale sits at eps and every bias value of that channel would clip to
    about zero; there the scale becomes ``max|bias| / (qmax / 2)`` instead, so the bias stays
    representable with half the grid to spare: float32 cannot hold ``2^31 - 1``, and a code
    computed as ``2^31`` would wrap around when cast to int32. Every other channel keeps the
    exact product (what QNN and ONNX Runtime's fused integer kernels expect; ONNX Runtime runs a
    floored layer unfused, with the bias on its own scale).
    """
    if bias is None or bias.numel() == 0:
        return scale
    values = bias.detach().to(torch.float32)
    if scale.numel() == 1:
        amax = values.abs().amax().reshape(scale.shape)
    elif values.numel() == scale.numel():
        amax = values.abs().reshape(scale.shape)
    else:
        return scale
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))  # the NaN policy is not ours
    return torch.maximum(scale, (amax / (qmax / 2)).to(scale.dtype))


def derive_bias_qparams(
    observers: Sequence[Any], bias: torch.Tensor | None = None, qmax: int = torch.iinfo(torch.int32).max
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias scale = input scale x weight scale (per weight channel), zero point 0.

    With ``bias`` (the bias tensor), channels whose bias would not fit ``[-qmax, qmax]`` on that
    scale get the :func:`floor_bias_scale` floor.
    """
    act_scale, _ = observers[0].calculate_qparams()
    weight_scale, _ = observers[1].calculate_qparams()
    scale = (act_scale.reshape(-1)[0] * weight_scale).to(torch.float32).reshape(-1)
    scale = floor_bias_scale(scale, bias, qmax)
    return scale, torch.zeros(scale.shape, dtype=torch.int64)


def derived_bias_spec(
    node: Node,
    *,
    input_index: int = 0,
    weight_index: int = 1,
    bias_index: int | None = 2,
    weight_spec: QuantizationSpecBase | None = None,
    dtype: torch.dtype = torch.int32,
    bias: Node | None = None,
) -> DerivedQuantizationSpec:
    """The int32 bias spec of a conv/linear ``node``, derived from its input and weight observers.

    Built per node (its ``derived_from`` names this node's edges), so pass it as
    ``QuantizationConfig(bias=lambda n: derived_bias_spec(n, weight_spec=...))``. The bias at
    ``bias_index`` (or ``bias``, a bias node that is not one of ``node``'s arguments, as in
    ``matmul`` + ``add``), when it is a constant, sets the scale floor of degenerate (all-zero)
    weight channels (:func:`floor_bias_scale`).
    """
    act, weight = node.args[input_index], node.args[weight_index]
    per_channel = getattr(weight_spec, "qscheme", None) in PER_CHANNEL_QSCHEMES
    info = torch.iinfo(dtype)
    if bias is None and bias_index is not None and len(node.args) > bias_index:
        bias = node.args[bias_index]  # type: ignore[assignment]
    return DerivedQuantizationSpec(
        derived_from=((act, node), (weight, node)),  # type: ignore[arg-type]
        derive_qparams_fn=functools.partial(derive_bias_qparams, bias=constant_value(bias), qmax=info.max),
        dtype=dtype,
        quant_min=info.min,
        quant_max=info.max,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        ch_axis=0 if per_channel else None,
    )
