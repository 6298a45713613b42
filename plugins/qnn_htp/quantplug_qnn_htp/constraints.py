"""Built-in HTP op constraints (no QNN SDK needed), from the HTP op definition supplement as
encoded by ExecuTorch, ONNX Runtime and AIMET (qnn-formats-and-constraints section 4).

Ports follow the core's numbering: tensor inputs in argument order (0, 1, 2...) and ``"output"``.
Architecture gates are independent of SDK availability (ExecuTorch only checks them when the
SDK's BackendOpInfo is importable):

* LPBQ (per-block weights) needs HTP V69+ (Conv2d, Conv3d, FullyConnected, transpose convs);
* 16-bit activations with 16-bit weights need V73+ (Conv2d, Conv3d, FullyConnected, MatMul,
  TransposeConv2d/3d, and ``Gemm``: ``addmm`` with constant weights, a FullyConnected on HTP)
  -- ExecuTorch's conv/linear checks test ``int32`` weights and never fire.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import torch

from quantplug.backend import (
    INT2,
    INT4,
    OUTPUT,
    ArchRequirement,
    OpConstraint,
    Port,
    PortConstraint,
    SpecKind,
    spec_kind,
    spec_range,
)

ACT = frozenset({torch.uint8, torch.uint16, torch.int8, torch.int16})
WEIGHT = frozenset({torch.int8, torch.uint8, torch.int16, INT4, INT2})
BIAS = frozenset({torch.int32})
SOURCE = "built-in (HtpOpDefSupplement via ExecuTorch/ORT/AIMET)"

V69, V73 = 69, 73


def _bits(spec: object) -> int:
    if spec is None or spec_kind(spec) is SpecKind.SHARED:
        return 0
    lo, hi = spec_range(spec)
    return int(hi - lo).bit_length()


def _is_block(ports: Mapping[Port, object]) -> bool:
    return getattr(ports.get(1), "block_size", None) is not None


def _is_16x16(ports: Mapping[Port, object]) -> bool:
    return _bits(ports.get(0)) == 16 and _bits(ports.get(1)) == 16


def _is_16x16_gemm(ports: Mapping[Port, object]) -> bool:
    return _bits(ports.get(1)) == 16 and _bits(ports.get(2)) == 16


LPBQ = ArchRequirement(V69, "LPBQ (16a4w block-wise weights) requires HTP V69 or newer", _is_block)
A16W16 = ArchRequirement(V73, "16-bit activations with 16-bit weights require HTP V73 or newer", _is_16x16)
#: ``addmm(bias, x, W)`` (ONNX Gemm, a FullyConnected on HTP): activation port 1, weight port 2
A16W16_GEMM = ArchRequirement(V73, A16W16.reason, _is_16x16_gemm)

_act = PortConstraint(dtypes=ACT, description="UFIXED/SFIXED 8 or 16-bit activation")
_weight = PortConstraint(dtypes=WEIGHT, symmetric=True, description="symmetric weights (offset 0)")
_bias = PortConstraint(dtypes=BIAS, symmetric=True, description="SFIXED_POINT_32 symmetric bias")


def arch_requirements(backend_op: str | None) -> tuple[ArchRequirement, ...]:
    """The HTP architecture gates of a QNN op (applied with or without an SDK)."""
    if backend_op in ("Conv2d", "Conv3d", "FullyConnected"):
        return (LPBQ, A16W16)
    if backend_op in ("TransposeConv2d", "TransposeConv3d", "MatMul"):
        return (A16W16,)
    if backend_op == "Gemm":
        return (A16W16_GEMM,)
    return ()


def _weighted(op: str) -> OpConstraint:
    return OpConstraint(
        op,
        ports={0: _act, 1: _weight, 2: _bias, OUTPUT: _act},
        arch=arch_requirements(op),
        source=SOURCE,
    )


def _sigmoid_qparams(qmin: int, qmax: int) -> tuple[float, int]:
    return 1.0 / (qmax - qmin + 1), 0


def _tanh16_qparams(qmin: int, qmax: int) -> tuple[float, int] | None:
    """16-bit tanh: 1/32768 with zero at the grid middle; 8-bit tanh is calibrated (None: unchecked)."""
    if qmax - qmin <= 255:
        return None
    return 1.0 / 32768.0, (qmin + qmax + 1) // 2


_SHARED_OPS = ("Reshape", "Transpose", "DepthToSpace", "SpaceToDepth", "ChannelShuffle", "Tile")


@cache
def _table() -> dict[str, OpConstraint]:
    t: dict[str, OpConstraint] = {}
    for op in ("Conv2d", "Conv3d", "FullyConnected", "TransposeConv2d", "TransposeConv3d"):
        t[op] = _weighted(op)
    # addmm(bias, x, W): the converter turns Gemm into FullyConnected (ports in addmm's order)
    t["Gemm"] = OpConstraint(
        "Gemm",
        ports={0: _bias, 1: _act, 2: _weight, OUTPUT: _act},
        arch=arch_requirements("Gemm"),
        source=SOURCE,
    )
    per_tensor_act = PortConstraint(dtypes=ACT, per_tensor_only=True, description="MatMul: per-tensor only")
    t["MatMul"] = OpConstraint(
        "MatMul",
        ports={0: per_tensor_act, 1: per_tensor_act, OUTPUT: _act},
        arch=arch_requirements("MatMul"),
        source=SOURCE,
    )
    fixed_sigmoid = PortConstraint(
        dtypes=ACT, fixed_scale_fn=_sigmoid_qparams, description="scale 1/(qmax-qmin+1), offset 0"
    )
    t["Sigmoid"] = OpConstraint("Sigmoid", ports={0: _act, OUTPUT: fixed_sigmoid}, source=SOURCE)
    t["ElementWiseNeuron"] = OpConstraint(
        "ElementWiseNeuron", ports={0: _act, OUTPUT: fixed_sigmoid}, source=SOURCE
    )
    fixed_tanh = PortConstraint(
        dtypes=ACT,
        fixed_scale_fn=_tanh16_qparams,  # type: ignore[arg-type]
        description="16-bit: 1/32768, offset -32768",
    )
    t["Tanh"] = OpConstraint("Tanh", ports={0: _act, OUTPUT: fixed_tanh}, source=SOURCE)
    for op in _SHARED_OPS:
        t[op] = OpConstraint(op, ports={0: _act, OUTPUT: _act}, must_share_input_output=True, source=SOURCE)
    per_tensor_sym_bias = PortConstraint(
        dtypes=BIAS, symmetric=True, per_tensor_only=True, description="per-tensor bias"
    )
    t["LayerNorm"] = OpConstraint(
        "LayerNorm",
        ports={
            0: _act,
            1: PortConstraint(dtypes=ACT | WEIGHT, per_tensor_only=True),
            2: per_tensor_sym_bias,
            OUTPUT: _act,
        },
        source=SOURCE,
    )
    t["GroupNorm"] = OpConstraint(
        "GroupNorm",
        ports={
            0: _act,
            1: PortConstraint(dtypes=ACT | WEIGHT, per_tensor_only=True),
            2: per_tensor_sym_bias,
            OUTPUT: _act,
        },
        source=SOURCE,
    )
    return t


def _generic(op: str) -> OpConstraint:
    """Any other mapped QNN op: quantized ports are 8/16-bit fixed point."""
    return OpConstraint(op, ports={0: _act, 1: _act, OUTPUT: _act}, source=SOURCE)


def constraints_for(backend_op: str | None) -> list[OpConstraint]:
    """The built-in constraints of one QNN op (empty for ops without a 1:1 QNN op)."""
    if backend_op is None:
        return []
    found = _table().get(backend_op)
    return [found if found is not None else _generic(backend_op)]
