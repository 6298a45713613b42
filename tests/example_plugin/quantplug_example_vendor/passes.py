"""Graph passes: one before annotation, two during lowering (one rewrites, one checks)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from quantplug.backend import (
    DEQUANTIZE_OPS,
    BackendContext,
    ValidationReport,
    Violation,
    is_float_tensor,
    working_copy,
)

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


def lift_scalar_operands(gm: GraphModule, context: BackendContext) -> GraphModule:
    """``x + 0.5`` becomes ``x + c`` with ``c`` a constant tensor.

    The chip's adder reads two quantized tensors, so a Python scalar operand must become a
    tensor the annotator can give a quantization spec (it is then quantized like a weight).
    Runs on the core's working copy of the program, so adding attributes is safe.
    """
    graph = gm.graph
    lifted = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.add.Tensor or len(node.args) < 2:
            continue
        x, other = node.args[0], node.args[1]
        if isinstance(other, bool) or not isinstance(other, (int, float)) or not is_float_tensor(x):
            continue
        value = torch.tensor(float(other), dtype=x.meta["val"].dtype)  # type: ignore[union-attr]
        name = f"_example_vendor_scalar{lifted}"
        while hasattr(gm, name):
            lifted += 1
            name = f"_example_vendor_scalar{lifted}"
        gm.register_buffer(name, value)
        with graph.inserting_before(node):
            const = graph.get_attr(name)
        const.meta["val"] = value
        node.args = (x, const, *node.args[2:])
        lifted += 1
    if lifted:
        graph.lint()
        gm.recompile()
    return gm


def drop_redundant_relu(gm: GraphModule, context: BackendContext) -> GraphModule:
    """Remove ``relu`` when every user quantizes its output on a grid whose zero point is its minimum.

    ``quantize(relu(x)) == quantize(x)`` when ``zero_point == quant_min``: negative values clamp
    to the zero point either way. The chip's quantize stage then does the relu for free. The
    pass is exact, so the lowered program gives bit-identical results.

    ``lower()`` hands passes the user's converted program, so this pass edits a copy.
    """
    candidates = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target == aten.relu.default
        and n.users
        and all(_redundant_before(u) for u in n.users)
    ]
    if not candidates:
        return gm
    out = working_copy(gm)
    by_name = {n.name: n for n in out.graph.nodes}
    for relu in candidates:
        node = by_name[relu.name]
        node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
        out.graph.erase_node(node)
    out.graph.lint()
    out.recompile()
    out.meta["example_vendor_dropped_relus"] = [n.name for n in candidates]
    return out


def _redundant_before(user: Node) -> bool:
    """``user`` quantizes per tensor with zero point == quant_min (args: x, scale, zp, min, max, dtype)."""
    if user.op != "call_function" or user.target != qd.quantize_per_tensor.default:
        return False
    zero_point, quant_min = user.args[2], user.args[3]
    return isinstance(zero_point, int) and zero_point == quant_min


def check_standalone_relus(gm: GraphModule, context: BackendContext) -> None:
    """EV100 (arch 1) has no Relu unit: a relu must run fused into the linear/conv before it or
    be applied by a quantize stage (``drop_redundant_relu``). Any other relu is a violation,
    raised in strict mode and logged otherwise (the compiler then runs it on the host CPU).

    A relu reading a dequantize is standalone; a fused one reads its producer directly.
    """
    if context.state.get("arch", 0) >= 2:
        return
    report = ValidationReport()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != aten.relu.default:
            continue
        report.checked_nodes += 1
        source = node.args[0]
        if isinstance(source, Node) and source.target in DEQUANTIZE_OPS:
            report.violations.append(
                Violation(
                    node=node.name,
                    op="aten.relu.default",
                    backend_op="Relu",
                    port="output",
                    expected="a relu fused into its producer or applied by a quantize stage",
                    actual="a standalone relu (EV100 has no Relu unit)",
                    rule="standalone relu",
                    stage="lower",
                )
            )
    report.enforce(context.strict)
