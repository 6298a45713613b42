"""Fully connected (``linear``, ``addmm`` with constant weights) and MatMul (``matmul``, ``bmm``, ``mm``)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    BackendContext,
    QuantizationConfig,
    annotate_node,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_qnn_htp.decompositions import is_fully_connected_addmm
from quantplug_qnn_htp.rules.common import annotate_weighted_op, out_spec

aten = torch.ops.aten


@register_annotator([aten.linear.default], backend_op="FullyConnected")
def annotate_linear(node: Node, config: QuantizationConfig, context: BackendContext) -> None:
    annotate_weighted_op(node, config, "linear", context=context)


@register_annotator([aten.addmm.default], backend_op="Gemm")
def annotate_addmm(node: Node, config: QuantizationConfig, context: BackendContext) -> None:
    """``addmm(bias, x, W)`` with a constant ``W [in, out]`` and bias: a fully connected layer
    (ONNX ``Gemm``, QNN ``FullyConnected``), quantized as a linear is: ``x`` and the output on the
    activation grid, ``W`` per-tensor or per-channel along axis 1, the bias int32 derived from
    both. Other addmm nodes were rewritten to ``mm`` + ``add`` before annotation."""
    if not is_fully_connected_addmm(node):
        return
    annotate_weighted_op(node, config, "addmm", input_index=1, weight_index=2, bias_index=0, context=context)


@register_annotator([aten.matmul.default, aten.bmm.default, aten.mm.default], backend_op="MatMul")
def annotate_matmul(node: Node, config: QuantizationConfig) -> None:
    """Input 0 and output on the activation grid; with 16-bit activations input 1 is int16 symmetric.

    QNN: "SFIXED_POINT_16 input 1 must have UFIXED_POINT_16 input 0 and must be symmetric", so the
    second operand is requantized uint16 -> int16 on that edge (as ExecuTorch does).
    """
    if is_annotated(node):
        return
    a, b = node.args[0], node.args[1]
    inputs = {}
    if is_float_tensor(a) and config.input_activation is not None:
        inputs[a] = config.input_activation
    in1 = getattr(config, "matmul_in1", None) or config.input_activation
    if is_float_tensor(b) and in1 is not None:
        inputs[b] = in1
    out = out_spec(config, node)
    if inputs or out is not None:
        annotate_node(node, inputs, out)
