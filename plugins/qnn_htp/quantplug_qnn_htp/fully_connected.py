"""Linears on N-D inputs lowered as 2-D fully connected layers (a lowering pass, issue 17).

The ONNX exporter writes ``linear`` on a 3-D input (every transformer projection) as
``Transpose(W) + MatMul + Add``: the MatMul output has no quantize/dequantize, so QNN would see
an unencoded tensor in the middle of a quantized layer, and a MatMul plus an elementwise Add
instead of its ``FullyConnected`` (which is 2-D on HTP; ExecuTorch reshapes around it too). A
2-D linear exports as one ``Gemm``. This pass, run on the quantized program before export,
rewrites

    DQ(x) -> linear -> Q(y)     into
    DQ(x) -> reshape(-1, in) -> Q -> DQ -> linear -> Q -> DQ -> view(*lead, out) -> Q(y)

repeating ``x``'s and ``y``'s own quantization parameters around the reshapes, so the program's
numbers do not change (requantizing on the same grid is exact) and every ONNX tensor of the
layer has an encoding. It runs at lowering, not before annotation, so the quantized program --
and its parity with ExecuTorch -- is untouched (an observer added before calibration would move
the moving-average statistics of the groups it joins).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug import BackendContext

aten = torch.ops.aten
_qd = torch.ops.quantized_decomposed
#: per-tensor quantize/dequantize pairs whose parameters can be repeated around a reshape
_PAIRS = {
    _qd.dequantize_per_tensor.default: _qd.quantize_per_tensor.default,
    _qd.dequantize_per_tensor.tensor: _qd.quantize_per_tensor.tensor,
}
_QUANTIZE = frozenset(_PAIRS.values())
_KEEP_META = ("nn_module_stack", "stack_trace", "quantplug_debug_handle")


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else node


class _Emitter:
    def __init__(self, gm: GraphModule, like: Node) -> None:
        self.graph = gm.graph
        self.meta = {k: like.meta[k] for k in _KEEP_META if k in like.meta}

    def call(self, target: Any, args: tuple[Any, ...], val: Any) -> Node:
        node = self.graph.call_function(target, args)
        node.meta.update(self.meta)
        if val is not None:
            node.meta["val"] = val
        return node

    def requantized(self, x: Node, dq_like: Node) -> Node:
        """``DQ(Q(x))`` on the grid of the per-tensor dequantize ``dq_like``."""
        params = dq_like.args[1:]
        q = self.call(_PAIRS[dq_like.target], (x, *params), None)  # type: ignore[index]
        return self.call(dq_like.target, (q, *params), _val(x))


def _reshaped(val: Any, shape: list[Any]) -> Any:
    """``val.reshape(shape)`` on the fake tensor (``-1`` keeps dynamic dims symbolic)."""
    if not isinstance(val, torch.Tensor):
        return None
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([val])
    if mode is None:
        return val.reshape(shape)
    with mode:
        return val.reshape(shape)


def linear_to_2d(program: GraphModule, context: BackendContext | None = None) -> None:
    """Rewrite every linear with a rank > 2 input around a 2-D linear (see the module docstring)."""
    graph = program.graph
    flat_inputs: dict[tuple[Any, ...], Node] = {}  # one reshape per quantized source and grid
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x = node.args[0]
        x_val, y_val = _val(x), _val(node)
        if not isinstance(x, Node) or not isinstance(x_val, torch.Tensor) or x_val.dim() <= 2:
            continue
        in_features, out_features = x_val.shape[-1], y_val.shape[-1]
        if not isinstance(in_features, int) or not isinstance(out_features, int):
            continue
        emit = _Emitter(program, node)
        lead: list[Any] = []  # the leading dims to restore: ints, or sym_size nodes where dynamic
        for i, dim in enumerate(x_val.shape[:-1]):
            if isinstance(dim, int):
                lead.append(dim)
            else:
                with graph.inserting_before(node):
                    lead.append(emit.call(aten.sym_size.int, (x, i), dim))
        quantized = x.op == "call_function" and x.target in _PAIRS
        key = (x.args[0], *x.args[1:]) if quantized else (x,)
        flat = flat_inputs.get(key)
        if flat is None:
            with graph.inserting_before(node):
                flat = emit.call(
                    aten.reshape.default, (x, [-1, in_features]), _reshaped(x_val, [-1, in_features])
                )
                if quantized:
                    flat = emit.requantized(flat, x)
            flat_inputs[key] = flat
        node.args = (flat, *node.args[1:])
        node.meta["val"] = _reshaped(y_val, [-1, out_features])
        users = list(node.users)
        quantizes = [u for u in users if u.op == "call_function" and u.target in _QUANTIZE]
        out: Node = node
        if len(quantizes) == 1 and len(users) == 1:
            q = quantizes[0]
            dq_target = next(d for d, qt in _PAIRS.items() if qt is q.target)
            with graph.inserting_after(node):
                q2 = emit.call(q.target, (node, *q.args[1:]), None)
            with graph.inserting_after(q2):
                out = emit.call(dq_target, (q2, *q.args[1:]), node.meta["val"])
        with graph.inserting_after(out):
            restored = emit.call(aten.view.default, (out, [*lead, out_features]), y_val)
        for user in users:
            user.replace_input_with(node, restored)
        changed = True
    if changed:
        graph.lint()
        program.recompile()
