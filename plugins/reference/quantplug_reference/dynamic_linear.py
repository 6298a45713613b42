"""Dynamic int8 linear layers (preset ``dynamic_int8``) as integer matrix products in ONNX.

In the Q/DQ program a dynamic linear reads ``dequantize_per_token(q, s, z)`` (its input, int8
per token, quantized at run time) and ``dequantize_per_channel(W)`` (its int8 symmetric weight).
Exported as such, ONNX Runtime dequantizes both and multiplies in float: no faster than the
float model. ``fuse_dynamic_linears`` replaces each such linear (on a copy made for the ONNX
export only) with ``quantplug_reference::dynamic_linear``, whose ONNX translation is

    acc = MatMulInteger(q + 128 as uint8, W^T [, 128])  # int32, ORT's U8S8 (or U8U8) kernel
    acc -= (z + 128) * column_sums(W^T)                 # = sum_k (q_k - z) W_kn, exactly
    y = float(acc) * (s * w_scale) + bias

A weight past ``[-64, 64]`` (``weight_bits=8``) is stored as uint8 ``W + 128`` with zero point
128, so that ORT multiplies with its U8U8 kernels: its U8S8 ones saturate pairs of products on
AVX2 / AVX-512BW CPUs without VNNI (see ``accumulation``). The integer part is exact; the result
differs from the program's float arithmetic by float rounding only. In PyTorch the op computes
exactly what the replaced nodes computed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug_reference.peers.accumulation import SATURATION_FREE_WEIGHT_MAX

qd = torch.ops.quantized_decomposed


@torch.library.custom_op("quantplug_reference::dynamic_linear", mutates_args=())
def _dynamic_linear(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    weight_t: torch.Tensor,
    weight_zero_point: torch.Tensor,
    weight_scale: torch.Tensor,
    column_sums: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    x = qd.dequantize_per_token.default(q, scale, zero_point, -128, 127, torch.int8, torch.float32)
    signed = (weight_t.to(torch.int16) - weight_zero_point.to(torch.int16)).to(torch.int8)
    w = qd.dequantize_per_channel.default(
        signed.t().contiguous(),
        weight_scale,
        torch.zeros_like(weight_scale, dtype=torch.int64),
        0,
        -127,
        127,
        torch.int8,
    )
    return torch.nn.functional.linear(x, w, bias)


@_dynamic_linear.register_fake
def _(q, scale, zero_point, weight_t, weight_zero_point, weight_scale, column_sums, bias):  # type: ignore[no-untyped-def]
    return q.new_empty((*q.shape[:-1], weight_t.shape[1]), dtype=torch.float32)


dynamic_linear = torch.ops.quantplug_reference.dynamic_linear.default


def _attr(gm: GraphModule, node: Any) -> torch.Tensor | None:
    if not (isinstance(node, Node) and node.op == "get_attr"):
        return None
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def fuse_dynamic_linears(gm: GraphModule) -> dict[str, dict[str, str]]:
    """Replace ``linear(dequantize_per_token(...), dequantize_per_channel(W), b)`` in place.

    Returns, per replaced weight dequantize node, the buffers that now hold the weight
    (``quantized``, transposed to ``[in, out]``) and its ``scale``.
    """
    fused: dict[str, dict[str, str]] = {}
    for linear in list(gm.graph.nodes):
        if linear.op != "call_function" or linear.target != torch.ops.aten.linear.default:
            continue
        x, w = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else None
        if not (isinstance(x, Node) and x.target == qd.dequantize_per_token.default):
            continue
        if not (isinstance(w, Node) and w.target == qd.dequantize_per_channel.default and len(w.users) == 1):
            continue
        q, scale, zero_point, qmin, qmax, dtype = x.args[:6]
        wq, ws, wz = _attr(gm, w.args[0]), _attr(gm, w.args[1]), _attr(gm, w.args[2])
        if (qmin, qmax, dtype) != (-128, 127, torch.int8) or wq is None or ws is None or wz is None:
            continue
        if w.args[3] != 0 or wq.dtype != torch.int8 or wq.dim() != 2 or bool((wz != 0).any()):
            continue
        if bias is not None and not isinstance(bias, Node):
            continue
        name = str(w.args[0].target).replace(".", "_")  # type: ignore[union-attr]
        weight_t = wq.t().contiguous()
        sums = weight_t.to(torch.int32).sum(dim=0, dtype=torch.int32)
        if weight_t.numel() and int(weight_t.to(torch.int16).abs().max()) > SATURATION_FREE_WEIGHT_MAX:
            stored, wzp = (
                (weight_t.to(torch.int16) + 128).to(torch.uint8),
                torch.tensor(128, dtype=torch.uint8),
            )
        else:
            stored, wzp = weight_t, torch.tensor(0, dtype=torch.int8)
        gm.register_buffer(name + "_t", stored)
        gm.register_buffer(name + "_wzp", wzp)
        gm.register_buffer(name + "_colsum", sums)
        gm.register_buffer(name + "_wscale", ws.to(torch.float32).contiguous())
        with gm.graph.inserting_before(linear):
            wt_node = gm.graph.get_attr(name + "_t")
            wzp_node = gm.graph.get_attr(name + "_wzp")
            sums_node = gm.graph.get_attr(name + "_colsum")
            ws_node = gm.graph.get_attr(name + "_wscale")
            new = gm.graph.call_function(
                dynamic_linear, (q, scale, zero_point, wt_node, wzp_node, ws_node, sums_node, bias)
            )
        new.meta.update(
            {k: v for k, v in linear.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
        )
        linear.replace_all_uses_with(new)
        gm.graph.erase_node(linear)
        fused[w.name] = {"quantized": name + "_t", "scale": name + "_wscale"}
        if wzp.dtype == torch.uint8:
            fused[w.name]["zero_point"] = name + "_wzp"
    if fused:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return fused


_INT32, _INT64, _UINT8, _FLOAT = 6, 7, 2, 1


def _t_dynamic_linear(
    q: Any,
    scale: Any,
    zero_point: Any,
    weight_t: Any,
    weight_zero_point: Any,
    weight_scale: Any,
    column_sums: Any,
    bias: Any = None,
) -> Any:
    """ONNX translation: integer product of the uint8-shifted activation and the stored weight."""
    import numpy as np
    import onnx_ir as ir
    import onnxscript

    op: Any = onnxscript.opset21

    def const(value: Any, dtype: Any) -> Any:
        return op.Constant(value=ir.tensor(np.array(value, dtype=dtype)))

    shifted = op.Cast(op.Add(op.Cast(q, to=_INT32), const(128, np.int32)), to=_UINT8)
    acc = op.MatMulInteger(shifted, weight_t, None, weight_zero_point)
    zero = op.Add(op.Cast(zero_point, to=_INT32), const(128, np.int32))
    acc = op.Sub(acc, op.Mul(zero, op.Cast(column_sums, to=_INT32)))
    y = op.Mul(op.Cast(acc, to=_FLOAT), op.Mul(op.Cast(scale, to=_FLOAT), weight_scale))
    return y if bias is None else op.Add(y, bias)


def translations() -> dict[Any, Any]:
    return {dynamic_linear: _t_dynamic_linear}
