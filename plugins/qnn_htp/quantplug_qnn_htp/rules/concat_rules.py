"""Concat, stack, split/chunk/unbind and ``getitem`` (tuple pieces).

Concat and Pack (stack): one encoding for all inputs and the output (ExecuTorch's ConcatObserver
widens every input observer to the concat range; for Pack it shares the first input's moving
average, which clips wider inputs: quantplug observes Pack as Concat). See
:func:`annotate_one_encoding`.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpecBase,
    SharedQuantizationSpec,
    annotate_node,
    get_annotation,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_qnn_htp.rules.common import SHARED_PIECE_OPS, annotate_input_shared_out, is_fixed_output

aten = torch.ops.aten


def annotate_one_encoding(node: Node, config: QuantizationConfig, inputs: list[Node]) -> None:
    """``inputs`` and the output on one encoding, observed over the range of all of them.

    The output takes the config's ``concat`` spec (an absolute running range,
    :class:`~quantplug_qnn_htp.observers.ConcatMinMaxObserver`) and every input edge shares it,
    so the producers join the group and the concat observer governs it. A moving average
    initialised by the first input (ExecuTorch's choice for Pack) clips inputs of wider range.
    Inputs with a fixed encoding (sigmoid...) keep it, as in ExecuTorch.
    """
    out = getattr(config, "concat", None) or config.output_activation
    if out is None:
        return
    specs: dict[Node, QuantizationSpecBase | None] = {}
    for a in inputs:
        # a fixed-encoding input keeps its producer's grid (no requantization in front of the op)
        specs[a] = SharedQuantizationSpec(a) if is_fixed_output(a) else SharedQuantizationSpec(node)
    annotate_node(node, specs, out)


def _float_inputs(node: Node) -> list[Node]:
    inputs: list[Node] = []
    for a in node.args[0]:  # type: ignore[union-attr]
        if is_float_tensor(a) and a not in inputs:
            inputs.append(a)
    return inputs


@register_annotator([aten.cat.default, aten.concat.default], backend_op="Concat")
def annotate_cat(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node) or config.input_activation is None or not is_float_tensor(node):
        return
    inputs = _float_inputs(node)
    if inputs:
        annotate_one_encoding(node, config, inputs)


@register_annotator([aten.stack.default], backend_op="Pack")
def annotate_stack(node: Node, config: QuantizationConfig) -> None:
    """Pack needs one encoding for its inputs and output: the range of all of them, as Concat."""
    if is_annotated(node) or config.input_activation is None or not is_float_tensor(node):
        return
    inputs = _float_inputs(node)
    if inputs:
        annotate_one_encoding(node, config, inputs)


@register_annotator(
    [
        aten.split_with_sizes.default,
        aten.split_with_sizes_copy.default,
        aten.split.Tensor,
        aten.chunk.default,
    ],
    backend_op="Split",
)
def annotate_split(node: Node, config: QuantizationConfig) -> None:
    """The input edge is quantized; each piece (``getitem``) shares it."""
    annotate_input_shared_out(node, config, output=False)


@register_annotator([aten.unbind.int], backend_op="UnPack")
def annotate_unbind(node: Node, config: QuantizationConfig) -> None:
    annotate_input_shared_out(node, config, output=False)


@register_annotator([operator.getitem])
def annotate_getitem(node: Node, config: QuantizationConfig) -> None:
    """A piece of split/chunk/unbind/topk/sort shares the producer's input encoding; float pieces of
    other annotated tuple producers (max_pool2d_with_indices, native_layer_norm) get the
    activation spec."""
    if is_annotated(node) or not is_float_tensor(node):
        return
    parent = node.args[0]
    if not isinstance(parent, Node) or parent.op != "call_function":
        return
    ann = get_annotation(parent)
    if ann is None or not any(s is not None for s in ann.input_qspec_map.values()):
        return  # the producer stays float
    if parent.target in SHARED_PIECE_OPS:
        source = parent.args[0]
        if isinstance(source, Node) and ann.input_qspec_map.get(source) is not None:
            annotate_node(node, output_qspec=SharedQuantizationSpec((source, parent)))
        return
    if config.output_activation is not None:
        annotate_node(node, output_qspec=config.output_activation)
