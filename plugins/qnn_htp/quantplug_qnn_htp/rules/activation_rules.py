"""Activations. Sigmoid / hard-sigmoid / 16-bit tanh outputs have fixed QNN encodings.

* Sigmoid, HardSigmoid: ``scale = 1 / (qmax - qmin + 1)``, zero point 0 (uint8 1/256, uint16 1/65536).
* Tanh with 16-bit activations: ``scale = 1/32768``, zero point 32768 (uint16) / 0 (int16);
  8-bit tanh keeps a calibrated output (as ExecuTorch).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    FixedQParamsQuantizationSpec,
    QuantizationConfig,
    annotate_node,
    annotate_single_in_single_out,
    is_annotated,
    is_float_tensor,
    register_annotator,
    spec_range,
)

aten = torch.ops.aten


def sigmoid_qparams(qmin: int, qmax: int) -> tuple[float, int]:
    return 1.0 / (qmax - qmin + 1), 0


def tanh_qparams(qmin: int, qmax: int) -> tuple[float, int]:
    """16-bit tanh: 1/32768 with zero at the grid middle (32768 for uint16, 0 for int16)."""
    return 1.0 / 32768.0, (qmin + qmax + 1) // 2


def _fixed(node: Node, config: QuantizationConfig, fn) -> None:  # type: ignore[no-untyped-def]
    if is_annotated(node):
        return
    arg = node.args[0]
    inputs = (
        {arg: config.input_activation} if is_float_tensor(arg) and config.input_activation is not None else {}
    )
    out = None
    act = config.output_activation
    if is_float_tensor(node) and act is not None:
        qmin, qmax = spec_range(act)
        scale, zp = fn(qmin, qmax)
        out = FixedQParamsQuantizationSpec(
            dtype=act.dtype,  # type: ignore[attr-defined]
            scale=scale,
            zero_point=zp,
            quant_min=qmin,
            quant_max=qmax,
            qscheme=torch.per_tensor_affine,
        )
    if inputs or out is not None:
        annotate_node(node, inputs, out)  # type: ignore[arg-type]


@register_annotator([aten.sigmoid.default], backend_op="Sigmoid")
def annotate_sigmoid(node: Node, config: QuantizationConfig) -> None:
    _fixed(node, config, sigmoid_qparams)


@register_annotator([aten.hardsigmoid.default, aten.hardsigmoid_.default], backend_op="ElementWiseNeuron")
def annotate_hardsigmoid(node: Node, config: QuantizationConfig) -> None:
    _fixed(node, config, sigmoid_qparams)


@register_annotator([aten.tanh.default], backend_op="Tanh")
def annotate_tanh(node: Node, config: QuantizationConfig) -> None:
    act = config.output_activation
    if act is not None and spec_range(act)[1] - spec_range(act)[0] > 255:
        _fixed(node, config, tanh_qparams)
    else:
        annotate_single_in_single_out(node, config)


@register_annotator([aten.relu.default, aten.relu_.default], backend_op="Relu")
def annotate_relu(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator(
    [
        aten.clamp.default,
        aten.clamp_min.default,
        aten.clamp_max.default,
        aten.hardtanh.default,
        aten.hardtanh_.default,
        aten.relu6.default,
    ],
    backend_op="ReluMinMax",
)
def annotate_relu_min_max(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator([aten.gelu.default], backend_op="Gelu")
def annotate_gelu(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator([aten.elu.default], backend_op="Elu")
def annotate_elu(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator([aten.hardswish.default, aten.hardswish_.default], backend_op="HardSwish")
def annotate_hardswish(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator(
    [aten.softmax.int, aten._softmax.default, aten._safe_softmax.default], backend_op="Softmax"
)
def annotate_softmax(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator([aten.log_softmax.int], backend_op="LogSoftmax")
def annotate_log_softmax(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)
