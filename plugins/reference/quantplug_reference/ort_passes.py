"""Rewrites of the exported QDQ ONNX model, and session settings, that let ONNX Runtime pick
faster kernels.

Each keeps the model standard ONNX and its results unchanged (the Q/DQ program stays the
reference); they only change how the computation is spelled or prepared.

* ``int4_weight_matmuls``: a linear with a float input and a 4-bit weight (``weight_only_int4``)
  is exported as ``Gemm(x, DequantizeLinear(W), b, transB=1)`` (2-D input) or
  ``MatMul(x, Transpose(DequantizeLinear(W))) + b`` (3-D), which ORT runs by dequantizing the
  whole weight on every call. Spelled ``MatMul(x, DequantizeLinear(W^T)) + b`` (weight stored
  transposed, scales moved to the matching axis), ORT fuses it into ``MatMulNBits``, which reads
  the packed 4-bit weight directly. ORT would fold ``MatMul + Add`` into a ``Gemm`` first, so such
  models run with its ``MatMulAddFusion`` off (``DISABLED_OPTIMIZERS``).
* ``session_config``: a model without quantized activations or 4-bit weights (weight-only int8,
  dynamic int8) gains nothing from ORT's QDQ fusions; with them off, ORT folds each weight's
  ``DequantizeLinear`` into a float constant once, at load, instead of running it on every call
  (``MatMulNBits`` on 8-bit weights, the alternative, is slower than float on x86). The file
  keeps the int8 weights.
"""

from __future__ import annotations

from typing import Any

#: ORT graph optimizers to switch off for models rewritten by ``int4_weight_matmuls``
DISABLED_OPTIMIZERS = ("MatMulAddFusion",)


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def session_config(model: Any) -> dict[str, str]:
    """ORT session config entries for ``model`` (see the module docstring)."""
    from onnx import TensorProto

    inits = {t.name: t.data_type for t in model.graph.initializer}
    activations = any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    four_bit = any(
        n.op_type == "DequantizeLinear" and inits.get(n.input[0]) in (TensorProto.INT4, TensorProto.UINT4)
        for n in model.graph.node
    )
    return {} if activations or four_bit else {"session.disable_quant_qdq": "1"}


def int4_weight_matmuls(model: Any) -> dict[str, dict[str, str]]:
    """Rewrite linears with float inputs and 4-bit weights in place (module docstring).

    Returns, per rewritten weight (the output name of its ``DequantizeLinear``), the new names of
    its ``quantized`` data, ``scale`` and ``zero_point`` initializers (stored transposed).
    """
    from onnx import TensorProto, helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)

    def weight_dq(name: str) -> Any:
        """The DequantizeLinear of a 4-bit initializer producing ``name``, read only there."""
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or len(users.get(dq.output[0], [])) != 1:
            return None
        data = inits.get(dq.input[0])
        if data is None or data.data_type not in (TensorProto.INT4, TensorProto.UINT4) or len(data.dims) != 2:
            return None
        if len(users.get(dq.input[0], [])) != 1 or any(n and n not in inits for n in dq.input[1:]):
            return None
        return dq

    def float_input(name: str) -> bool:
        src = producer.get(name)
        return src is None or src.op_type != "DequantizeLinear"

    rewritten: dict[str, dict[str, str]] = {}
    replace: dict[int, list[Any]] = {}  # id(node) -> replacement nodes ([] drops it)
    for node in graph.node:
        if node.op_type == "Gemm" and len(node.input) >= 2 and float_input(node.input[0]):
            a = _attrs(node)
            if (a.get("transA", 0), a.get("transB", 0), a.get("alpha", 1.0), a.get("beta", 1.0)) != (
                0,
                1,
                1.0,
                1.0,
            ):
                continue
            dq = weight_dq(node.input[1])
            if dq is None:
                continue
            _transpose_weight(graph, inits, users, dq, rewritten)
            out = node.output[0]
            if len(node.input) > 2 and node.input[2]:
                replace[id(node)] = [
                    helper.make_node(
                        "MatMul", [node.input[0], dq.output[0]], [out + "_matmul"], name=node.name + "_matmul"
                    ),
                    helper.make_node(
                        "Add", [out + "_matmul", node.input[2]], [out], name=node.name + "_bias"
                    ),
                ]
            else:
                replace[id(node)] = [
                    helper.make_node("MatMul", [node.input[0], dq.output[0]], [out], name=node.name)
                ]
        elif node.op_type == "Transpose" and _attrs(node).get("perm") in ([1, 0], (1, 0)):
            dq = weight_dq(node.input[0])
            readers = users.get(node.output[0], [])
            if dq is None or not readers:
                continue
            if not all(
                r.op_type == "MatMul" and list(r.input).index(node.output[0]) == 1 and float_input(r.input[0])
                for r in readers
            ):
                continue
            _transpose_weight(graph, inits, users, dq, rewritten)
            for r in readers:
                r.input[1] = dq.output[0]
            replace[id(node)] = []
    if replace:
        nodes = []
        for node in graph.node:
            nodes.extend(replace.get(id(node), [node]))
        del graph.node[:]
        graph.node.extend(nodes)
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        keep = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return rewritten


def _transpose_weight(
    graph: Any,
    inits: dict[str, Any],
    users: dict[str, list[Any]],
    dq: Any,
    rewritten: dict[str, dict[str, str]],
) -> None:
    """Store ``dq``'s 2-D weight as W^T, its per-axis/blocked qparams moved to match."""
    import numpy as np
    from onnx import helper, numpy_helper

    names = list(dq.input) + [""] * (3 - len(dq.input))
    w_name, s_name, z_name = names[:3]
    weight = numpy_helper.to_array(inits[w_name])
    scale = numpy_helper.to_array(inits[s_name])
    zero = numpy_helper.to_array(inits[z_name]) if z_name else None
    attrs = _attrs(dq)
    axis = int(attrs.get("axis", 1)) % 2
    new_attrs: dict[str, Any] = {}
    if scale.ndim == 2:  # blocked: the grid transposes with the weight
        scale, zero = scale.T, None if zero is None else zero.T
        new_attrs = {"axis": 1 - axis, "block_size": int(attrs.get("block_size", 0))}
    elif scale.ndim == 1 and scale.size > 1:  # per axis
        new_attrs = {"axis": 1 - axis}
    inputs = []
    for role, old, value in (
        ("quantized", w_name, weight.T),
        ("scale", s_name, scale),
        ("zero_point", z_name, zero),
    ):
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
    dq.CopyFrom(helper.make_node("DequantizeLinear", inputs, [dq.output[0]], name=dq.name, **new_attrs))
