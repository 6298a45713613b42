"""Graph passes: one before annotation, one annotation stage, two during lowering (one rewrites,
one checks)."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from quantplug.backend import (
    DEQUANTIZE_OPS,
    BackendContext,
    QuantizationSpecBase,
    SharedQuantizationSpec,
    ValidationReport,
    Violation,
    annotate_node,
    get_annotation,
    is_annotated,
    is_float_tensor,
    set_backend_node_data,
    working_copy,
)
from quantplug_example_vendor.configs import UNIT

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


#: ops the chip's DMA engine runs: they move bytes and compute nothing
DATA_MOVEMENT = (aten.flatten.using_ints, aten.reshape.default, aten.view.default)


def share_data_movement(gm: GraphModule, context: BackendContext) -> None:
    """A flatten, reshape or view reads and writes the encoding its consumers read.

    The DMA engine copies bytes, so such a node is quantized exactly when every consumer reads
    it quantized, on that consumer's grid: no requantization on either side. That depends on
    the annotations the rules gave its consumers, so this is an annotation stage (hook
    ``quantplug_annotation_passes``), run once every rule ran. Consumers come first (reverse
    graph order): a chain of moves takes the encoding at its end. A move feeding a float node
    or the program's output stays float.
    """
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function" or node.target not in DATA_MOVEMENT or is_annotated(node):
            continue
        source = node.args[0]
        if not isinstance(source, Node) or not is_float_tensor(node) or context.config_for(node) is None:
            continue
        if not node.users or any(_input_spec(user, node) is None for user in node.users):
            continue
        shared = SharedQuantizationSpec((node, next(iter(node.users))))  # the first consumer's input
        annotate_node(node, {source: shared}, shared)
        set_backend_node_data(node, UNIT, "dma")


def _input_spec(user: Node, node: Node) -> QuantizationSpecBase | None:
    """The spec ``user``'s annotation gives its input ``node``, if any."""
    annotation = get_annotation(user)
    return None if annotation is None else annotation.input_qspec_map.get(node)


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
