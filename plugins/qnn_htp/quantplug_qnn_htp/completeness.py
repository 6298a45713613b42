"""Is every tensor the QNN converter sees encoded? The completeness check of ``model.encodings``.

HTP runs integer graphs: an op it runs quantized needs an encoding on every float tensor it reads
or writes, or the converter computes that tensor in float (or rejects the graph). The check reads
the written ONNX model and the names written to ``model.encodings`` and classifies every ONNX op
(Q/DQ pairs folded away, as the converter folds them):

* a **quantized op** touches at least one encoded float tensor; each of its float tensors without
  an encoding is **missing** -- typically an intermediate of a PyTorch op the ONNX exporter
  expanded into several ONNX ops (no Q/DQ between them);
* a **float op** is one quantplug left float (no rule, discarded: the reason recorded at
  annotation), or one that touches no encoded tensor; its unencoded tensors are listed with that
  reason. Constant subgraphs (ops computing from constants and tensor shapes only) are skipped:
  the converter, whose graphs have static shapes, folds them into the static tensors they make.

A tensor counts as encoded when ``model.encodings`` names it, when it is the dequantized copy of
an encoded tensor (``x -> QuantizeLinear -> DequantizeLinear``, the converter's view), or when a
data-movement op (reshape, transpose, slice... QNN's math-invariant ops, AIMET's
``is_output_quantized: False``; also a cast to the input's own type) produced it from encoded
inputs: QNN gives such outputs their input's encoding.

``check`` returns a :class:`CompletenessReport` (counts, missing and float tensors with reasons)
that the writer stores in ``artifact.json``; ``check_completeness`` also raises
:class:`IncompleteEncodingsError` listing the missing tensors when the quantizer is strict.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch.fx import GraphModule

from quantplug.backend import LoweringError, float_reason

#: ONNX ops of the Q/DQ encoding itself (folded into encodings by the converter)
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
#: ONNX ops whose output takes its (encoded) input's encoding in QNN: they only move values
DATA_MOVEMENT = frozenset(
    {
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Identity",
        "Expand",
        "Tile",
        "Slice",
        "Split",
        "Gather",
        "GatherElements",
        "GatherND",
        "DepthToSpace",
        "SpaceToDepth",
        "MaxPool",
        "ReduceMax",
        "ReduceMin",
        "Concat",
    }
)
#: ONNX op -> inputs that QNN takes as static op parameters, not as tensors with an encoding
#: (clip bounds, resize scales, the pad value, the batch-norm statistics it folds)
PARAMETER_INPUTS: dict[str, frozenset[int]] = {
    "Clip": frozenset({1, 2}),
    "Resize": frozenset({1, 2, 3}),
    "Pad": frozenset({1, 2, 3}),
    "BatchNormalization": frozenset({3, 4}),
}
#: ONNX tensor element types that hold real numbers (float, float16, double, bfloat16)
_FLOAT_TYPES = frozenset({1, 10, 11, 16})
_NOT_A_TENSOR = -1
#: ONNX ops whose input 2 is a bias derived from the input and weight scales
_WEIGHTED = frozenset({"Gemm", "Conv", "ConvTranspose"})
#: ONNX ops that are identities when their output type equals their input type
_SAME_TYPE_IDENTITIES = frozenset({"Cast", "CastLike"})
_FX_NODE = re.compile(r"%([\w.]+)\s*:")
FX_NODE_KEY = "pkg.torch.onnx.fx_node"


class IncompleteEncodingsError(LoweringError):
    """``strict`` lowering refused to write an encodings file that leaves quantized ops' tensors
    without an encoding. ``missing`` lists them (:class:`TensorStatus`)."""

    def __init__(self, report: CompletenessReport) -> None:
        self.report = report
        self.missing = list(report.missing)
        shown = "\n".join("  " + t.format() for t in self.missing[:40])
        more = f"\n  ... and {len(self.missing) - 40} more" if len(self.missing) > 40 else ""
        super().__init__(
            f"{len(self.missing)} tensor(s) of ops that HTP runs quantized have no encoding in "
            f"model.encodings ({report.encoded}/{report.tensors} encoded):\n{shown}{more}\n"
            "Quantize the PyTorch ops they come from (or keep those ops float with "
            "quantizer.discard(...)); get_quantizer('qnn_htp', strict=False) writes the file anyway "
            "and lists these tensors in artifact.json."
        )


@dataclass(frozen=True)
class TensorStatus:
    """One float ONNX tensor without an encoding, where it is and why."""

    tensor: str
    onnx_op: str  # the ONNX op type that reads or writes it
    onnx_node: str
    source: str  # the PyTorch (FX) node the ONNX op comes from, when known
    reason: str

    def format(self) -> str:
        where = f"{self.onnx_op} {self.onnx_node!r}"
        if self.source:
            where += f" (from {self.source})"
        return f"{self.tensor!r} of {where}: {self.reason}"

    def to_dict(self) -> dict[str, str]:
        return {
            "tensor": self.tensor,
            "onnx_op": self.onnx_op,
            "onnx_node": self.onnx_node,
            "source": self.source,
            "reason": self.reason,
        }


@dataclass
class CompletenessReport:
    """Which float ONNX tensors of quantized ops are encoded, and what stays float."""

    quantized_ops: int = 0
    float_ops: int = 0
    tensors: int = 0  # float tensors of quantized ops
    encoded: int = 0  # ... of which encoded (explicitly or through Q/DQ and data movement)
    inherited: int = 0  # ... of which only through a data-movement op
    missing: list[TensorStatus] = field(default_factory=list)
    float_tensors: list[TensorStatus] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def fraction(self) -> float:
        return self.encoded / self.tensors if self.tensors else 1.0

    def warnings(self) -> list[str]:
        """One line per missing tensor, then one per float op (its tensors, why it is float)."""
        lines = [f"qnn_htp: no encoding for {t.format()}" for t in self.missing]
        by_op: dict[tuple[str, str, str], list[str]] = {}
        for t in self.float_tensors:
            by_op.setdefault((t.source or t.onnx_node, t.onnx_op, t.reason), []).append(t.tensor)
        for (where, op, reason), names in by_op.items():
            lines.append(f"qnn_htp: left float: {op} from {where!r} ({', '.join(names)}): {reason}")
        return lines

    def metadata(self) -> dict[str, Any]:
        """What ``artifact.json`` records: the counts, every tensor without an encoding and why,
        and ``warnings`` lines (which ``quantplug quantize`` copies into its report)."""
        return {"encoding_completeness": self.to_dict(), "warnings": self.warnings()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "complete": self.complete,
            "quantized_ops": self.quantized_ops,
            "float_ops": self.float_ops,
            "tensors": self.tensors,
            "encoded": self.encoded,
            "inherited": self.inherited,
            "fraction": self.fraction,
            "missing": [t.to_dict() for t in self.missing],
            "float_tensors": [t.to_dict() for t in self.float_tensors],
        }


# --- the ONNX graph -----------------------------------------------------------------------------


def _element_types(model: Any) -> dict[str, int]:
    """Element type of every named tensor (shape inference fills the intermediates the exporter
    left untyped; it keeps the types stated, so it is skipped when every tensor has one)."""
    import onnx

    types = _stated_types(model.graph)
    if not all(types.get(o) for node in model.graph.node for o in node.output if o):
        try:
            types = _stated_types(onnx.shape_inference.infer_shapes(model).graph)
        except Exception:  # a model shape inference cannot handle: use what the exporter recorded
            pass
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] not in types:
            types[node.output[0]] = 1  # float32 unless the exporter said otherwise
    return types


def _stated_types(graph: Any) -> dict[str, int]:
    """The element types ``graph`` states: value infos (0 where undefined), initializers, and
    the values of Constant nodes."""
    types: dict[str, int] = {}
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
        else:  # a sequence (SplitToSequence...), map or optional: not a tensor an encoding describes
            types[vi.name] = _NOT_A_TENSOR
    for init in graph.initializer:
        types[init.name] = init.data_type
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
    return types


_FX_TARGET = re.compile(r"target=([\w.]+)")


def _fx_target(node: Any) -> str:
    for prop in node.metadata_props:
        if prop.key == FX_NODE_KEY:
            found = _FX_TARGET.search(prop.value)
            return found.group(1) if found else ""
    return ""


def _fx_source(node: Any) -> str:
    for prop in node.metadata_props:
        if prop.key == FX_NODE_KEY:
            found = _FX_NODE.search(prop.value)
            return found.group(1) if found else ""
    return ""


def check(model: Any, encoded_names: Iterable[str], program: GraphModule | None = None) -> CompletenessReport:
    """Classify every ONNX op of ``model`` and find the float tensors of quantized ops.

    ``encoded_names`` are the tensor names ``model.encodings`` holds; ``program`` (the quantized
    program that was exported) supplies the reasons recorded at annotation.
    """
    graph = model.graph
    types = _element_types(model)
    producer = {out: node for node in graph.node for out in node.output if out}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    encoded = set(encoded_names)
    fx_nodes = {n.name: n for n in program.graph.nodes} if program is not None else {}  # by name

    def is_float(name: str) -> bool:
        return bool(name) and types.get(name, 1 if name in producer else 0) in _FLOAT_TYPES

    def through_qdq(name: str) -> bool:
        """``name`` is a DequantizeLinear output of an encoded (or requantized) tensor."""
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return False
        q = producer.get(dq.input[0])
        while q is not None and q.op_type == "Clip":  # narrowed grids: Q -> Clip -> DQ
            q = producer.get(q.input[0])
        return q is not None and q.op_type == "QuantizeLinear" and state(q.input[0])

    memo: dict[str, bool] = {}
    inherited: set[str] = set()

    def state(name: str) -> bool:
        if name in encoded:
            return True
        if name in memo:
            return memo[name]
        memo[name] = False  # cycles cannot occur in ONNX; this only guards the recursion
        result = through_qdq(name)
        node = producer.get(name)
        if not result and node is not None and _moves_data(node, types):
            data = [
                i for i in node.input[: 1 if node.op_type in _SAME_TYPE_IDENTITIES else None] if is_float(i)
            ]
            result = bool(data) and all(state(i) for i in data)
            if result:
                inherited.add(name)
        memo[name] = result
        return result

    constant = _constant_tensors(graph)
    origin = _Origins(graph, program)
    report = CompletenessReport()
    counted: set[str] = set()
    seen_float: set[str] = set()
    for node in graph.node:
        if node.op_type in _QDQ or node.op_type == "Constant" or _is_qdq_clip(node, producer):
            continue
        values = _value_inputs(node)
        if values and all(i in constant for i in values):
            continue  # a constant subgraph: the converter folds it into the static tensor it makes
        params = PARAMETER_INPUTS.get(node.op_type, frozenset())
        inputs = [t for i, t in enumerate(node.input) if i not in params]
        tensors = [t for t in (*inputs, *node.output) if is_float(t)]
        if not tensors:
            continue
        status = {t: state(t) for t in tensors}
        fx = origin(node)
        source = fx.name if fx is not None else _fx_source(node)
        left_float = fx is not None and fx.op == "call_function" and float_reason(fx) is not None
        if left_float:  # quantplug kept this op float (no rule, discarded...): its encoded
            status = {t: ok for t, ok in status.items() if not ok}  # inputs are dequantized ones
        if not left_float and any(status.values()):
            report.quantized_ops += 1
            for t, ok in status.items():
                if t in counted:
                    continue
                counted.add(t)
                report.tensors += 1
                if ok:
                    report.encoded += 1
                    report.inherited += t in inherited
                else:
                    why = _missing_reason(t, node, producer, consumers, fx_nodes)
                    report.missing.append(TensorStatus(t, node.op_type, node.name, source, why))
        else:
            report.float_ops += 1
            for t in status:
                if t in seen_float:
                    continue
                seen_float.add(t)
                report.float_tensors.append(
                    TensorStatus(t, node.op_type, node.name, source, _float_reason(fx))
                )
    return report


_STACK_KEY = "pkg.torch.onnx.stack_trace"


class _Origins:
    """The program node an ONNX node comes from.

    Usually the exporter names it (``pkg.torch.onnx.fx_node``). An op the exporter decomposed
    before translating (no ONNX function for it: hardshrink, var...) leaves nodes named after its
    pieces instead, and an exporter that renames nodes leaves other names: both are matched by
    source line to the program nodes that have no ONNX node of their own -- the one with the same
    op (a renamed node), else the op left float on that line (whose pieces are float too).
    """

    def __init__(self, graph: Any, program: GraphModule | None) -> None:
        self.nodes = {n.name: n for n in program.graph.nodes} if program is not None else {}
        named = {_fx_source(n) for n in graph.node}
        self.vanished: dict[str, list[Any]] = {}
        for n in self.nodes.values():
            trace = n.meta.get("stack_trace")
            if n.op == "call_function" and n.name not in named and trace and "quantize" not in str(n.target):
                self.vanished.setdefault(str(trace).strip(), []).append(n)

    def __call__(self, node: Any) -> Any:
        found = self.nodes.get(_fx_source(node))
        if found is not None or not self.vanished:
            return found
        trace = next((p.value for p in node.metadata_props if p.key == _STACK_KEY), "")
        candidates = self.vanished.get(trace.strip(), [])
        target = _fx_target(node)
        same_op = [c for c in candidates if target and target.endswith(str(c.target))]
        if same_op:  # the program node itself, under another name
            return same_op[0]
        # a piece of a decomposed op: attribute it to the op left float on that line, if any
        return next((c for c in candidates if float_reason(c) is not None), None)


def _value_inputs(node: Any) -> list[str]:
    """The inputs whose values an op reads: ``CastLike`` takes only the type of its second (the
    exporter casts a scalar such as ReLU6's bound ``CastLike(min_val, x)``: still a constant)."""
    inputs = node.input[:1] if node.op_type == "CastLike" else node.input
    return [i for i in inputs if i]


#: ONNX ops that read only their input's shape. QNN graphs have static shapes (the converter is
#: given the input dimensions), so the converter folds what is computed from them, as from
#: constants: a dynamic-batch ``torch.zeros(batch, n)`` (an initial state) exports as
#: ``Expand(0.0, Concat(Shape(x)...))`` and becomes a static tensor
SHAPE_READERS = frozenset({"Shape", "Size"})


def _constant_tensors(graph: Any) -> set[str]:
    """Initializers, Constant outputs, shapes, and what ops compute from nothing else (in graph order)."""
    constant = {i.name for i in graph.initializer}
    for node in graph.node:
        inputs = _value_inputs(node)
        if node.op_type in ("Constant", *SHAPE_READERS) or (inputs and all(i in constant for i in inputs)):
            constant.update(o for o in node.output if o)
    return constant


def _moves_data(node: Any, types: dict[str, int]) -> bool:
    """Data movement (the output takes its input's encoding), or a cast to the input's own type."""
    if node.op_type in DATA_MOVEMENT:
        return True
    if node.op_type in _SAME_TYPE_IDENTITIES and node.input and node.output:
        return types.get(node.input[0]) == types.get(node.output[0]) in _FLOAT_TYPES
    return False


def _is_qdq_clip(node: Any, producer: dict[str, Any]) -> bool:
    """The Clip a narrowed-range quantize exports as (``QuantizeLinear -> Clip``)."""
    if node.op_type != "Clip" or not node.input:
        return False
    src = producer.get(node.input[0])
    return src is not None and src.op_type == "QuantizeLinear"


def _missing_reason(
    tensor: str,
    node: Any,
    producer: dict[str, Any],
    consumers: dict[str, list[Any]],
    fx_nodes: dict[str, Any],
) -> str:
    source = _fx_source(node)
    fx = fx_nodes.get(source)
    made_by = producer.get(tensor)
    inside = made_by is node or (made_by is not None and _fx_source(made_by) == source)
    if source and tensor != source and inside:
        target = str(fx.target) if fx is not None and fx.op == "call_function" else source
        return (
            f"intermediate tensor of {target}: the ONNX exporter expanded this quantized op into "
            "several ONNX ops and no quantize/dequantize sits between them"
        )
    if made_by is None and node.op_type in _WEIGHTED and list(node.input)[2:3] == [tensor]:
        return (
            "the bias of a layer whose input has no encoding (an int32 bias is derived from the input scale)"
        )
    # a neighbour left float (discarded, no rule...) takes the edge with it
    neighbours = [made_by] if made_by is not None else []
    neighbours += consumers.get(tensor, [])
    for other in neighbours:
        name = _fx_source(other)
        reason = float_reason(fx_nodes[name]) if name in fx_nodes else None
        if reason:
            return f"the edge to {name!r}, which stays float ({reason})"
    return "a float input or output of a quantized op (no quantize/dequantize on this edge)"


def _float_reason(fx: Any) -> str:
    reason = float_reason(fx) if fx is not None else None
    if reason:
        return str(reason)
    if fx is not None and fx.op == "call_function":
        return f"{fx.target} is not quantized (no quantized neighbour)"
    return "computed in float (no quantized input or output)"


def check_completeness(
    model: Any, encoded_names: Iterable[str], program: GraphModule | None = None, *, strict: bool
) -> CompletenessReport:
    """:func:`check`, then raise :class:`IncompleteEncodingsError` if ``strict`` and tensors of
    quantized ops lack an encoding (the writer's entry point: nothing is written then)."""
    report = check(model, encoded_names, program)
    if strict and not report.complete:
        raise IncompleteEncodingsError(report)
    return report
