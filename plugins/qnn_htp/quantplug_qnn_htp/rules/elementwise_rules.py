"""Element-wise arithmetic, comparison, logic and unary math ops (QNN ``ElementWise*``)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import QuantizationConfig, annotate_binary, register_annotator
from quantplug_qnn_htp.rules.common import (
    MASK_ARGS_KEY,
    annotate_all_float_args,
    annotate_siso,
    observe_absolute_range,
)

aten = torch.ops.aten

_BINARY = {
    "ElementWiseAdd": [aten.add.Tensor, aten.add_.Tensor],
    "ElementWiseSubtract": [aten.sub.Tensor, aten.rsub.Tensor],
    "ElementWiseMultiply": [aten.mul.Tensor, aten.mul_.Tensor],
    "ElementWiseDivide": [aten.div.Tensor, aten.divide.Tensor],
    "ElementWiseFloorDiv": [aten.floor_divide.default],
    "ElementWiseMaximum": [aten.max.other, aten.maximum.default],
    "ElementWiseMinimum": [aten.min.other, aten.minimum.default],
    "ElementWiseEqual": [aten.eq.Tensor],
    "ElementWiseNotEqual": [aten.ne.Tensor],
    "ElementWiseGreater": [aten.gt.Tensor],
    "ElementWiseGreaterEqual": [aten.ge.Tensor],
    "ElementWiseLess": [aten.lt.Tensor],
    "ElementWiseLessEqual": [aten.le.Tensor],
    "ElementWiseAnd": [aten.__and__.Tensor, aten.logical_and.default],
    "ElementWiseOr": [aten.bitwise_or.Tensor, aten.__or__.Tensor],
    "ElementWiseXor": [aten.bitwise_xor.Tensor, aten.__xor__.Tensor],
}

_UNARY = {
    "ElementWiseAbs": [aten.abs.default],
    "ElementWiseAsin": [aten.asin.default],
    "ElementWiseAtan": [aten.atan.default],
    "ElementWiseCeil": [aten.ceil.default],
    "ElementWiseCos": [aten.cos.default],
    "ElementWiseExp": [aten.exp.default],
    "ElementWiseFloor": [aten.floor.default],
    "ElementWiseLog": [aten.log.default],
    "ElementWiseNeg": [aten.neg.default],
    "ElementWiseRound": [aten.round.default, aten.round.decimals],
    "ElementWiseSign": [aten.sign.default],
    "ElementWiseSin": [aten.sin.default],
    "ElementWiseSquareRoot": [aten.sqrt.default],
    # ExecuTorch annotates pow.Tensor_Tensor single-in-single-out (the exponent stays float)
    "ElementWisePower": [aten.pow.Tensor_Tensor, aten.square.default],
    "CumulativeSum": [aten.cumsum.default],
    "Cast": [aten.to.dtype],
}


def _binary(backend_op: str, ops: list) -> None:
    @register_annotator(ops, backend_op=backend_op)
    def annotate(node: Node, config: QuantizationConfig) -> None:
        if node.meta.get(MASK_ARGS_KEY):  # additive -inf mask (see the mark_masks pass)
            annotate_all_float_args(node, config, limit=2)
        else:
            annotate_binary(node, config)
        observe_absolute_range(node, config)

    annotate.__name__ = f"annotate_{backend_op}"
    globals()[annotate.__name__] = annotate


def _unary(backend_op: str, ops: list) -> None:
    @register_annotator(ops, backend_op=backend_op)
    def annotate(node: Node, config: QuantizationConfig) -> None:
        annotate_siso(node, config)

    annotate.__name__ = f"annotate_{backend_op}"
    globals()[annotate.__name__] = annotate


for _op, _ops in _BINARY.items():
    _binary(_op, _ops)
for _op, _ops in _UNARY.items():
    _unary(_op, _ops)


@register_annotator([aten.prelu.default], backend_op="Prelu")
def annotate_prelu(node: Node, config: QuantizationConfig) -> None:
    annotate_binary(node, config)


# QNN has no 1:1 op here in ExecuTorch's table (rsqrt: its BackendOpInfo entry is bypassed)
@register_annotator([aten.rsqrt.default])
def annotate_rsqrt(node: Node, config: QuantizationConfig) -> None:
    annotate_siso(node, config)


@register_annotator([aten.where.self, aten.where.ScalarSelf], backend_op="ElementWiseSelect")
def annotate_where(node: Node, config: QuantizationConfig) -> None:
    annotate_all_float_args(node, config)


@register_annotator([aten.masked_fill.Tensor])
def annotate_masked_fill(node: Node, config: QuantizationConfig) -> None:
    annotate_all_float_args(node, config)
