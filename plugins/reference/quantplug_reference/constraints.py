"""What the reference lowering (QDQ ONNX run by ONNX Runtime's CPU kernels) requires, as op
constraints (hook ``quantplug_op_constraints``).

Only facts of the lowering are declared, each true under every preset (they depend on the
``onnx_opset`` option alone), because per-layer overrides (mixed precision) put one preset's
configs on another preset's quantizer.

**Activation grids.** Every encoding measured at run time becomes an ONNX ``QuantizeLinear``,
whose outputs are uint8/int8 up to opset 20 and also uint16/int16 from opset 21 (int32 is no
``QuantizeLinear`` output at any opset: ORT refuses to load such a model). Declared on the output
of every op the rules claim (an output encoding is measured at run time, or shared with one that
is) and on input 0 where the rules give it an activation encoding (not on embedding tables,
gathered expert weights or ``addmm``'s bias, which are constants). With opset 18-20 a 16-bit
preset is thus refused at ``prepare``, naming the nodes, instead of at ``lower``.

Deliberately not declared, because the lowering handles them (measured on ORT 1.32): weight grids
and symmetry (asymmetric per-channel int8 weights lower and run exactly; 16-bit, 4-bit and
per-block weights need opset 21, which the exporter itself reports); shared encodings around
data movement and concatenation (ORT keeps Q/DQ pairs of unequal encodings around a reshape, and
its ``QLinearConcat`` takes inputs of different encodings, exactly; the rules share them for
accuracy and speed, not because the lowering needs it); and the int32 bias at input x weight
scale that ORT's fused kernels read (nothing is fused at 16 bits, a convolution whose bias is on
another scale is left unfused, and the core raises the bias scale of degenerate weight channels
on purpose, ``floor_bias_scale``: such a relation would refuse models the lowering runs).
"""

from __future__ import annotations

from functools import cache

import torch

from quantplug.backend import OUTPUT, OpConstraint, PortConstraint, rules_from_index

SOURCE = "quantplug-reference (QDQ ONNX on ONNX Runtime)"
#: the first opset whose QuantizeLinear has 16-bit outputs
OPSET_16_BIT = 21

#: ops whose input 0 is a constant the rules quantize as a weight (or a bias), not an activation
CONSTANT_INPUT_OPS = ("aten.embedding.default", "aten.index.Tensor", "aten.addmm.default")
#: ops without a tensor input of their own: the pieces of a split (``operator.getitem``)
OUTPUT_ONLY_OPS = ("_operator.getitem",)


@cache
def claimed_ops() -> frozenset[str]:
    """Every op the reference rules claim (read from their index, importing no rules module); an
    extension's rule for another op is constrained on its output only (what its input 0 holds is
    the extension's business)."""
    return frozenset(op for module in rules_from_index("quantplug_reference.rules") for op in module.ops)


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


@cache
def constraints_for(op: str, opset: int) -> tuple[OpConstraint, ...]:
    """The constraints of one claimed op (by ATen name) when lowering at ``opset``."""
    act = _activation(opset)
    if op in CONSTANT_INPUT_OPS or op in OUTPUT_ONLY_OPS or op not in claimed_ops():
        return (OpConstraint(op, ports={OUTPUT: act}, source=SOURCE),)
    return (OpConstraint(op, ports={0: act, OUTPUT: act}, source=SOURCE),)
