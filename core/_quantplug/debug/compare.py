"""The numeric debugger: run the float and the quantized program on the same inputs and compare
every node's output with its float counterpart.

Nodes are matched through ``node.meta["quantplug_debug_handle"]`` (the float program's node name,
kept on every node derived from it through prepare and convert). Intermediate outputs are
captured with :class:`torch.fx.Interpreter`, so neither program nor any user module is modified:
no hooks, no observers, no recompilation.

For each op of the quantized program the value compared is what its consumers see: the output of
the dequantize that follows the op's quantize when its output is quantized, the op's own output
otherwise (float ops, or an op fused with the next one). Placeholders whose input is quantized are
compared too (the input quantization error).
"""

from __future__ import annotations

import copy
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from _quantplug.annotation.specs import Q_ANNOTATION_KEY as ANNOTATION_KEY
from _quantplug.debug.artifact import ArtifactRunner
from _quantplug.debug.decibels import format_db, json_float, sqnr
from _quantplug.errors import QuantplugError
from _quantplug.graph.calls import Call, check_flat_inputs, in_spec_of
from _quantplug.graph.mutation import mutated_aliases, private_inputs, writes_an_input, writes_in_place
from _quantplug.graph.op_names import op_name
from _quantplug.graph.working_copy import working_copy
from _quantplug.meta import DEBUG_HANDLE_KEY, FLOAT_REASON_KEY, GROUP_KEY, QPARAMS_KEY, observer_gid
from _quantplug.meta import STATE_KEY as PREPARED_KEY
from _quantplug.observers import block_ops as qp_ops
from _quantplug.rewrites.parameter_writes import functionalize_parameter_writes
from _quantplug.sharing.resolution import describe_key

_qd = torch.ops.quantized_decomposed
_aten = torch.ops.aten


def _q_dq_ops() -> tuple[set[Any], set[Any], set[Any]]:
    """(quantize ops, dequantize ops, qparam helper ops) as emitted by quantplug.convert."""
    quant = {
        _qd.quantize_per_tensor.default,
        _qd.quantize_per_tensor.tensor,
        _qd.quantize_per_channel.default,
        _qd.quantize_per_token.default,
        qp_ops.quantize_per_block,
    }
    dequant = {
        _qd.dequantize_per_tensor.default,
        _qd.dequantize_per_tensor.tensor,
        _qd.dequantize_per_channel.default,
        _qd.dequantize_per_token.default,
        qp_ops.dequantize_per_block,
    }
    helpers = {
        _qd.choose_qparams.tensor,
        _qd.choose_qparams_symmetric.tensor,
        _qd.choose_qparams_per_token_asymmetric.default,
    }
    return quant, dequant, helpers


_BATCH_NORMS = {
    _aten.batch_norm.default,
    _aten._native_batch_norm_legit_no_training.default,
}


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------


@dataclass
class NodeComparison:
    """One quantized-program node compared with its float counterpart over all inputs.

    ``sqnr_db`` is ``inf`` when the outputs are identical and ``None`` when nothing could be
    compared (shapes or dtypes differ, non-tensor output).
    """

    node: str  # name in the quantized program
    op: str  # canonical op name, or "input" for a placeholder
    handle: str  # the float node it descends from
    float_node: str | None  # the float node actually compared (differs when a batch norm was folded)
    quantized: bool  # annotated by the backend (its inputs and/or output are quantized)
    output_quantized: bool  # the compared value went through its own quantize/dequantize
    shape: tuple[int, ...] | None = None
    sqnr_db: float | None = None
    max_abs_error: float | None = None
    note: str = ""
    # accumulators (over batches)
    _signal: float = field(default=0.0, repr=False)
    _noise: float = field(default=0.0, repr=False)
    _count: int = field(default=0, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "handle": self.handle,
            "float_node": self.float_node,
            "quantized": self.quantized,
            "output_quantized": self.output_quantized,
            "shape": list(self.shape) if self.shape is not None else None,
            "sqnr_db": json_float(self.sqnr_db),
            "identical": self.sqnr_db == math.inf,
            "max_abs_error": json_float(self.max_abs_error),
            "note": self.note,
        }


