"""Rewrites of the exported QDQ ONNX model that let ONNX Runtime pick faster kernels.

Each rewrite keeps the model standard ONNX and its results unchanged (the Q/DQ program stays the
reference); they only change how the computation is spelled.

* ``weight_only_matmuls``: a linear whose input is float and whose weight is dequantized
  (weight-only presets) is exported as ``Gemm(x, DequantizeLinear(W), b, transB=1)``, which ORT
  runs by dequantizing the whole weight on every call. Spelled
  ``MatMul(x, DequantizeLinear(W^T)) + b`` instead (weight stored transposed, its scales moved to
  the matching axis), ORT fuses it into ``MatMulNBits``, which reads the 4/8-bit weight directly.
  Per-channel weights are written as blocks along the inputs that repeat each channel's scale
  (the same grid, in the form ``MatMulNBits`` reads).
  ORT would fold the ``MatMul + Add`` back into a ``Gemm`` first, so sessions of such models
  disable its ``MatMulAddFusion`` (``DISABLED_OPTIMIZERS``).
"""

from __future__ import annotations

from typing import Any

#: ORT graph optimizers to switch off for models rewritten by ``weight_only_matmuls``
DISABLED_OPTIMIZERS = ("MatMulAddFusion",)


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _block_for(inputs: int) -> int:
    """The largest block MatMulNBits accepts (a power of two, 16..256) that tiles ``inputs``."""
    for b in (256, 128, 64, 32, 16):
        if inputs % b == 0:
            return b
    return 0


def weight_only_matmuls(model: Any) -> dict[str, dict[str, str]]:
    """Rewrite weight-only ``Gemm`` nodes in place.

    Returns, per rewritten weight (the output name of its ``DequantizeLinear``), the new names of
    its ``quantized`` data, ``scale`` and ``zero_point`` initializers (stored transposed).
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    rewritten: dict[str, dict[str, str]] = {}
    new_nodes: dict[int, list[Any]] = {}  # id(gemm) -> replacement nodes
    for gemm in graph.node:
        if gemm.op_type != "Gemm" or len(gemm.input) < 2:
            continue
        a = _attrs(gemm)
        if a.get("transA", 0) != 0 or a.get("transB", 0) != 1 or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
            continue
        x_src = producer.get(gemm.input[0])
        if x_src is not None and x_src.op_type == "DequantizeLinear":
            continue  # a quantized input: ORT makes a QGemm of it
        dq = producer.get(gemm.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or len(users.get(dq.output[0], [])) != 1:
            continue
        names = list(dq.input) + [""] * (3 - len(dq.input))
        w_name, s_name, z_name = names[:3]
        if w_name not in inits or s_name not in inits or (z_name and z_name not in inits):
            continue
        if len(users.get(w_name, [])) != 1:
            continue  # a weight read by another node too: leave it alone
        weight = numpy_helper.to_array(inits[w_name])
        if weight.ndim != 2:
            continue
        scale = numpy_helper.to_array(inits[s_name])
        zero = numpy_helper.to_array(inits[z_name]) if z_name else None
        da = _attrs(dq)
        axis = int(da.get("axis", 1)) % 2
        block = int(da.get("block_size", 0))
        new_attrs: dict[str, Any] = {}
        if scale.ndim == 2:  # blocked: the grid transposes with the weight
            scale, zero = scale.T, None if zero is None else zero.T
            new_attrs = {"axis": 1 - axis, "block_size": block}
        elif scale.ndim == 1 and scale.size > 1 and axis == 0 and _block_for(weight.shape[1]):
            # per output channel: the same grid as blocks along the inputs, each block repeating
            # its channel's scale, which is the form MatMulNBits reads
            b = _block_for(weight.shape[1])
            reps = weight.shape[1] // b
            scale = np.repeat(scale[None, :], reps, axis=0)
            zero = None if zero is None else np.repeat(zero[None, :], reps, axis=0)
            new_attrs = {"axis": 0, "block_size": b}
        elif scale.ndim == 1 and scale.size > 1:  # per axis
            new_attrs = {"axis": 1 - axis}
        inputs = []
        for role, old, value in (("quantized", w_name, weight.T), ("scale", s_name, scale), ("zero_point", z_name, zero)):
            if not old or value is None:
                continue
            new = old + "_t"
            while new in inits:
                new += "_"
            tensor = numpy_helper.from_array(np.ascontiguousarray(value), new)
            if len(users.get(old, [])) == 1:  # renamed in place
                inits[old].CopyFrom(tensor)
                inits[new] = inits.pop(old)
            else:  # shared (the exporter merges equal constants): a private copy
                graph.initializer.append(tensor)
                inits[new] = graph.initializer[-1]
                users[old] = [u for u in users[old] if u is not dq]
            users[new] = [dq]
            inputs.append(new)
            rewritten.setdefault(dq.output[0], {})[role] = new
        new_dq = helper.make_node("DequantizeLinear", inputs, [dq.output[0]], name=dq.name, **new_attrs)
        dq.CopyFrom(new_dq)
        out = gemm.output[0]
        if len(gemm.input) > 2 and gemm.input[2]:
            mm = helper.make_node("MatMul", [gemm.input[0], dq.output[0]], [out + "_matmul"], name=gemm.name + "_matmul")
            add = helper.make_node("Add", [out + "_matmul", gemm.input[2]], [out], name=gemm.name + "_bias")
            new_nodes[id(gemm)] = [mm, add]
        else:
            new_nodes[id(gemm)] = [helper.make_node("MatMul", [gemm.input[0], dq.output[0]], [out], name=gemm.name)]
    if new_nodes:
        nodes = []
        for node in graph.node:
            nodes.extend(new_nodes.get(id(node), [node]))
        del graph.node[:]
        graph.node.extend(nodes)
        used = {name for node in graph.node for name in node.input}
        keep = [t for t in graph.initializer if t.name in used or t.name in {o.name for o in graph.output}]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return rewritten
