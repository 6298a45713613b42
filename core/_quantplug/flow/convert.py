"""convert(): observers become quantize/dequantize ops; constants are stored as integers.

The result is the reference quantized program (dequantize -> float op -> quantize) built from the
standard ``quantized_decomposed`` ops, which torch.export, the ONNX exporter and ExecuTorch all
understand. Each quantized consumer gets its own dequantize node, so a backend can match
``dq -> op -> q`` patterns per op. qparams are computed once per group.
"""

from __future__ import annotations

import gc
import operator
import warnings
from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph import PythonCode
from torch.nn.modules import module as _module_hooks

from _quantplug.algorithms.taps import is_tap
from _quantplug.algorithms.weight_choice import WeightOverrides, choose_weights
from _quantplug.annotation.dtypes import SUPPORTED_DTYPES, storage_dtype
from _quantplug.annotation.node_mapping import Memo, map_nodes
from _quantplug.annotation.spec_view import is_per_channel, spec_range
from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.errors import CalibrationError, ConversionError, NonFiniteError
from _quantplug.flow.exported_modes import ExportedModes
from _quantplug.flow.inspect import QUANTIZE_OPS
from _quantplug.flow.loop_bodies import replace_loop_bodies
from _quantplug.flow.observer_convert import converts_itself, run_observer_converts
from _quantplug.flow.qdq_meta import FROM_NODE, port_qdq_meta, provenance
from _quantplug.flow.reference_representation import to_reference_representation
from _quantplug.flow.release import FloatWeightRelease, refuse_released
from _quantplug.flow.state import Group, PreparedState
from _quantplug.graph.attrs import fetch_attr, module_getattr
from _quantplug.graph.constants import ConstantValues, check_finite_constant, constant_test, module_attr
from _quantplug.graph.working_copy import (
    AttrNamer,
    add_node,
    code_counter,
    copy_node,
    paused_gc,
    release_code_with,
)
from _quantplug.meta import (
    ALGORITHMS_KEY,
    CALIBRATED_REPORT_KEY,
    DEBUG_HANDLE_KEY,
    GROUP_KEY,
    QPARAMS_KEY,
    STATE_KEY,
    observer_gid,
)
from _quantplug.observers import block_ops as qp_ops
from _quantplug.observers import kernels
from _quantplug.observers.base import ObserverBase
from _quantplug.observers.copies import fresh_copy
from _quantplug.observers.factory import observers_saw_data
from _quantplug.observers.fixed import DerivedObserver
from _quantplug.observers.nonfinite import check_all_qparams, check_state, widen_for_masks
from _quantplug.observers.nonfinite import configure as configure_nonfinite
from _quantplug.observers.per_block import block_grid_shape, resolve_block_size
from _quantplug.peers.torch_codegen import generating_code
from _quantplug.peers.torchao_observers import calculate_qparams_many, observe_constant
from _quantplug.rewrites.qat_batchnorm import fold_trained_batch_norms
from _quantplug.validation.calibrated import check_calibrated

qd = torch.ops.quantized_decomposed

_LEGACY_DTYPES = {torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32}