@dataclass(frozen=True)
class FloatNode:
    """A node of the quantized program that computes in float, and why."""

    node: str
    op: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op": self.op, "reason": self.reason}


@dataclass(frozen=True)
class SharingGroupInfo:
    """One observer-sharing group: its members and its encoding."""

    gid: int
    members: tuple[str, ...]
    kind: str  # "activation", "constant" or "mixed"
    dtype: str | None
    granularity: str | None
    scale: float | None  # per-tensor scale, None for per-channel/block/dynamic
    zero_point: int | None
    quant_min: int | None
    quant_max: int | None
    channels: int | None = None  # number of scales when per-channel/per-block

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.gid,
            "members": list(self.members),
            "kind": self.kind,
            "dtype": self.dtype,
            "granularity": self.granularity,
            "scale": json_float(self.scale),
            "zero_point": self.zero_point,
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "channels": self.channels,
        }


@dataclass
class DebugReport:
    """What :func:`compare` found: per-node comparisons, model outputs, float nodes, sharing groups."""

    nodes: list[NodeComparison]
    outputs: list[NodeComparison]
    float_nodes: list[FloatNode]
    removed_nodes: list[FloatNode]  # float-program ops absent from the quantized one (folded, ...)
    sharing_groups: list[SharingGroupInfo]
    unmatched: list[str]  # quantized-program ops with no float counterpart
    batches: int
    quantized_ops: list[str] = field(default_factory=list)  # every annotated op of the program
    #: the backend's artifact against float and the program (``compare(..., artifact=...)``)
    artifact: Any = None  # _quantplug.debug.artifact.ArtifactComparison

    @property
    def coverage(self) -> tuple[int, int]:
        """(quantized ops, float ops) of the quantized program."""
        return len(self.quantized_ops), len(self.float_nodes)

    @property
    def output_sqnr_db(self) -> float | None:
        """SQNR over every model output together (None if no output could be compared)."""
        compared = [o for o in self.outputs if o._count]
        if not compared:
            return None
        return sqnr(sum(o._signal for o in compared), sum(o._noise for o in compared))

    @property
    def output_max_abs_error(self) -> float | None:
        errs = [o.max_abs_error for o in self.outputs if o.max_abs_error is not None]
        return max(errs) if errs else None

    @property
    def quantized_nodes(self) -> list[NodeComparison]:
        return [n for n in self.nodes if n.quantized]

    def node(self, name: str) -> NodeComparison:
        for n in self.nodes:
            if n.node == name:
                return n
        raise KeyError(name)

    def worst(self, count: int = 20, *, quantized_only: bool = False) -> list[NodeComparison]:
        """The ``count`` compared nodes with the lowest SQNR (worst first)."""
        pool = [n for n in self.nodes if n.sqnr_db is not None and (n.quantized or not quantized_only)]
        return sorted(pool, key=lambda n: (n.sqnr_db, n.node))[:count]  # type: ignore[arg-type,return-value]

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "output_sqnr_db": json_float(self.output_sqnr_db),
            "output_max_abs_error": json_float(self.output_max_abs_error),
            "outputs": [o.to_dict() for o in self.outputs],
            "nodes": [n.to_dict() for n in self.nodes],
            "float_nodes": [f.to_dict() for f in self.float_nodes],
            "removed_nodes": [f.to_dict() for f in self.removed_nodes],
            "sharing_groups": [g.to_dict() for g in self.sharing_groups],
            "unmatched": list(self.unmatched),
            "quantized_ops": list(self.quantized_ops),
            "artifact": None if self.artifact is None else self.artifact.to_dict(),
        }

    def format(self, worst: int = 10) -> str:
        """A plain-text summary."""
        out_sqnr = self.output_sqnr_db
        lines = [
            f"compared {len(self.nodes)} node(s) over {self.batches} batch(es); "
            f"model output SQNR {format_db(out_sqnr)}",
            f"{len(self.quantized_ops)} op(s) quantized, {len(self.float_nodes)} float",
        ]
        if self.artifact is not None:
            lines.insert(1, f"backend artifact output SQNR {self.artifact.describe()}")
        for f in self.float_nodes:
            lines.append(f"  float {f.node} [{f.op}]: {f.reason}")
        bad = self.worst(worst)
        if bad:
            lines.append("worst nodes:")
            for n in bad:
                shown = format_db(n.sqnr_db)
                lines.append(f"  {n.node:<32} {n.op:<32} SQNR {shown:>10}  max|err| {n.max_abs_error:.4g}")
        lines.append(f"{len(self.sharing_groups)} sharing group(s)")
        if self.unmatched:
            lines.append("no float counterpart: " + ", ".join(self.unmatched))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# capturing
