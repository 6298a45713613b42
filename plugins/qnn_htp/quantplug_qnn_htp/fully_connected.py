"""Linears on N-D inputs lowered as 2-D fully connected layers (a lowering pass, issue 17).

The ONNX exporter writes ``linear`` on a 3-D input (every transformer projection) as
``Transpose(W) + MatMul + Add``: the MatMul output has no quantize/dequantize, so QNN would see
an unencoded tensor in the middle of a quantized layer, and a MatMul plus an elementwise Add
instead of its ``FullyConnected`` (which is 2-D on HTP; ExecuTorch reshapes around it too). A
2-D linear exports as one ``Gemm``. This pass, run on the quantized program before export,
rewrites

    DQ(x) -> linear -> Q -> DQ -> consumer     into
    DQ(x) -> reshape(-1, in) -> linear -> Q -> DQ -> view(*lead, out) -> consumer

The quantize of the output moves onto the 2-D result (same parameters, same values), and the
reshapes only move values, so the numbers do not change, no encoding is added, and QNN gives
each reshape output its input's encoding (data movement). It runs at lowering, not before
annotation, so the quantized program -- and its parity with ExecuTorch -- is untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug.backend import BackendContext, kept_meta

aten = torch.ops.aten
_QDQ_NAMESPACES = frozenset({"quantized_decomposed", "quantplug"})


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else node


def _is_qdq(node: Node) -> bool:
    """A quantize or dequantize node of the program (torch's decomposed ops or quantplug's)."""
    namespace = getattr(node.target, "namespace", None)
    return node.op == "call_function" and namespace in _QDQ_NAMESPACES and "quantize" in str(node.target)


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


class _Rewrite:
    """One linear's rewrite: the flattened input, the 2-D output chain, the views back."""

    def __init__(self, gm: GraphModule, node: Node, lead: list[Any], out_features: int) -> None:
        self.graph = gm.graph
        self.meta = kept_meta(node, trace=("nn_module_stack", "stack_trace"))
        self.lead = lead
        self.out_features = out_features

    def call(self, target: Any, args: tuple[Any, ...], val: Any) -> Node:
        node = self.graph.call_function(target, args)
        node.meta.update(self.meta)
        node.meta["val"] = val
        return node

    def restore(self, producer: Node, val_3d: Any) -> None:
        """Make ``producer`` (and the Q/DQ chain after it) 2-D, with a view back to 3-D for every
        consumer outside that chain."""
        producer.meta["val"] = _reshaped(val_3d, [-1, self.out_features])
        outside = [u for u in producer.users if not _is_qdq(u)]
        for user in [u for u in producer.users if _is_qdq(u)]:
            self.restore(user, val_3d)
        if outside:
            with self.graph.inserting_after(producer):
                view = self.call(aten.view.default, (producer, [*self.lead, self.out_features]), val_3d)
            for user in outside:
                user.replace_input_with(producer, view)


def linear_to_2d(program: GraphModule, context: BackendContext | None = None) -> None:
    """Rewrite every linear with a rank > 2 input around a 2-D linear (see the module docstring)."""
    graph = program.graph
    flat_inputs: dict[Node, Node] = {}  # linears reading one tensor share one reshape
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
        rewrite = _Rewrite(program, node, [], out_features)
        for i, dim in enumerate(x_val.shape[:-1]):  # ints, or sym_size nodes where dynamic
            if isinstance(dim, int):
                rewrite.lead.append(dim)
            else:
                with graph.inserting_before(node):
                    rewrite.lead.append(rewrite.call(aten.sym_size.int, (x, i), dim))
        flat = flat_inputs.get(x)
        if flat is None:
            with graph.inserting_before(node):
                flat = rewrite.call(
                    aten.reshape.default, (x, [-1, in_features]), _reshaped(x_val, [-1, in_features])
                )
            flat_inputs[x] = flat
        node.args = (flat, *node.args[1:])
        rewrite.restore(node, y_val)
        changed = True
    if changed:
        graph.lint()
        program.recompile()
