"""What a lowered ``qnn_htp`` model must be: pure Q/DQ around float ops, runnable as Q/DQ arithmetic.

Qualcomm's converter reads a QDQ ONNX model as float ops between ``QuantizeLinear`` /
``DequantizeLinear`` pairs and takes each tensor's encoding from them (and from the encodings
file). An integer op on a quantized tensor (the ``Clip`` 0.1.0 wrote after a ``QuantizeLinear`` to
narrow a 16-bit range) is none of that: the converter expects a float op there, and ONNX Runtime
has no kernel for it (``NOT_IMPLEMENTED: Where(16)``). Issue 45.2.

:func:`integer_domain_ops` lists every op of a model that computes on integers other than:

* ``QuantizeLinear`` (writes a quantized tensor) and ``DequantizeLinear`` (reads one): a quantized
  tensor (a ``QuantizeLinear`` output, or an integer constant a ``DequantizeLinear`` reads) may be
  read by ``DequantizeLinear`` only;
* the ops whose integer inputs are indices, shapes or parameters, which the QNN converter takes
  as such (``/work/shared/reference/qnn-formats-and-constraints.md``: Argmax/Argmin with
  ``INT_32`` outputs, Gather/Embedding indices, the data-movement ops ``Reshape``, ``Transpose``,
  ``Squeeze``/``Unsqueeze``, ``Slice``, ``Split`` (also as torch's exporter spells ``unbind``:
  ``SplitToSequence``/``SequenceAt``), ``Tile``/``Expand``, ``Pad``, ``TopK``, ``Cast``/``CastLike``
  (not quantized)), and the shape and index arithmetic that feeds them (the "OTHERS" rows of the
  HTP op definitions: ``INT_32`` element-wise ops, ``Shape``, ``Range``, ``Concat`` of shapes),
  provided that none of their inputs is a quantized tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: ops reading integers that are indices, shapes or parameters (never quantized values)
INDEX_OPS = frozenset(
    {
        # data movement and indexing (QNN: same encoding in and out; integer indices/shapes)
        "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Split", "Tile", "Expand", "Pad",
        "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements", "TopK", "ArgMax",
        "ArgMin", "Cast", "CastLike", "SplitToSequence", "SequenceAt", "OneHot", "Resize", "Trilu",
        "CumSum", "ConstantOfShape", "Range",
        "ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "Shape", "Size", "Concat", "Identity",
        # integer shape/index arithmetic (HTP "OTHERS" rows: INT_32 element-wise ops, comparisons)
        "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Min", "Max", "Equal", "Less", "LessOrEqual",
        "Greater", "GreaterOrEqual", "Where", "Not", "And", "Or", "Sign",
    }
)  # fmt: skip

_INTEGER_TYPES = {2, 3, 4, 5, 6, 7, 12, 13, 21, 22, 25, 26}  # TensorProto (u)int2/4/8/16/32/64


def _types(model: Any) -> dict[str, int]:
    """Element type of every value the model names (inputs, initializers, inferred values)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)}
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def integer_domain_ops(model: Any) -> list[str]:
    """``"Clip 'name' reads the quantized tensor 'x'"``: each op computing on quantized integers,
    or on integers outside the QNN converter's index/shape ops (empty: the model is pure Q/DQ)."""
    types = _types(model)
    graph = model.graph
    quantized = {n.output[0] for n in graph.node if n.op_type == "QuantizeLinear"}
    quantized |= {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    found: list[str] = []
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            extra = [i for i in node.input[1:] if i in quantized]
            if node.op_type == "QuantizeLinear" and node.input[0] in quantized:
                extra.append(node.input[0])
            found += [f"{node.op_type} {node.name!r} reads the quantized tensor {i!r}" for i in extra]
            continue
        for name in node.input:
            if name in quantized:
                found.append(f"{node.op_type} {node.name!r} reads the quantized tensor {name!r}")
            elif types.get(name) in _INTEGER_TYPES and node.op_type not in INDEX_OPS:
                found.append(f"{node.op_type} {node.name!r} computes on the integer tensor {name!r}")
    return found


def run_without_optimizations(model_bytes: bytes, batches: list[tuple[Any, ...]]) -> list[Any]:
    """The model run by ONNX Runtime's CPU kernels with every graph rewrite off: Q/DQ arithmetic,
    each op as the model spells it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    outputs = []
    for batch in batches:
        feeds = {
            n: np.asarray(t.detach().numpy() if hasattr(t, "detach") else t) for n, t in zip(names, batch)
        }
        result = session.run(None, feeds)
        outputs.append(result[0] if len(result) == 1 else tuple(result))
    return outputs


def flat(outputs: Any) -> list[Any]:
    """Every tensor of a list of (possibly nested) outputs, in order."""
    import torch

    leaves = torch.utils._pytree.tree_leaves(outputs)
    return [np.asarray(t.detach().numpy() if isinstance(t, torch.Tensor) else t) for t in leaves]


def decibels_below(reference: list[Any], program: list[Any], onnx_outputs: list[Any]) -> float:
    """How far the ONNX model's SQNR against ``reference`` (float) is below the program's, in dB."""

    def sqnr(outs: list[Any]) -> float:
        signal = noise = 0.0
        for r, o in zip(flat(reference), flat(outs), strict=True):
            r64, o64 = r.astype(np.float64), o.astype(np.float64)
            signal += float((r64**2).sum())
            noise += float(((r64 - o64) ** 2).sum())
        return math.inf if noise == 0 else 10 * math.log10(signal / noise)

    ours, theirs = sqnr(program), sqnr(onnx_outputs)
    if math.isinf(ours) and math.isinf(theirs):
        return 0.0
    return min(ours, 100.0) - min(theirs, 100.0)