@dataclass(frozen=True)
class QParams:
    """A group's encoding, ready to emit."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    quant_min: int
    quant_max: int
    dtype: torch.dtype  # container dtype for the Q/DQ ops
    granularity: str  # "tensor", "channel", "block", "dynamic", "token"
    axis: int | None = None
    block_size: tuple[int, ...] | None = None
    symmetric: bool = False


def _qparams_key(qp: QParams) -> Hashable:
    """``qp`` as a hashable value: equal keys quantize every tensor to the same integers."""
    return (
        qp.granularity,
        qp.dtype,
        qp.quant_min,
        qp.quant_max,
        qp.axis,
        qp.block_size,
        *(
            (t.dtype, tuple(t.shape), t.detach().cpu().contiguous().numpy().tobytes())
            for t in (qp.scale, qp.zero_point)
        ),
    )


def _container(dtype: torch.dtype) -> torch.dtype:
    dtype = _LEGACY_DTYPES.get(dtype, dtype)
    return storage_dtype(dtype) if dtype in SUPPORTED_DTYPES else dtype


def _observer_axis(observer: nn.Module) -> int | None:
    """The channel axis a per-channel observer (or the one a fake-quantize wraps) measured on."""
    for module in (observer, module_getattr(observer, "activation_post_process", None)):
        axis = module_getattr(module, "ch_axis", None)
        if isinstance(axis, int) and axis >= 0:
            return axis
    return None


def _observer_range(observer: nn.Module) -> tuple[int, int] | None:
    """The integer range a (PT2E) observer computed its qparams for, if it states one.

    ``reduce_range=True`` (torch's ``default_fake_quant``) halves the spec's range inside the
    observer: its scale is for 0..127 and a QAT model trained clamped to that range.
    """
    for module in (module_getattr(observer, "activation_post_process", None), observer):
        qmin, qmax = getattr(module, "quant_min", None), getattr(module, "quant_max", None)
        if isinstance(qmin, int) and isinstance(qmax, int) and getattr(module, "reduce_range", False):
            return qmin, qmax
    return None


def _qparams(group: Group, raw: tuple[Any, Any] | None, observer: nn.Module | None = None) -> QParams:
    """A group's QParams from its observer's ``calculate_qparams()`` result (None: dynamic).

    As torchao's convert, which reads them from the observer: a per-channel spec without
    ``ch_axis`` (PT2E's default is None) is quantized along the axis its observer measured, and
    an observer with ``reduce_range`` quantizes to the reduced range its scale was computed for.
    """
    spec = group.spec
    qmin, qmax = spec_range(spec)
    reduced = _observer_range(observer) if observer is not None else None
    if reduced is not None and qmin <= reduced[0] <= reduced[1] <= qmax:
        qmin, qmax = reduced
    dtype = _container(spec.dtype)
    symmetric = getattr(spec, "qscheme", None) in (torch.per_tensor_symmetric, torch.per_channel_symmetric)
    if group.dynamic or raw is None:
        per_token = is_per_channel(spec)
        empty = torch.empty(0)
        return QParams(
            empty, empty, qmin, qmax, dtype, "token" if per_token else "dynamic", symmetric=symmetric
        )
    scale, zero_point = raw
    scale = torch.as_tensor(scale).detach()
    zero_point = torch.as_tensor(zero_point).detach()
    block = getattr(spec, "block_size", None)
    if block is not None:
        return QParams(
            scale, zero_point, qmin, qmax, dtype, "block", block_size=tuple(block), symmetric=symmetric
        )
    if (is_per_channel(spec) and scale.numel() > 1) or (
        is_per_channel(spec) and getattr(spec, "ch_axis", None) is not None
    ):
        if getattr(spec, "ch_axis", None) is not None:
            axis = spec.ch_axis
        else:
            axis = _observer_axis(observer) if observer is not None else None
        return QParams(scale, zero_point, qmin, qmax, dtype, "channel", axis=axis or 0, symmetric=symmetric)
    return QParams(
        scale.reshape(-1)[:1], zero_point.reshape(-1)[:1], qmin, qmax, dtype, "tensor", symmetric=symmetric
    )


class _Emitter:
    """Emits Q/DQ nodes into the new graph and collects the tensors they reference."""

    def __init__(self, graph: Graph, tensors: dict[str, torch.Tensor], namer: AttrNamer) -> None:
        self.graph = graph
        self.tensors = tensors
        self.namer = namer

    def constant(self, prefix: str, value: torch.Tensor) -> Node:
        name = self.namer(prefix)
        while name in self.tensors:
            name = self.namer(prefix)
        self.tensors[name] = value
        # graph.get_attr(name): its check of the owning module's attributes applies only to a graph
        # that has one (convert's new graph has none); otherwise the node it creates
        graph = self.graph
        node = graph.get_attr(name) if graph.owning_module is not None else add_node(graph, "get_attr", name)
        node.meta["val"] = value
        return node

    def quantize(self, x: Node, qp: QParams, prefix: str) -> Node:
        g = self.graph
        if qp.granularity == "tensor":
            return _call_function(
                g,
                qd.quantize_per_tensor.default,
                (x, float(qp.scale), int(qp.zero_point), qp.quant_min, qp.quant_max, qp.dtype),
            )
        if qp.granularity == "channel":
            s = self.constant(prefix + "_scale", qp.scale)
            z = self.constant(prefix + "_zero_point", qp.zero_point)
            return _call_function(
                g, qd.quantize_per_channel.default, (x, s, z, qp.axis, qp.quant_min, qp.quant_max, qp.dtype)
            )
        if qp.granularity == "block":
            s = self.constant(prefix + "_scale", qp.scale)
            z = self.constant(prefix + "_zero_point", qp.zero_point)
            return _call_function(
                g,
                qp_ops.quantize_per_block,
                (x, s, z, list(qp.block_size or ()), qp.quant_min, qp.quant_max, qp.dtype),
            )
        raise ConversionError(f"cannot emit a static quantize for granularity {qp.granularity!r}")

    def dequantize(self, q: Node, qp: QParams, prefix: str, out_dtype: torch.dtype | None) -> Node:
        g = self.graph
        kwargs = {"out_dtype": out_dtype} if out_dtype not in (None, torch.float32) else {}
        if qp.granularity == "tensor":
            return _call_function(
                g,
                qd.dequantize_per_tensor.default,
                (q, float(qp.scale), int(qp.zero_point), qp.quant_min, qp.quant_max, qp.dtype),
                kwargs,
            )
        if qp.granularity == "channel":
            s = self.constant(prefix + "_scale", qp.scale)
            z = self.constant(prefix + "_zero_point", qp.zero_point)
            return _call_function(
                g,
                qd.dequantize_per_channel.default,
                (q, s, z, qp.axis, qp.quant_min, qp.quant_max, qp.dtype),
                kwargs,
            )
        if qp.granularity == "block":
            s = self.constant(prefix + "_scale", qp.scale)
            z = self.constant(prefix + "_zero_point", qp.zero_point)
            return _call_function(
                g,
                qp_ops.dequantize_per_block,
                (q, s, z, list(qp.block_size or ()), qp.quant_min, qp.quant_max, qp.dtype),
            )
        raise ConversionError(f"cannot emit a static dequantize for granularity {qp.granularity!r}")

    def dynamic_qdq(self, x: Node, qp: QParams) -> Node:
        """choose_qparams -> quantize -> dequantize, per tensor or per token, at run time."""
        g = self.graph
        if qp.granularity == "token":
            cq = _call_function(g, qd.choose_qparams_per_token_asymmetric.default, (x, qp.dtype))
            s = _call_function(g, operator.getitem, (cq, 0))
            z = _call_function(g, operator.getitem, (cq, 1))
            q = _call_function(
                g, qd.quantize_per_token.default, (x, s, z, qp.quant_min, qp.quant_max, qp.dtype)
            )
            return _call_function(
                g,
                qd.dequantize_per_token.default,
                (q, s, z, qp.quant_min, qp.quant_max, qp.dtype, torch.float32),
            )
        choose = qd.choose_qparams_symmetric.tensor if qp.symmetric else qd.choose_qparams.tensor
        eps = float(torch.finfo(torch.float32).eps)
        cq = _call_function(g, choose, (x, qp.quant_min, qp.quant_max, eps, qp.dtype))
        s = _call_function(g, operator.getitem, (cq, 0))
        z = _call_function(g, operator.getitem, (cq, 1))
        q = _call_function(g, qd.quantize_per_tensor.tensor, (x, s, z, qp.quant_min, qp.quant_max, qp.dtype))
        return _call_function(
            g, qd.dequantize_per_tensor.tensor, (q, s, z, qp.quant_min, qp.quant_max, qp.dtype)
        )


def _call_function(
    graph: Graph, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> Node:
    """``graph.call_function(target, args, kwargs)`` through the faster :func:`add_node`."""
    return add_node(graph, "call_function", target, args, kwargs)


def _is_annotated(node: Node) -> bool:
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return False
    return bool(getattr(ann, "input_qspec_map", None)) or getattr(ann, "output_qspec", None) is not None


def _float_dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _dq_maker(emit: _Emitter, q: Node, qp: QParams, gid: int, observer: Node) -> Any:
    out_dtype = _float_dtype(observer)
    origin = provenance(observer)

    def make() -> Node:
        dq = emit.dequantize(q, qp, f"g{gid}", out_dtype)
        dq.meta[GROUP_KEY] = gid
        for k in ("val", "nn_module_stack", "stack_trace", DEBUG_HANDLE_KEY):
            if k in observer.meta:
                dq.meta[k] = observer.meta[k]
        dq.meta[FROM_NODE] = list(origin)
        return dq

    return make


def compute_qparams(
    prepared: GraphModule,
    state: PreparedState,
    weight_overrides: WeightOverrides | None = None,
    observed: dict[int, nn.Module] | None = None,
) -> dict[int, QParams]:
    """Every group's qparams, each observer's ``calculate_qparams()`` run once.

    With ``weight_overrides``, the prepared module's algorithms choose weight encodings and codes
    (:func:`_quantplug.algorithms.weight_choice.choose_weights`), recorded there for convert to emit.

    Constants (weights, biases) are observed here, once, into fresh copies of their groups'
    observers, so the prepared module is left exactly as calibration left it and a second convert
    gives the same result. Derived specs (bias = input scale x weight scale) call their source
    observers' ``calculate_qparams()`` themselves, through derive functions that may come from
    foreign quantizers; while they run, every source observer answers with its cached result.
    """
    prepared_obs = {g.gid: _observer(prepared, g) for g in state.groups}
    used = dict(prepared_obs)  # what each group's qparams are computed from
    # constants' statistics: derived and fixed observers need none (and a derived one must keep
    # pointing at the prepared source observers, which answer from the cache below)
    constants = [
        g
        for g in state.groups
        if g.constant
        and not (isinstance(prepared_obs[g.gid], ObserverBase) and not prepared_obs[g.gid].needs_data)
    ]
    if constants:
        nodes = {n.name: n for n in prepared.graph.nodes}
        with torch.no_grad():
            for group in constants:
                obs = used[group.gid] = fresh_copy(prepared_obs[group.gid])
                configure_nonfinite(obs, "error", group.describe())  # NaN weights: a broken model
                for name in sorted({k[0] if isinstance(k, tuple) else k for k in group.keys}):
                    value = fetch_attr(prepared, str(nodes[name].target))
                    try:
                        observe_constant(obs, value) or obs(value)
                    except NonFiniteError:  # named as the weight it is, not as calibration data
                        check_finite_constant(nodes[name], value, group.describe())
                        raise
    # float groups have no encoding, nor have observers that write their own ops (but torchao's
    # affine observers, whose qparams the encodings list)
    measured = [g for g in state.groups if not g.floating and not _opaque(prepared_obs[g.gid])]
    static = [g for g in measured if not g.dynamic]
    unseen = [g for g, saw in zip(static, observers_saw_data([used[g.gid] for g in static])) if not saw]
    if unseen:
        _uncalibrated(state, unseen)
    for group in measured:
        if not group.dynamic:
            check_state(group.describe(), used[group.gid])
    raw: dict[int, tuple[Any, Any] | None] = {}
    by_observer: dict[int, tuple[Any, Any]] = {}  # id(observer used) -> its qparams
    patched: list[nn.Module] = []

    def run(group: Group) -> None:
        obs = used[group.gid]
        result = by_observer.get(id(obs))
        if result is None:
            result = by_observer[id(obs)] = obs.calculate_qparams()
        raw[group.gid] = result
        for module in {id(obs): obs, id(prepared_obs[group.gid]): prepared_obs[group.gid]}.values():
            if "calculate_qparams" not in module.__dict__:
                module.__dict__["calculate_qparams"] = _Cached(result)
                patched.append(module)

    # what needs no other observer's result is computed up front, many observers at once
    independent = {
        id(used[g.gid]): used[g.gid]
        for g in measured
        if not g.dynamic and not isinstance(used[g.gid], DerivedObserver)
    }
    by_observer.update(zip(independent, calculate_qparams_many(list(independent.values()))))
    for key, obs in independent.items():  # tensors carrying attention masks (-inf) keep them masked
        by_observer[key] = widen_for_masks(obs, by_observer[key])
    if weight_overrides is not None:  # algorithm hook 3: weight choices, before derived biases read them
        chosen = choose_weights(
            prepared,
            state,
            prepared_obs,
            lambda gid: by_observer[id(used[gid])],
            lambda gid, qp: by_observer.__setitem__(id(used[gid]), qp),
        )
        weight_overrides.codes.update(chosen.codes)
        weight_overrides.biases.update(chosen.biases)
    try:
        derived = []
        for group in measured:
            if group.dynamic:
                raw[group.gid] = None
            elif isinstance(used[group.gid], DerivedObserver):
                derived.append(group)
            else:
                run(group)
        while derived:  # derived groups after their sources (chains are resolved in order)
            ready = [g for g in derived if _sources_ready(used[g.gid])] or derived[:1]
            for group in ready:
                run(group)
            derived = [g for g in derived if g.gid not in raw]
    finally:
        for module in patched:
            module.__dict__.pop("calculate_qparams", None)
    # no NaN/inf scale reaches any file
    check_all_qparams([(g.describe(), *found) for g in measured if (found := raw[g.gid]) is not None])
    if observed is not None:  # the observers the qparams came from (constants': fresh, observed copies)
        observed.update(used)
    return {g.gid: _qparams(g, raw[g.gid], used[g.gid]) for g in measured}


def _observer(prepared: GraphModule, group: Group) -> Any:
    """``group``'s observer on ``prepared``, or a ConversionError saying where it went."""
    found = prepared._modules.get(group.target)
    if found is None:
        raise ConversionError(
            f"the prepared module has no observer {group.target!r} (of {group.describe()}): something "
            "deleted it after prepare (a graph rewrite that removed its call_module nodes, then "
            "delete_all_unused_submodules()); calibrate and convert the module prepare returned"
        )
    return found


def _opaque(observer: Any) -> bool:
    """An observer that converts itself and is not one of torchao's affine observers: torchao's
    convert asks it for nothing but its ops, so quantplug does not ask it for qparams either."""
    if not converts_itself(observer):  # (most observers: their classes need no walk)
        return False
    return not any(c.__name__ == "AffineQuantizedObserverBase" for c in type(observer).__mro__)


def _uncalibrated(state: PreparedState, unseen: list[Group]) -> None:
    """Observers that never saw data: an error for quantplug's backends, torchao's behaviour for a
    foreign PT2E quantizer.

    A quantplug backend's program converted with uncalibrated observers would carry made-up
    scales (1.0) into a deployed model, so convert refuses and names them. torchao's
    ``convert_pt2e`` instead asks each observer for its qparams, which warns and answers its
    defaults (scale 1, zero point 0), and code written for it (structure checks that prepare and
    convert without data) relies on that: with a foreign quantizer (``state.backend`` is None)
    convert does the same and warns once, naming the observers.
    """
    if state.backend is not None:
        group = unseen[0]
        more = f" (nor did {len(unseen) - 1} other observers)" if len(unseen) > 1 else ""
        raise CalibrationError(
            f"the observer of {group.describe()} never saw data{more}; run calibration batches through "
            "the prepared model (prepared(*inputs)) before convert(), "
            "or check that this path of the model runs"
        )
    shown = "; ".join(g.describe() for g in unseen[:3]) + (
        f" and {len(unseen) - 3} more" if len(unseen) > 3 else ""
    )
    warnings.warn(
        f"convert: {len(unseen)} observer(s) never saw data ({shown}); they get their observers' default "
        "qparams, as torchao's convert_pt2e gives them. Run calibration batches through the prepared "
        "model before convert() for real encodings.",
        UserWarning,
        stacklevel=4,
    )


class _Cached:
    """Stands in for an observer's ``calculate_qparams`` during convert: the result computed once."""

    def __init__(self, result: tuple[Any, Any]) -> None:
        self.result = result

    def __call__(self) -> tuple[Any, Any]:
        return self.result


def _sources_ready(obs: DerivedObserver) -> bool:
    return all("calculate_qparams" in src.__dict__ for src in obs.obs_or_fqs)


def convert(
    prepared: GraphModule,
    *,
    fold_quantize: bool = True,
    use_reference_representation: bool = False,
    release_float_weights: bool = False,
) -> GraphModule:
    """Turn a calibrated prepared model into the reference quantized program (a new module).

    Args:
        prepared: what :func:`~_quantplug.flow.prepare.prepare` returned, calibrated (or trained).
        fold_quantize: store weights and other constants as the integers their quantize op
            computes (the default, as torchao's ``convert_pt2e``); ``False`` keeps the float
            constant and its ``quantize`` op in the program.
        use_reference_representation: ``True`` rewrites the program into PT2E's integer-arithmetic
            reference representation, as torchao's ``convert_pt2e`` does: int8 linear, 2-d
            convolution, dynamic linear, add, add + relu and max-pool chains as the integer ops an
            int8 kernel computes, every other int8 quantize/dequantize (per tensor, per channel)
            as its formula (:mod:`_quantplug.flow.reference_representation`). A quantize op the
            representation cannot express (another dtype, per-block or affine) raises a
            ConversionError naming it.
        release_float_weights: ``True`` drops the prepared module's reference to each float
            weight as soon as its integers are written (and to every other tensor at the end), so
            a caller that no longer holds the float model or exported program gets their memory
            back during convert instead of holding the float weights and all the integers at once.
            The caller's model and program are not touched (the references dropped are the
            prepared module's own); what the converted program reads float it keeps. What the
            algorithms gathered (their Hessian sums, stored batches) goes at the end, the guard's
            verdicts stay. The prepared module is consumed: any later use (a forward, convert, an
            algorithm) raises a ConversionError saying to prepare again
            (:mod:`_quantplug.flow.release`).
    """
    refuse_released(prepared, "convert this module again")
    state = prepared.meta.get(STATE_KEY) if isinstance(prepared, GraphModule) else None
    if not isinstance(state, PreparedState):
        raise ConversionError(
            f"{type(prepared).__name__} was not produced by quantplug.prepare(); "
            "prepare the exported program first"
        )
    for option, value in (
        ("fold_quantize", fold_quantize),
        ("use_reference_representation", use_reference_representation),
        ("release_float_weights", release_float_weights),
    ):
        if not isinstance(value, bool):
            raise ConversionError(f"convert({option}={value!r}): {option} is True or False")
    given = prepared
    if release_float_weights:  # a program the caller dropped may be held by cycles only: freed now
        gc.collect()
    with paused_gc():
        if state.qat:  # batch norms trained beside their convs are folded into them now
            prepared = fold_trained_batch_norms(prepared, _is_observer)
        release = FloatWeightRelease(prepared, state) if release_float_weights else None
        converted = _convert(prepared, state, fold_quantize=fold_quantize, release=release)
        if release is not None:
            release.finish(given, converted)
        if use_reference_representation:
            converted = to_reference_representation(converted)
    return converted


def _is_observer(node: Node) -> bool:
    return node.op == "call_module" and observer_gid(node.target) is not None


def _convert(
    prepared: GraphModule,
    state: PreparedState,
    *,
    fold_quantize: bool = True,
    release: FloatWeightRelease | None = None,
) -> GraphModule:
    chosen = WeightOverrides()  # what the algorithms chose (issue 15); empty without algorithms
    observed: dict[int, nn.Module] = {}
    qparams = compute_qparams(prepared, state, chosen, observed)
    # groups whose (PT2E) observer writes its own ops: its node is kept for it (observer_convert)
    self_converting = {gid for gid, obs in observed.items() if converts_itself(obs)}
    kept_observers: list[Node] = []
    observer_modules: dict[str, nn.Module] = {}

    def keep_observer(gid: int, src: Node) -> Node:
        target = state.groups[gid].target
        observer_modules[target] = observed[gid]
        kept = add_node(graph, "call_module", target, (src,), {})
        kept_observers.append(kept)
        return kept

    # constraints v2: limits and relations checked again on the calibrated encodings (strict raises)
    calibrated = check_calibrated(state.calibrated_checks, qparams)
    graph = Graph(owning_module=None, tracer_cls=prepared.graph._tracer_cls)
    graph._codegen = prepared.graph._codegen
    env: dict[Node, Node | _Dequantized] = {}
    tensors: dict[str, torch.Tensor] = {}
    emit = _Emitter(graph, tensors, AttrNamer(prepared))
    # constant groups' observers are parked (observers/parked.py): their keys are quantized here,
    # from the constants' values, and each reader of a parked node gets its constant's dequantize
    constant_inputs: dict[str, dict[str, int]] = {}  # consumer -> {producer: group id}
    read_under: dict[str, set[int]] = {}  # producer -> the groups it is read under
    parked: dict[Node, Node] = {}  # a parked observer node -> the constant it reads
    for (producer, consumer), gid in state.constant_edges.items():
        constant_inputs.setdefault(consumer, {})[producer] = gid
        read_under.setdefault(producer, set()).add(gid)
    # (producer, group id or the qparams' value) -> its quantize node or integer tensor
    edge_q: dict[tuple[str, Hashable], Node] = {}
    old_nodes = {n.name: n for n in prepared.graph.nodes}
    copies: dict[Node, Node] = {}  # each prepared node -> its copy (not its quantize/dequantize)
    weight_sources: dict[Node, Node] = {}  # integer constant -> the weight it was quantized from

    def quantized_edge(producer: Node, gid: int, user: Node) -> Node:
        """The integer tensor of a parameter (or the quantize node of an already quantized one).

        A constant read under several groups with equal qparams (a derived bias at every step of
        an unrolled GRU, each step's group derived from the same shared encodings) is stored once:
        its integers are a function of the value and the qparams only. An algorithm's codes are
        per group, so those are keyed by the group, and so is a constant read under one group only
        (the common case: its group stands for its qparams, whose value key costs a copy of them).
        """
        by_value = (
            len(read_under[producer.name]) > 1
            and producer.name not in state.constant_outputs
            and (str(producer.target), gid) not in chosen.codes
        )
        key: tuple[str, Hashable] = (producer.name, _qparams_key(qparams[gid]) if by_value else gid)
        q = edge_q.get(key)
        if q is None:
            qp = qparams[gid]
            target = str(producer.target)
            codes = chosen.codes.get((target, gid))
            if producer.name in state.constant_outputs:  # requantized: folded below, exactly
                q = emit.quantize(_lookup(env, producer, user), qp, f"g{gid}")
            elif not fold_quantize and codes is None:  # the float constant and its quantize op
                q = emit.quantize(_lookup(env, producer, user), qp, f"g{gid}")
            else:
                if codes is not None:  # an algorithm's integer codes (checked against the grid)
                    ints = codes.to(qp.dtype)
                else:
                    value = chosen.biases.get(target, fetch_attr(prepared, target)).detach()
                    ints = _quantize_tensor(value, qp)
                q = emit.constant(target + "_q", ints)
                weight_sources[q] = producer
            q.meta[GROUP_KEY] = gid
            # its own origin, as torchao's folded constant descends from the weight's observer: a
            # weight's handle must not be its consumer's (the float op is matched on that one)
            q.meta[FROM_NODE] = provenance(q)
            edge_q[key] = q
        if release is not None and q.op == "get_attr":  # this reader is served by integers now
            release.written(producer, user)
        return q

    for target, corrected in chosen.biases.items():  # float biases an algorithm corrected
        tensors.setdefault(target, corrected)
    for node in prepared.graph.nodes:
        if is_tap(node):  # algorithms' calibration taps end with calibration
            continue
        observer_group = observer_gid(node.target) if node.op == "call_module" else None
        if observer_group is not None:
            gid = observer_group
            if state.groups[gid].constant:  # a parked observer: its readers read the constant's
                producer = node.args[0]  # dequantize, made for each below (or its output's)
                assert isinstance(producer, Node)
                parked[node] = producer
                env[node] = env[producer]
                continue
            src = _lookup(env, node.args[0], node)
            if state.groups[gid].floating:  # stays float: no Q/DQ (float16: to half and back)
                env[node] = _float_edge(graph, src, state.groups[gid].spec.dtype)
                continue
            if gid in self_converting:  # made at its first reader, as a constant's dequantize is
                env[node] = _Dequantized(lambda gid=gid, src=src: keep_observer(gid, src), duplicate=False)
                continue
            qp = qparams[gid]
            if qp.granularity in ("dynamic", "token"):
                env[node] = _Dequantized(partial(_dynamic_qdq, emit, src, qp, node), duplicate=False)
                continue
            env[node] = _quantized(emit, src, qp, gid, node)
            continue
        if node.name in constant_inputs:
            replacements: dict[Node, Node] = {}
            for producer_name, gid in constant_inputs[node.name].items():
                producer = old_nodes[producer_name]
                if gid in self_converting:
                    replacements[producer] = keep_observer(gid, _lookup(env, producer, node))
                    continue
                q = quantized_edge(producer, gid, node)
                replacements[producer] = dq = _dq_maker(emit, q, qparams[gid], gid, producer)()
                dq.meta[FROM_NODE] = list(q.meta[FROM_NODE])

            def transform(n: Node, r: dict[Node, Node] = replacements, u: Node = node) -> Node:
                read = parked.get(n, n)
                return r[read] if read in r else _lookup(env, n, u)

            new = copy_node(graph, node, transform)
        else:
            new = copy_node(graph, node, partial(_lookup, env, user=node))
        env[node] = copies[node] = new
        out_gid = state.constant_outputs.get(node.name)
        if out_gid is not None and out_gid in self_converting:
            env[node] = keep_observer(out_gid, new)
        elif out_gid is not None:
            env[node] = _quantized(emit, new, qparams[out_gid], out_gid, node)
    port_qdq_meta(graph, weight_sources)  # before the quantizes of constants become integers
    if fold_quantize:
        _store_constants_as_integers(graph, emit, prepared, qparams)
    _eliminate_dead_code(graph)
    _annotations_on_copies(copies)
    since = code_counter()
    converted = ConvertedModule(nn.Module(), Graph(), class_name="QuantizedGraphModule", code_deferred=True)
    _populate(converted, prepared, graph, tensors, observer_modules)
    converted.graph = graph
    if kept_observers:  # they edit the graph: before its code is generated
        run_observer_converts(converted, kept_observers, fold_quantize=fold_quantize)
    converted.generate_deferred_code()  # the one code generation
    release_code_with(converted, since=since)
    replace_loop_bodies(prepared, converted, convert)  # each body was prepared as a program of its own
    # not the algorithms' run: its collected sums, stored batches and guard are prepare's and
    # convert's (at 110M parameters the sums alone outweigh the float weights)
    converted.meta.update({k: v for k, v in prepared.meta.items() if k not in (STATE_KEY, ALGORITHMS_KEY)})
    converted.meta[QPARAMS_KEY] = {gid: qp for gid, qp in qparams.items()}
    if calibrated is not None:
        converted.meta[CALIBRATED_REPORT_KEY] = calibrated
    return converted


class ConvertedModule(ExportedModes, GraphModule):
    """What :func:`convert` returns: the reference Q/DQ program, whose ``train()``/``eval()``
    raise as on an exported module (:mod:`_quantplug.flow.exported_modes`).

    Made with ``code_deferred=True``, it generates no code until :meth:`generate_deferred_code`:
    GraphModule compiles at construction and at every graph it is given, and convert builds the
    module first (its state is registered directly, see :func:`_populate`), then gives it its
    graph, which self-converting observers then edit: compiled at each step, that was an empty
    graph's code and, with such observers, the program's twice (each compile also recompiling
    every GraphModule child). Copies and pickles construct as a GraphModule does.
    """

    def __init__(
        self,
        root: nn.Module | dict[str, Any],
        graph: Graph,
        class_name: str = "GraphModule",
        *,
        code_deferred: bool = False,
    ) -> None:
        if code_deferred:
            self.__dict__[_CODE_DEFERRED] = True
        super().__init__(root, graph, class_name)

    def recompile(self) -> PythonCode:
        if _CODE_DEFERRED in self.__dict__:  # no code until generate_deferred_code
            return None  # type: ignore[return-value]
        return super().recompile()

    def generate_deferred_code(self) -> None:
        """Generate the code of the module's graph as it is now, the first time (no-op otherwise)."""
        if self.__dict__.pop(_CODE_DEFERRED, False):
            with generating_code(self.graph):
                self.recompile()


_CODE_DEFERRED = "_quantplug_code_deferred"


def _quantized(emit: _Emitter, src: Node, qp: QParams, gid: int, origin: Node) -> _Dequantized:
    """Env value of a quantized tensor: its quantize node, and a dequantize per consumer."""
    q = emit.quantize(src, qp, f"g{gid}")
    q.meta[GROUP_KEY] = gid
    q.meta[FROM_NODE] = provenance(origin)
    return _Dequantized(_dq_maker(emit, q, qp, gid, origin), duplicate=True)


def _float_edge(graph: Graph, src: Node, dtype: torch.dtype) -> Node:
    """What a float spec's observer becomes, as torchao's convert makes it: nothing, or for
    float16 a cast to half and back (``convert_element_type.no_fuse``, which inductor's fp16
    weight patterns match and no pass folds away)."""
    if dtype != torch.float16:
        return src
    cast = qd.convert_element_type.no_fuse
    half = _call_function(graph, cast, (src, torch.float16))
    return _call_function(graph, cast, (half, torch.float32))


def _dynamic_qdq(emit: _Emitter, src: Node, qp: QParams, observer: Node) -> Node:
    """The run-time choose_qparams -> quantize -> dequantize of a dynamic observer, each node
    descending from the observer (torchao's provenance)."""
    dq = emit.dynamic_qdq(src, qp)
    origin = provenance(observer)
    q = dq.args[0]
    assert isinstance(q, Node)
    scale = q.args[1]
    assert isinstance(scale, Node)
    for made in (dq, q, scale.args[0]):
        assert isinstance(made, Node)
        made.meta[FROM_NODE] = list(origin)
    return dq


def _store_constants_as_integers(
    graph: Graph, emit: _Emitter, prepared: GraphModule, qparams: dict[int, QParams]
) -> None:
    """Replace every quantize op whose input is a constant by the integer tensor it computes.

    Weights of constant groups, weights sharing a group with activations (an embedding table and
    its looked-up rows), QAT weights, and values computed from constants only (a transposed
    weight, an LSTM's ``zeros`` state, a requantized constant): all are quantized here, once, with
    their group's qparams, so the program reads integers and dequantizes them. The integers are
    those the quantize op would compute (the same float32 steps).
    """
    read_prepared = module_attr(prepared)

    def attr(target: str) -> Any:
        return emit.tensors[target] if target in emit.tensors else read_prepared(target)

    constant = constant_test(attr)
    quantizes = [n for n in graph.nodes if n.op == "call_function" and n.target in QUANTIZE_OPS]
    value = ConstantValues(attr)
    for node in [n for n in quantizes if constant(n)]:  # decided before the graph changes
        source = node.args[0]
        assert isinstance(source, Node)
        gid = node.meta.get(GROUP_KEY)
        qp = qparams.get(gid) if isinstance(gid, int) else None
        integers = _quantize_tensor(value(source), qp) if qp is not None else value(node)
        prefix = (str(source.target) if source.op == "get_attr" else source.name) + "_q"
        with graph.inserting_before(node):
            stored = emit.constant(prefix, integers)
        stored.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(stored)
        graph.erase_node(node)


def _annotations_on_copies(copies: dict[Node, Node]) -> None:
    """Each annotation on the copies names the copies of the prepared nodes it named
    (:mod:`_quantplug.annotation.node_mapping`: as copied, it held the prepared module alive)."""
    memo: Memo = {}
    for node in copies.values():  # convert's own nodes (quantize, dequantize) carry none
        annotation = node.meta.get(Q_ANNOTATION_KEY)
        if annotation is not None:
            node.meta[Q_ANNOTATION_KEY] = map_nodes(annotation, copies, memo)


class _Dequantized:
    """Env value of an observer node: its dequantize, made lazily when a consumer is copied.

    Each annotated consumer gets a private DQ (so backends can match ``dq -> op -> q`` per op,
    PT2E's DuplicateDQPass semantics); unannotated consumers share one. Made at the consumer's
    copy time, a DQ sits right before its first user.
    """

    def __init__(self, make: Any, duplicate: bool) -> None:
        self.make = make
        self.duplicate = duplicate
        self.shared: Node | None = None
        self.private: dict[Node, Node] = {}

    def for_user(self, user: Node) -> Node:
        if self.duplicate and _is_annotated(user):
            dq = self.private.get(user)
            if dq is None:
                dq = self.private[user] = self.make()
            return dq
        if self.shared is None:
            self.shared = self.make()
        return self.shared


def _lookup(env: dict[Node, Node | _Dequantized], n: Node, user: Node) -> Node:
    value = env[n]
    return value.for_user(user) if isinstance(value, _Dequantized) else value


def _eliminate_dead_code(graph: Graph) -> None:
    """Drop unused pure nodes (float weights replaced by integer ones, unused observer inputs)."""
    for node in reversed(graph.nodes):
        if node.users or node.op in ("placeholder", "output", "call_module"):
            continue
        if node.op == "get_attr" or (node.op == "call_function" and not node.is_impure()):
            graph.erase_node(node)


#: float32 elements a constant is quantized at a time (4 MiB): the integers are written slice by
#: slice into their own tensor, so quantizing a weight holds its codes and one slice's float
#: temporaries, never whole-weight float copies (at 110M parameters, LPBQ's lm_head took four
#: 94 MiB temporaries, the flow's peak)
SLICE_ELEMENTS = 1 << 20

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _quantize_tensor(value: torch.Tensor, qp: QParams) -> torch.Tensor:
    """The integers ``value``'s quantize op computes under ``qp``, written in row slices.

    Every slice takes the op's own float32 steps (``quantize_per_tensor``, ``quantize_per_channel``,
    quantplug's ``quantize_per_block``) on its rows, so the integers are the op's, bit for bit;
    what is not a float weight the slices handle (a 0-d value, another dtype, parameters whose
    shape the op would refuse) goes to the op itself, whose errors it keeps.
    """
    if qp.granularity not in ("tensor", "channel", "block"):
        raise ConversionError(f"constant tensors cannot use {qp.granularity} quantization")
    native = _native_codes(value, qp)
    if native is not None:
        return native
    sliced = _row_quantizer(value, qp) if value.dtype in _FLOAT_INPUTS and value.dim() > 0 else None
    if sliced is None:
        return _quantize_whole(value, qp)
    rows_of, step = sliced
    dtype = storage_dtype(qp.dtype) if qp.granularity == "block" else qp.dtype
    out = torch.empty_like(value.detach(), dtype=dtype)  # the op's layout (a transposed weight's)
    per_row = max(1, value[:1].numel())
    rows = max(step, SLICE_ELEMENTS // per_row // step * step)
    with torch.no_grad():
        for start in range(0, value.shape[0], rows):
            stop = min(start + rows, value.shape[0])
            out[start:stop] = rows_of(start, stop)
    return out


def _native_codes(value: torch.Tensor, qp: QParams) -> torch.Tensor | None:
    """:func:`_row_quantizer`'s integers from the native kernels in one pass (no float temporaries),
    or None where they do not apply: a float32 ``value`` quantized per tensor, or per channel along
    its first axis, with float32 inverse scales and integer zero points (whose float32 values the
    torch steps add) to int8 or uint8."""
    if value.dtype is not torch.float32 or value.dim() == 0 or qp.granularity not in ("tensor", "channel"):
        return None
    if qp.zero_point.dtype.is_floating_point or qp.zero_point.dtype.is_complex:
        return None  # a float zero point: the torch steps add it in its own dtype
    if qp.granularity == "tensor":
        # torch multiplies float32 values by a Python float as by that float rounded to float32
        inverse = torch.tensor([1.0 / float(qp.scale)], dtype=torch.float32)
        zero_point = torch.tensor([int(qp.zero_point)]).to(torch.float32)  # torch's int64 -> float32
    else:
        axis = qp.axis if qp.axis is not None and qp.axis >= 0 else value.dim() + (qp.axis or 0)
        scale = qp.scale
        if axis != 0 or scale.dtype is not torch.float32 or scale.shape != (value.shape[0],):
            return None
        if qp.zero_point.shape != scale.shape:
            return None
        # 1.0 / scale is torch.reciprocal(scale) * 1.0: the same floats, without the operator wrapper
        inverse, zero_point = torch.reciprocal(scale), qp.zero_point.to(torch.float32)
    return kernels.quantize_rows(
        value.detach(), inverse, zero_point.contiguous(), qp.quant_min, qp.quant_max, qp.dtype
    )


def _row_quantizer(value: torch.Tensor, qp: QParams) -> tuple[Any, int] | None:
    """``(rows_of, step)``: ``rows_of(start, stop)`` is the op's clamped float result on those rows
    of ``value`` (slices start at multiples of ``step``); None where only the whole op applies."""
    x = value.detach()
    if qp.granularity == "tensor":
        inv_scale, point = 1.0 / float(qp.scale), int(qp.zero_point)

        def per_tensor(start: int, stop: int) -> torch.Tensor:
            rows = x[start:stop].to(torch.float32)
            return _round_shift_clamp(rows * inv_scale, point, qp)

        return per_tensor, 1
    if qp.granularity == "channel":
        axis = qp.axis if qp.axis is not None and qp.axis >= 0 else x.dim() + (qp.axis or 0)
        scale, zero_point = qp.scale, qp.zero_point
        if not 0 <= axis < x.dim() or scale.dim() != 1 or scale.numel() != x.shape[axis]:
            return None
        if zero_point.shape != scale.shape:
            return None
        shape = [1] * x.dim()
        shape[axis] = scale.numel()
        inverse, offset = (1.0 / scale).view(shape), zero_point.view(shape)

        def per_channel(start: int, stop: int) -> torch.Tensor:
            rows = x[start:stop].to(torch.float32)
            inv, zp = (inverse[start:stop], offset[start:stop]) if axis == 0 else (inverse, offset)
            return _round_shift_clamp(rows * inv, zp, qp)

        return per_channel, 1
    return _block_rows(x, qp)


def _round_shift_clamp(scaled: torch.Tensor, zero_point: Any, qp: QParams) -> torch.Tensor:
    """``clamp(round(scaled) + zero_point, quant_min, quant_max)`` in ``scaled``'s own memory.

    ``scaled`` is a fresh temporary (the rows times the inverse scale, or over the scale):
    rounding, shifting and clamping it in place gives the same floats as the three out-of-place
    ops, without the three weight-sized temporaries they allocate and write (a fifth of
    quantizing a decoder's weights). A zero point that would widen the sum beyond ``scaled``'s dtype takes
    the out-of-place path, which computes and keeps the sum in the wider dtype.
    """
    scaled.round_()
    if torch.result_type(scaled, zero_point) != scaled.dtype:
        return torch.clamp(scaled + zero_point, qp.quant_min, qp.quant_max)
    return scaled.add_(zero_point).clamp_(qp.quant_min, qp.quant_max)


def _block_rows(x: torch.Tensor, qp: QParams) -> tuple[Any, int] | None:
    """Per-block rows: each block's scale broadcast over its block (a view of the rows as
    ``[grid0, block0, grid1, block1, ...]``), not stretched into a weight-sized copy."""
    block = resolve_block_size(list(qp.block_size or ()), x.shape)
    grid = block_grid_shape(block, x.shape)
    params = []
    for param in (qp.scale, qp.zero_point):
        param = param.to(torch.float32)
        if param.numel() == 1:
            param = param.reshape([1] * (2 * x.dim()))
        elif tuple(param.shape) == grid:
            param = param.reshape([n for g in grid for n in (g, 1)])
        else:
            return None  # the op names the mismatch
        params.append(param)
    scale, zero_point = params

    def per_block(start: int, stop: int) -> torch.Tensor:
        rows = x[start:stop].to(torch.float32)
        shape = [n for g, b in zip((rows.shape[0] // block[0], *grid[1:]), block) for n in (g, b)]
        first = slice(start // block[0], stop // block[0])
        s = scale[first] if scale.shape[0] > 1 else scale
        zp = zero_point[first] if zero_point.shape[0] > 1 else zero_point
        return _round_shift_clamp(rows.reshape(shape) / s, zp, qp).reshape(rows.shape)

    return per_block, block[0]


def _quantize_whole(value: torch.Tensor, qp: QParams) -> torch.Tensor:
    """The quantize op on the whole of ``value`` (what the row slices do not cover)."""
    if qp.granularity == "tensor":
        return qd.quantize_per_tensor.default(
            value, float(qp.scale), int(qp.zero_point), qp.quant_min, qp.quant_max, qp.dtype
        )
    if qp.granularity == "channel":
        axis = qp.axis if qp.axis is not None and qp.axis >= 0 else value.dim() + (qp.axis or 0)
        return qd.quantize_per_channel.default(
            value, qp.scale, qp.zero_point, axis, qp.quant_min, qp.quant_max, qp.dtype
        )
    return qp_ops.quantize_per_block(
        value, qp.scale, qp.zero_point, list(qp.block_size or ()), qp.quant_min, qp.quant_max, qp.dtype
    )


def _populate(
    module: GraphModule,
    prepared: GraphModule,
    graph: Graph,
    tensors: dict[str, torch.Tensor],
    modules: dict[str, nn.Module] | None = None,
) -> None:
    """Put on ``module`` exactly what ``graph`` references (no float weights left over).

    The same objects GraphModule's own copying would install (tensors as buffers, parameters as
    parameters, submodules as submodules), registered directly instead of being looked up
    through a throw-away root module.
    """
    # torch's registration hooks run as they would: with any, every value goes through the register methods
    hooked = bool(
        _module_hooks._global_buffer_registration_hooks
        or _module_hooks._global_parameter_registration_hooks
        or _module_hooks._global_module_registration_hooks
    )
    holders: dict[str, nn.Module] = {"": module}
    sources: dict[str, nn.Module] = {"": prepared}

    def holder_at(path: str) -> nn.Module:
        found = holders.get(path)
        if found is None:
            outer, _, name = path.rpartition(".")
            parent = holder_at(outer)
            found = module_getattr(parent, name, None)
            if not isinstance(found, nn.Module):
                found = nn.Module()
                if not hooked and _free_name(parent, name):  # add_module once its checks pass
                    parent._modules[name] = found
                else:
                    parent.add_module(name, found)
            holders[path] = found
        return found

    def source_at(path: str) -> nn.Module:
        found = sources.get(path)
        if found is None:
            outer, _, name = path.rpartition(".")
            found = module_getattr(source_at(outer), name, None)
            if not isinstance(found, nn.Module):
                found = prepared.get_submodule(path)  # its error
            sources[path] = found
        return found

    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        parent_path, _, attr = target.rpartition(".")
        holder = holder_at(parent_path)
        free = not hooked and _free_name(holder, attr)
        if target in tensors:
            if free:  # register_buffer(attr, tensor) once its checks pass
                holder._buffers[attr] = tensors[target]
                holder._non_persistent_buffers_set.discard(attr)
            else:
                holder.register_buffer(attr, tensors[target])
            continue
        if modules and target in modules:
            holder.add_module(attr, modules[target])
            continue
        value = module_getattr(source_at(parent_path), attr)
        if isinstance(value, nn.Module):
            if free:
                holder._modules[attr] = value
            else:
                holder.add_module(attr, value)
        elif isinstance(value, nn.Parameter):
            if free and value.grad_fn is None:  # register_parameter(attr, value) once its checks pass
                holder._parameters[attr] = value
            else:
                holder.register_parameter(attr, value)
        elif isinstance(value, torch.Tensor):
            if free:
                holder._buffers[attr] = value
                holder._non_persistent_buffers_set.discard(attr)
            else:
                holder.register_buffer(attr, value)
        else:
            setattr(holder, attr, value)


def _free_name(module: nn.Module, name: str) -> bool:
    """Whether ``name`` is an identifier-like name that nothing on ``module`` holds: no attribute,
    parameter, buffer or submodule, in the instance or its class. ``register_buffer``,
    ``register_parameter`` and ``add_module`` accept such a name without a question, so the value
    may be written into the module's own dict directly (their checks cost more than the write:
    registering a decoder-8's converted state took 1.1 ms of its 23 ms convert, 0.75 ms so)."""
    return (
        bool(name)
        and "." not in name
        and name not in module.__dict__
        and name not in module._parameters
        and name not in module._buffers
        and name not in module._modules
        and not hasattr(type(module), name)
    )
