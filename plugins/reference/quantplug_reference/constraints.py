"""What the reference lowering (QDQ ONNX run by ONNX Runtime's CPU kernels) requires, as op
constraints (hook ``quantplug_op_constraints``).

Only facts of the lowering are declared, each true under every preset (they depend on the
``onnx_opset`` option alone), because per-layer overrides (mixed precision) put one preset's
configs on another preset's quantizer:

* **Activation grids.** Every encoding measured at run time becomes an ONNX ``QuantizeLinear``,
  whose outputs are uint8/int8 up to opset 20 and also uint16/int16 from opset 21 (int32 is no
  ``QuantizeLinear`` output at any opset: ORT refuses to load such a model). Declared on the
  output of every op the rules claim (an output encoding is always measured at run time, or
  shared with one that is) and on input 0 where the rules give it an activation encoding (not
  on embedding tables, gathered expert weights or matrix-product biases, which are constants).
  With opset 18-20 a 16-bit preset is thus refused at ``prepare`` instead of at ``lower``.
* **The int32 bias of convolutions and linears.** ORT fuses ``DequantizeLinear`` -> ``Conv`` /
  ``Gemm`` -> ``QuantizeLinear`` into ``QLinearConv`` / ``QGemm``, which read the int32 bias
  as it is stored, at scale input x weight (ONNX's definition of those kernels). A bias at any
  other scale gives silently wrong outputs (measured: a linear's output off by 109 on a range
  of 39); a bias on another grid makes ORT leave the op unfused (float, without the int8
  speed-up the backend exists for). So the bias (port 2) is int32, symmetric, and its scale the
  product of input 0's and the weight's (:class:`ScaleProduct`, checked again on the
  calibrated values at ``convert``).

Deliberately not declared, because the lowering handles them (measured on ORT 1.32): weight grids
and symmetry (asymmetric per-channel int8 weights lower and run exactly; 16-bit, 4-bit and
per-block weights need opset 21, which the exporter itself reports), and shared encodings
around data movement and concatenation (ORT drops or keeps such Q/DQ pairs with unequal
encodings and still computes what the program computes; the rules share them for accuracy and
speed, not because the lowering needs it). ``addmm``'s bias has no relation either: the rules
derive it only when they can fuse it, and quantize it as an ordinary operand otherwise.
"""

from __future__ import annotations

from functools import cache

import torch

from quantplug.backend import OUTPUT, OpConstraint, PortConstraint, ScaleProduct
from quantplug_reference.rules import RULE_MODULES

SOURCE = "quantplug-reference (QDQ ONNX on ONNX Runtime)"
#: the first opset whose QuantizeLinear has 16-bit outputs
OPSET_16_BIT = 21

#: convolutions and linears: input 0, weight 1, int32 bias 2
WEIGHTED_OPS = (
    "aten.conv1d.default",
    "aten.conv2d.default",
    "aten.conv3d.default",
    "aten.conv_transpose1d.default",
    "aten.conv_transpose2d.input",
    "aten.conv_transpose3d.input",
    "aten.linear.default",
)
#: ops whose input 0 is a constant the rules quantize as a weight (or a bias), not an activation
CONSTANT_INPUT_OPS = ("aten.embedding.default", "aten.index.Tensor", "aten.addmm.default")
#: ops without a tensor input of their own: the pieces of a split (``operator.getitem``)
OUTPUT_ONLY_OPS = ("_operator.getitem",)
#: every op the reference rules claim; an extension's rule for another op is constrained on its
#: output only (what its input 0 holds is the extension's business)
CLAIMED_OPS = frozenset(op for module in RULE_MODULES for op in module.ops)


def activation_dtypes(opset: int) -> frozenset[torch.dtype]:
    """The grids ``QuantizeLinear`` produces at ``opset``."""
    eight = {torch.uint8, torch.int8}
    return frozenset(eight | {torch.uint16, torch.int16} if opset >= OPSET_16_BIT else eight)


def _activation(opset: int) -> PortConstraint:
    needs = "" if opset >= OPSET_16_BIT else f"; 16-bit needs onnx_opset >= {OPSET_16_BIT}"
    return PortConstraint(
        dtypes=activation_dtypes(opset),
        description=f"an activation is quantized by ONNX QuantizeLinear at opset {opset}{needs}",
    )


BIAS = PortConstraint(
    dtypes=frozenset({torch.int32}),
    symmetric=True,
    description="QLinearConv/QGemm read the bias as int32 with zero point 0",
)
BIAS_SCALE = ScaleProduct(
    2,
    (0, 1),
    description="QLinearConv/QGemm read the int32 bias at scale input x weight, as stored",
)


@cache
def constraints_for(op: str, opset: int) -> tuple[OpConstraint, ...]:
    """The constraints of one claimed op (by ATen name) when lowering at ``opset``."""
    act = _activation(opset)
    if op in WEIGHTED_OPS:
        return (
            OpConstraint(op, ports={0: act, 2: BIAS, OUTPUT: act}, relations=(BIAS_SCALE,), source=SOURCE),
        )
    if op in CONSTANT_INPUT_OPS or op in OUTPUT_ONLY_OPS or op not in CLAIMED_OPS:
        return (OpConstraint(op, ports={OUTPUT: act}, source=SOURCE),)
    return (OpConstraint(op, ports={0: act, OUTPUT: act}, source=SOURCE),)