# ------------------------------------------------------------------------------------------------


class _Capture(Interpreter):
    """Runs a GraphModule node by node, handing the outputs of chosen nodes to a callback.

    A value kept for later (the float side's) is copied when the graph writes in place
    (``relu_``, ``silu_``, ``add_``: torchvision's ``inplace=True``): the later op would otherwise
    overwrite the kept tensor, and a conv would be compared with its activation's output."""

    def __init__(self, gm: GraphModule, wanted: set[str], sink: Callable[[str, Any], None]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self._wanted = wanted
        self._sink = sink
        self._copy = any(writes_in_place(n) for n in gm.graph.nodes)
        self._writes_input = writes_an_input(gm.graph)

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.name in self._wanted:
            kept = pytree.tree_map_only(torch.Tensor, torch.clone, result) if self._copy else result
            self._sink(n.name, kept)
        return result

    def call(self, batch: Call, what: str) -> Any:
        """Run one batch, keyword inputs matched to placeholders by the module's calling convention."""
        flat = batch.flat(in_spec_of(self.module), what)
        check_flat_inputs(self.module, flat, what)  # a clear error, not torch's shape guard
        if self._writes_input:  # the float and the quantized side each get the caller's values
            flat = private_inputs(flat)
        return self.run(*flat, enable_io_processing=False)


def _as_batches(inputs: Any) -> list[Call]:
    """A tuple is one call's positional arguments, a dict its keyword arguments, a tensor one
    single-input call, a :class:`~_quantplug.graph.calls.Call` both; a list holds several batches."""
    if isinstance(inputs, (torch.Tensor, tuple, dict, Call)):
        return [Call.of(inputs)]
    if isinstance(inputs, list):
        return [Call.of(b) for b in inputs]
    if isinstance(inputs, Iterable):
        return _as_batches(list(inputs))
    raise QuantplugError(
        "compare() expects inputs as a tuple of arguments, a dict of keyword arguments or a list of "
        f"such batches, got {type(inputs).__name__}"
    )


def _float_graph_module(model: Any, example: Call) -> GraphModule:
    """A GraphModule of the float program whose node names are the debug handles."""
    if isinstance(model, torch.export.ExportedProgram):
        gm = working_copy(model)  # ep.module() shares (and would update) training-mode state
        functionalize_parameter_writes(gm)  # as prepare computes it: weights written once
        return gm
    if isinstance(model, GraphModule):
        return model
    if isinstance(model, torch.nn.Module):
        # export a copy so neither the user's module nor its train/eval flag is touched
        twin = copy.deepcopy(model).eval()
        try:
            exported = torch.export.export(twin, example.args, dict(example.kwargs))
        except Exception as exc:
            raise QuantplugError(
                f"compare() could not export the float model ({type(exc).__name__}: {exc}); "
                "pass the ExportedProgram that was quantized instead"
            ) from exc
        return _float_graph_module(exported, example)  # as prepare reads a program
    raise QuantplugError(
        "compare() expects the float model as an ExportedProgram, a GraphModule or an nn.Module, "
        f"got {type(model).__name__}"
    )


def _op_label(node: Node) -> str:
    if node.op == "placeholder":
        return "input"
    return op_name(node.target)


def _has_specs(node: Node) -> bool:
    ann = node.meta.get(ANNOTATION_KEY)
    if ann is None:
        return False
    specs = getattr(ann, "input_qspec_map", None) or {}
    return any(s is not None for s in specs.values()) or getattr(ann, "output_qspec", None) is not None


def _inner_piece(node: Node, handle: str) -> bool:
    """Whether every use of ``node``'s value (through its quantize/dequantize) stays inside the
    ops derived from the same float op: a piece of a decomposition, not its result."""
    frontier, seen = [node], {node}
    while frontier:
        for user in frontier.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                return False
            if str(user.target).startswith("quantized_decomposed."):
                frontier.append(user)  # the piece's own quantize/dequantize
            elif str(user.meta.get(DEBUG_HANDLE_KEY)) != handle:
                return False
    return True


def _float_counterpart(handle: str, float_nodes: dict[str, Node], present: set[str]) -> Node | None:
    """The float node whose value the quantized node ``handle`` computes.

    When a batch norm was folded into the conv/linear before it, the conv in the quantized
    program computes the batch norm's output: compare with that.
    """
    node = float_nodes.get(handle)
    if node is None:
        return None
    users = list(node.users)
    if len(users) == 1 and users[0].target in _BATCH_NORMS and users[0].name not in present:
        bn = users[0]
        if bn.target == _aten.batch_norm.default:
            return bn
        firsts = [u for u in bn.users if u.target is operator.getitem and u.args[1] == 0]
        if len(firsts) == 1:
            return firsts[0]
    return node


# ------------------------------------------------------------------------------------------------
# compare
# ------------------------------------------------------------------------------------------------


def compare(
    float_model: torch.export.ExportedProgram | torch.nn.Module,
    quantized: GraphModule,
    inputs: Any,
    *,
    prepared: GraphModule | None = None,
    artifact: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> DebugReport:
    """Compare every node of ``quantized`` with its float counterpart on the same inputs.

    Args:
        float_model: the float program that was quantized (``ExportedProgram``, its GraphModule,
            or the ``nn.Module`` it was exported from, which is exported again on a copy).
        quantized: the output of :func:`quantplug.convert`.
        inputs: one call's arguments (a tuple, a dict of keyword arguments, a
            :class:`~_quantplug.graph.calls.Call` for both, or a tensor for a single input) or a
            list of such batches (statistics are accumulated over all of them).
        prepared: optionally the prepared module, whose sharing groups (with every key) are then
            reported instead of those recovered from the quantized program.
        artifact: optionally what ``quantplug.lower`` made of ``quantized``: when it has a
            ``run`` method, it runs on every batch (``artifact.run(*flat_inputs)``, see
            :mod:`_quantplug.debug.artifact`) and the report gives its output SQNR against float
            beside the program's (``report.artifact``), flagging a gap over 1 dB. An artifact
            that cannot run here is reported as not measured, with the reason.
        progress: called as ``progress(done, total)`` after each batch.

    Returns:
        A :class:`DebugReport`. Neither program is modified.
    """
    if not isinstance(quantized, GraphModule):
        raise QuantplugError(
            f"compare() expects the quantized program as the GraphModule from quantplug.convert(), "
            f"got {type(quantized).__name__}"
        )
    if any(n.op == "call_module" and observer_gid(n.target) is not None for n in quantized.graph.nodes):
        raise QuantplugError(
            "compare() got a prepared module (it still has observers); pass quantplug.convert(prepared)"
        )
    batches = _as_batches(inputs)
    if not batches:
        raise QuantplugError("compare() needs at least one input batch")
    float_gm = _float_graph_module(float_model, batches[0])
    plan = _plan(float_gm, quantized)
    runner = None
    if artifact is not None:
        runner = ArtifactRunner(artifact)

    for index, batch in enumerate(batches):
        stored: dict[str, Any] = {}
        with torch.no_grad():
            float_out = _Capture(float_gm, plan.float_wanted, stored.__setitem__).call(
                batch, "the float model"
            )

            def sink(name: str, value: Any, stored: dict[str, Any] = stored) -> None:
                for entry in plan.by_quant_node.get(name, ()):
                    _accumulate(entry, stored.get(entry.float_node or ""), value)

            quant_out = _Capture(quantized, plan.quant_wanted, sink).call(batch, "the quantized program")
        del stored
        f_leaves = pytree.tree_leaves(float_out)
        q_leaves = pytree.tree_leaves(quant_out)
        if index == 0:
            plan.outputs[:] = [
                NodeComparison(
                    node=f"output[{i}]",
                    op="output",
                    handle=f"output[{i}]",
                    float_node=f"output[{i}]",
                    quantized=False,
                    output_quantized=False,
                )
                for i in range(min(len(f_leaves), len(q_leaves)))
            ]
        for entry, f, q in zip(plan.outputs, f_leaves, q_leaves):
            _accumulate(entry, f, q)
        if runner is not None and runner.active:
            flat = batch.flat(in_spec_of(quantized), "the quantized program")
            runner.add(flat, float_out, quant_out, index)
        if progress is not None:
            progress(index + 1, len(batches))

    for entry in [*plan.entries, *plan.outputs]:
        if entry._count:
            entry.sqnr_db = sqnr(entry._signal, entry._noise)
        elif not entry.note:
            entry.note = "no tensor output to compare"
    report = DebugReport(
        nodes=plan.entries,
        outputs=plan.outputs,
        float_nodes=plan.float_nodes,
        removed_nodes=plan.removed,
        sharing_groups=sharing_groups(quantized, prepared),
        unmatched=plan.unmatched,
        batches=len(batches),
        quantized_ops=plan.quantized_ops,
    )
    if runner is not None:
        report.artifact = runner.finish(report.output_sqnr_db)
    return report


@dataclass
class _Plan:
    entries: list[NodeComparison]
    by_quant_node: dict[str, list[NodeComparison]]
    float_wanted: set[str]
    quant_wanted: set[str]
    float_nodes: list[FloatNode]
    removed: list[FloatNode]
    unmatched: list[str]
    quantized_ops: list[str]
    outputs: list[NodeComparison] = field(default_factory=list)


def _plan(float_gm: GraphModule, quantized: GraphModule) -> _Plan:
    quant_ops, dequant_ops, helper_ops = _q_dq_ops()
    qdq = quant_ops | dequant_ops | helper_ops
    float_nodes = {n.name: n for n in float_gm.graph.nodes}
    present = {str(n.meta[DEBUG_HANDLE_KEY]) for n in quantized.graph.nodes if DEBUG_HANDLE_KEY in n.meta}

    def is_helper_getitem(n: Node) -> bool:
        src = n.args[0] if n.args else None
        return n.target is operator.getitem and isinstance(src, Node) and src.target in helper_ops

    # the dequantize that carries each node's own output quantization: dq(q(node)). A tensor
    # written in place after it is made has none (it stays float): a dq(q(...)) of it is a
    # reader's, after the writes, and comparing it with the float value as made would be wrong
    written_later = {n.name for n in mutated_aliases(quantized.graph)}
    output_dq: dict[str, Node] = {}
    for n in quantized.graph.nodes:
        if n.op == "call_function" and n.target in dequant_ops:
            q = n.args[0]
            if isinstance(q, Node) and q.op == "call_function" and q.target in quant_ops:
                src = q.args[0]
                if isinstance(src, Node) and src.op in ("call_function", "placeholder"):
                    if src.name not in written_later:
                        output_dq.setdefault(src.name, n)

    entries: list[NodeComparison] = []
    by_quant: dict[str, list[NodeComparison]] = {}
    float_wanted: set[str] = set()
    float_list: list[FloatNode] = []
    unmatched: list[str] = []
    quantized_ops: list[str] = []
    for n in quantized.graph.nodes:
        if n.op == "placeholder":
            if n.name not in output_dq:
                continue
        elif n.op != "call_function" or n.target in qdq or is_helper_getitem(n):
            continue
        handle = n.meta.get(DEBUG_HANDLE_KEY)
        quantized_flag = n.op == "placeholder" or _has_specs(n)
        if n.op == "call_function" and quantized_flag:
            quantized_ops.append(n.name)
        if n.op == "call_function" and not quantized_flag:
            reason = n.meta.get(FLOAT_REASON_KEY) or "not annotated"
            float_list.append(FloatNode(n.name, _op_label(n), str(reason)))
        if handle is None:
            unmatched.append(n.name)
            continue
        counterpart = _float_counterpart(str(handle), float_nodes, present)
        if counterpart is None:
            unmatched.append(n.name)
            continue
        if n.op == "call_function" and _inner_piece(n, str(handle)):
            # a backend rewrote one float op into several (silu -> sigmoid * x): only the piece
            # whose value leaves the group computes the float op's output
            entries.append(
                NodeComparison(
                    node=n.name,
                    op=_op_label(n),
                    handle=str(handle),
                    float_node=None,
                    quantized=quantized_flag,
                    output_quantized=output_dq.get(n.name) is not None,
                    note=f"an intermediate piece of {handle} (rewritten into several ops); "
                    "compared where its value leaves them",
                )
            )
            continue
        dq = output_dq.get(n.name)
        entry = NodeComparison(
            node=n.name,
            op=_op_label(n),
            handle=str(handle),
            float_node=counterpart.name,
            quantized=quantized_flag,
            output_quantized=dq is not None,
            note=f"{counterpart.name} folded into it"
            if counterpart.name != str(handle)
            else "written in place later: compared as made, before the writes"
            if n.name in written_later
            else "",
        )
        entries.append(entry)
        by_quant.setdefault((dq or n).name, []).append(entry)
        float_wanted.add(counterpart.name)

    removed = [
        FloatNode(
            f.name,
            _op_label(f),
            "folded into its producer before annotation"
            if f.target in _BATCH_NORMS
            else "not in the quantized program (removed by a pass before annotation)",
        )
        for f in float_gm.graph.nodes
        if f.op == "call_function"
        and f.name not in present
        and not (
            f.target is operator.getitem
            and f.args
            and isinstance(f.args[0], Node)
            and f.args[0].name not in present
        )
        and not str(getattr(f.target, "__name__", "")).startswith("_assert")
    ]
    return _Plan(
        entries=entries,
        by_quant_node=by_quant,
        float_wanted=float_wanted,
        quant_wanted=set(by_quant),
        float_nodes=float_list,
        removed=removed,
        unmatched=unmatched,
        quantized_ops=quantized_ops,
    )


def _accumulate(entry: NodeComparison, ref: Any, out: Any) -> None:
    if not isinstance(ref, torch.Tensor) or not isinstance(out, torch.Tensor):
        if ref is None and not entry.note:
            entry.note = "float counterpart produced no value"
        return
    if not (ref.is_floating_point() and out.is_floating_point()):
        entry.note = entry.note or f"non-float output ({out.dtype})"
        return
    if ref.shape != out.shape:
        entry.note = f"shape differs: float {tuple(ref.shape)}, quantized {tuple(out.shape)}"
        return
    entry.shape = tuple(int(s) for s in out.shape)
    r = ref.detach().to(torch.float64)
    diff = out.detach().to(torch.float64) - r
    entry._signal += float(r.pow(2).sum())
    entry._noise += float(diff.pow(2).sum())
    entry._count += 1
    err = float(diff.abs().max()) if diff.numel() else 0.0
    entry.max_abs_error = err if entry.max_abs_error is None else max(entry.max_abs_error, err)


# ------------------------------------------------------------------------------------------------
# sharing groups
# ------------------------------------------------------------------------------------------------


def sharing_groups(quantized: GraphModule, prepared: GraphModule | None = None) -> list[SharingGroupInfo]:
    """The observer-sharing groups of a converted program, with their encodings.

    Members come from the prepared module's state when given (every key: node outputs and
    input edges), else from the quantized program's Q/DQ nodes (the tensors each group encodes).
    """
    qparams: dict[int, Any] = dict(quantized.meta.get(QPARAMS_KEY) or {})
    members: dict[int, list[str]] = {}
    kinds: dict[int, set[str]] = {}
    state = prepared.meta.get(PREPARED_KEY) if isinstance(prepared, GraphModule) else None
    if state is not None and hasattr(state, "groups"):
        for group in state.groups:
            members[group.gid] = [describe_key(k) for k in group.keys]
            kinds[group.gid] = {"constant" if group.constant else "activation"}
    else:
        _, dequant_ops, _ = _q_dq_ops()
        for n in quantized.graph.nodes:
            gid = n.meta.get(GROUP_KEY)
            if gid is None:
                continue
            if n.op == "get_attr":
                name, kind = re.sub(r"_q\d+$", "", str(n.target)), "constant"
            elif n.op == "call_function" and n.target in dequant_ops and DEBUG_HANDLE_KEY in n.meta:
                name, kind = str(n.meta[DEBUG_HANDLE_KEY]), "activation"
            else:
                continue
            names = members.setdefault(int(gid), [])
            if name not in names:
                names.append(name)
            kinds.setdefault(int(gid), set()).add(kind)
    result = []
    for gid in sorted(set(members) | set(qparams)):
        qp = qparams.get(gid)
        kind_set = kinds.get(gid, set())
        kind = next(iter(kind_set)) if len(kind_set) == 1 else ("mixed" if kind_set else "activation")
        scale = zero_point = channels = None
        granularity = dtype = None
        qmin = qmax = None
        if qp is not None:
            granularity = getattr(qp, "granularity", None)
            dtype = str(getattr(qp, "dtype", "")).removeprefix("torch.") or None
            qmin, qmax = getattr(qp, "quant_min", None), getattr(qp, "quant_max", None)
            s = getattr(qp, "scale", None)
            z = getattr(qp, "zero_point", None)
            if isinstance(s, torch.Tensor) and s.numel() == 1:
                scale = float(s.reshape(-1)[0])
                zero_point = int(z.reshape(-1)[0]) if isinstance(z, torch.Tensor) and z.numel() else None
            elif isinstance(s, torch.Tensor) and s.numel() > 1:
                channels = int(s.numel())
        result.append(
            SharingGroupInfo(
                gid=gid,
                members=tuple(members.get(gid, ())),
                kind=kind,
                dtype=dtype,
                granularity=granularity,
                scale=scale,
                zero_point=zero_point,
                quant_min=qmin,
                quant_max=qmax,
                channels=channels,
            )
        )
    return result


def tensor_bytes(module: torch.nn.Module | torch.export.ExportedProgram) -> int:
    """Bytes held in parameters, buffers and constants (each tensor counted once)."""
    seen: set[int] = set()
    total = 0
    tensors: Sequence[Any]
    if isinstance(module, torch.export.ExportedProgram):
        tensors = [*module.state_dict.values(), *module.constants.values()]
    else:
        tensors = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
        if isinstance(module, GraphModule):
            for n in module.graph.nodes:
                if n.op == "get_attr":
                    value: Any = module
                    for part in str(n.target).split("."):
                        value = getattr(value, part, None)
                    if isinstance(value, torch.Tensor):
                        tensors.append(value)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
