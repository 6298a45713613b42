"""The Quantizer: a backend's hooks, the user's options and overrides, as one PT2E quantizer.

It implements the PT2E quantizer protocol (``transform_for_annotation``, ``annotate``,
``validate``), so it also works with torchao's own ``prepare_pt2e``; ``quantplug.prepare`` uses
its extra knowledge (sharing hook, lowering plan, coverage).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from _quantplug.annotation.annotators import AnnotatorRule, is_float_tensor
from _quantplug.annotation.specs import Q_ANNOTATION_KEY, QuantizationAnnotation, QuantizationConfig
from _quantplug.errors import (
    AnnotationError,
    BackendFailedError,
    ConstraintViolationError,
    OptionError,
    QuantplugError,
)
from _quantplug.graph.index_arithmetic import index_arithmetic
from _quantplug.graph.mutation import buffer_state, mutated_aliases
from _quantplug.graph.op_names import op_name
from _quantplug.graph.working_copy import working_copy
from _quantplug.meta import FLOAT_REASON_KEY, NOTE_KEY, RULE_KEY
from _quantplug.plugins.contract import STRICT_OPTION, BackendInfo, LoweringPlan, NamedPass
from _quantplug.plugins.registry import LoadedBackend
from _quantplug.quantizer.context import BackendContext, BackendOptions
from _quantplug.quantizer.fusion import (
    FUSED_HEAD_KEY,
    FUSED_TAIL_KEY,
    FusionPattern,
    FusionPlan,
    OpNode,
    plan_fusions,
    remove_fused_encodings,
)
from _quantplug.quantizer.node_data import DISCARDED
from _quantplug.quantizer.rules import RuleSet
from _quantplug.quantizer.selection import ConfigSelector
from _quantplug.rewrites.pipeline import rewrite_for_annotation
from _quantplug.sharing.keys import collect_keys
from _quantplug.sharing.problem import SharingProblem, solve
from _quantplug.sharing.resolution import SharingGroups
from _quantplug.suggest import did_you_mean
from _quantplug.validation.constraints import OpConstraint
from _quantplug.validation.engine import CalibratedPlan, calibrated_plan, relation_merges, validate_graph
from _quantplug.validation.report import ValidationReport

logger = logging.getLogger("quantplug")

AnnotationCallback = Callable[[GraphModule, BackendContext], None]


@dataclass(frozen=True)
class NodeCoverage:
    """Whether one op node is quantized, and why not when it stays float.

    ``fused_with`` names the node it runs fused with (no encoding between them); ``note`` says
    what is only partly quantized (an output left float because every consumer stays float).
    """

    node: str
    op: str
    quantized: bool
    reason: str
    fused_with: str | None = None
    note: str = ""


@dataclass(frozen=True)
class CoverageReport:
    """Per-node coverage of a graph by a backend's rules and the user's overrides."""

    nodes: tuple[NodeCoverage, ...]

    @property
    def float_nodes(self) -> list[NodeCoverage]:
        return [n for n in self.nodes if not n.quantized]

    @property
    def quantized_nodes(self) -> list[NodeCoverage]:
        return [n for n in self.nodes if n.quantized]

    @property
    def noted_nodes(self) -> list[NodeCoverage]:
        """Quantized nodes with a note (quantized otherwise than the options asked)."""
        return [n for n in self.nodes if n.quantized and n.note]

    def float_ops(self) -> Counter[str]:
        return Counter(n.op for n in self.float_nodes)

    def node(self, name: str) -> NodeCoverage:
        """The entry of one node (KeyError naming the known nodes if absent)."""
        for n in self.nodes:
            if n.node == name:
                return n
        raise KeyError(f"no op node {name!r}; nodes: {', '.join(n.node for n in self.nodes)}")

    def format(self) -> str:
        lines = [f"{len(self.quantized_nodes)} node(s) quantized, {len(self.float_nodes)} float"]
        for n in self.nodes:
            if not n.quantized:
                lines.append(f"  float {n.node} [{n.op}]: {n.reason}")
            elif n.note:
                lines.append(f"  note {n.node} [{n.op}]: {n.note}")
        pairs: list[str] = []
        shown: set[str] = set()
        for n in self.nodes:  # graph order: the head of a pair comes first
            if n.fused_with is not None and n.node not in shown:
                shown.update((n.node, n.fused_with))
                pairs.append(f"{n.node}+{n.fused_with}")
        if pairs:
            lines.append("  fused (one kernel, no encoding between): " + ", ".join(pairs))
        return "\n".join(lines)


class Quantizer:
    """A configured backend. Build with ``quantplug.get_quantizer(name, **options)``."""

    def __init__(self, backend: LoadedBackend, options: dict[str, Any], *, strict: bool = True) -> None:
        self._backend = backend
        self.context = BackendContext(
            backend=backend.info.name, options=BackendOptions(options, strict=strict), strict=strict
        )
        self.context.bind_configs(self.config_for)  # rules and hooks may ask for any node's config
        hook = backend.hook
        preset = options.get(backend.info.preset_option) if backend.info.preset_option else None
        config = hook.quantplug_quantization_config(preset=preset, context=self.context)
        self.selector = ConfigSelector(global_config=config)
        modules = [
            m for result in reversed(hook.quantplug_annotation_rules(context=self.context)) for m in result
        ]
        self.rules = RuleSet(backend.info.name, modules)
        self.arch: int | None = hook.quantplug_target_arch(context=self.context)
        self._callbacks: list[AnnotationCallback] = []
        self._constraint_cache: dict[tuple[str, str | None], list[OpConstraint]] = {}
        self._fusion_patterns: tuple[FusionPattern, ...] | None = None
        self._io_config: QuantizationConfig | None = None
        self._io_set = False

    # -- description -------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.info.name

    @property
    def info(self) -> BackendInfo:
        return self._backend.info

    @property
    def strict(self) -> bool:
        """Raise on constraint violations and incomplete artifacts (else warn); every hook sees it."""
        return self.context.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        strict = STRICT_OPTION.coerce(value, backend=self.backend)
        self.context.strict = strict
        self.context.options = BackendOptions(self.context.options, strict=strict)

    @property
    def options(self) -> dict[str, Any]:
        """The backend's own options as resolved (a copy); ``strict`` is :attr:`strict`."""
        options = self.context.options
        return options.copy() if isinstance(options, BackendOptions) else dict(options)

    @property
    def global_config(self) -> QuantizationConfig | None:
        return self.selector.global_config

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in {**self.context.options, "strict": self.strict}.items())
        return f"<Quantizer {self.backend}({opts})>"

    # -- overrides ---------------------------------------------------------------------------
    def set_global(self, config: QuantizationConfig | None) -> Quantizer:
        self.selector.global_config = config
        return self

    def set_module_name(self, name: str, config: QuantizationConfig | None) -> Quantizer:
        """Config for every node inside submodule ``name`` (``"layers.3"``); None keeps them float."""
        self.selector.module_names[name] = config
        return self

    def set_module_type(self, module_type: type | str, config: QuantizationConfig | None) -> Quantizer:
        """Config for nodes inside modules of a type (class or ``"torch.nn.modules.linear.Linear"``)."""
        self.selector.set_module_type(module_type, config)
        return self

    def set_node_name(self, name: str, config: QuantizationConfig | None) -> Quantizer:
        self.selector.node_names[name] = config
        return self

    def set_op(self, op: Any, config: QuantizationConfig | None) -> Quantizer:
        """Config for every node of an op (``torch.ops.aten.add.Tensor`` or its name)."""
        self.selector.ops[op_name(op)] = config
        return self

    def set_filter(self, predicate: Callable[[Node], bool], config: QuantizationConfig | None) -> Quantizer:
        """Config for nodes a predicate accepts (checked after node names, before module rules)."""
        self.selector.predicates.append((predicate, config))
        return self

    def discard(self, *, nodes: Iterable[str] = (), ops: Iterable[Any] = ()) -> Quantizer:
        """Keep these nodes / ops float: no specs on their inputs or outputs."""
        for n in nodes:
            self.set_node_name(n, None)
        for op in ops:
            self.set_op(op, None)
        return self

    def add_annotation_callback(self, callback: AnnotationCallback) -> Quantizer:
        """Run ``callback(gm, context)`` after the rules, to adjust or add annotations by hand."""
        self._callbacks.append(callback)
        return self

    # -- PT2E quantizer protocol --------------------------------------------------------------
    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        passes: list[NamedPass] = [
            p
            for result in reversed(
                self._backend.hook.quantplug_passes_before_annotation(context=self.context)
            )
            for p in result
        ]
        for p in passes:
            out = p.fn(model, self.context)
            if out is not None:
                model = out
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        """Apply each node's rule with the config selected for it; record why others stay float.

        Fused pairs (the backend's ``FusionPattern``s) are decided first, from the configs
        selected for both nodes, so the head's rule sees ``fused_tail(node)`` and a pattern whose
        tail the user keeps float falls back as the backend declares.
        """
        graph = model.graph
        self._check_module_names(graph)
        present = {op_name(n.target) for n in graph.nodes if n.op == "call_function"}
        rules = self.rules.for_ops(present)
        selected: dict[str, tuple[QuantizationConfig | None, str]] = {}
        for node in graph.nodes:
            if node.op == "call_function":
                node.meta.pop(FUSED_TAIL_KEY, None)
                node.meta.pop(FUSED_HEAD_KEY, None)
                if op_name(node.target) in rules:
                    selected[node.name] = self.selector.select(node)
        plan = self._plan_fusions(graph, selected)
        if plan.fused:
            by_name = {n.name: n for n in graph.nodes}
            for head, tail in plan.fused.items():
                by_name[head].meta[FUSED_TAIL_KEY] = tail
                by_name[tail].meta[FUSED_HEAD_KEY] = head
        kept_float = {**index_arithmetic(graph), **mutated_aliases(graph), **buffer_state(graph)}
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node in kept_float:
                node.meta[FLOAT_REASON_KEY] = kept_float[node]
                continue
            name = op_name(node.target)
            rule = rules.get(name)
            if rule is None:
                node.meta.setdefault(FLOAT_REASON_KEY, f"backend {self.backend!r} has no rule for {name}")
                continue
            node.meta[RULE_KEY] = rule
            config, why = selected[node.name]
            if config is None:
                node.meta[FLOAT_REASON_KEY] = f"{DISCARDED} ({why})"
                continue
            if node.name in plan.float_heads:
                node.meta[FLOAT_REASON_KEY] = (
                    f"fused with {plan.float_heads[node.name]!r}, which stays float: backend "
                    f"{self.backend!r} runs this pattern only as a whole (when_tail_float='float')"
                )
                continue
            self._apply(rule, node, config)
        self._run_annotation_passes(model, selected, kept_float)
        self._annotate_io(graph)
        for callback in self._callbacks:
            callback(model, self.context)
        if plan.fused:
            remove_fused_encodings(graph, plan.fused)
        for node in graph.nodes:
            if node.op == "call_function" and _has_specs(node) and FLOAT_REASON_KEY in node.meta:
                del node.meta[FLOAT_REASON_KEY]
            elif node.op == "call_function" and RULE_KEY in node.meta and not _has_specs(node):
                node.meta.setdefault(FLOAT_REASON_KEY, _why_unannotated(node))
        return model

    def _run_annotation_passes(
        self,
        model: GraphModule,
        selected: dict[str, tuple[QuantizationConfig | None, str]],
        kept_float: dict[Node, str],
    ) -> None:
        """The backend's whole-graph annotation stages (hook ``quantplug_annotation_passes``); what
        they put on a node the user keeps float, or that must stay float, is taken off again."""
        results = self._backend.hook.quantplug_annotation_passes(context=self.context)
        passes = [p for r in reversed(results) for p in r]
        if not passes:
            return
        for p in passes:
            try:
                p.fn(model, self.context)
            except (QuantplugError, ConstraintViolationError):
                raise
            except Exception as exc:
                raise BackendFailedError(
                    self.backend, None, getattr(p.fn, "__module__", "?"), f"annotation pass {p.name!r}", exc
                ) from exc
        for node in model.graph.nodes:
            if node.op != "call_function" or Q_ANNOTATION_KEY not in node.meta:
                continue
            if node in kept_float:
                del node.meta[Q_ANNOTATION_KEY]
                node.meta[FLOAT_REASON_KEY] = kept_float[node]
                continue
            config, why = selected.get(node.name) or self.selector.select(node)
            if config is None:
                del node.meta[Q_ANNOTATION_KEY]
                node.meta[FLOAT_REASON_KEY] = f"{DISCARDED} ({why})"

    def set_io(self, config: QuantizationConfig | None) -> Quantizer:
        """Specs for the program's own inputs (``config.input_activation``) and outputs
        (``config.output_activation``); None: inputs and outputs as the rules leave them. Overrides
        the backend's default (hook ``quantplug_io_config``)."""
        self._io_config = config
        self._io_set = True
        return self

    @property
    def io_config(self) -> QuantizationConfig | None:
        """The specs the program's inputs and outputs get: ``set_io``'s, else the backend's."""
        if self._io_set:
            return self._io_config
        return self._backend.hook.quantplug_io_config(context=self.context)

    def _annotate_io(self, graph: torch.fx.Graph) -> None:
        config = self.io_config
        if config is None:
            return
        if config.input_activation is not None:
            for node in graph.nodes:
                if node.op == "placeholder" and is_float_tensor(node) and node.users:
                    annotation = node.meta.get(Q_ANNOTATION_KEY) or QuantizationAnnotation()
                    annotation.output_qspec = config.input_activation
                    node.meta[Q_ANNOTATION_KEY] = annotation
        if config.output_activation is not None:
            output = next(n for n in reversed(graph.nodes) if n.op == "output")
            returned = [
                a for a in dict.fromkeys(output.all_input_nodes) if is_float_tensor(a) and a.op != "get_attr"
            ]
            if returned:
                annotation = output.meta.get(Q_ANNOTATION_KEY) or QuantizationAnnotation()
                for value in returned:
                    annotation.input_qspec_map[value] = config.output_activation
                output.meta[Q_ANNOTATION_KEY] = annotation

    @property
    def fusion_patterns(self) -> tuple[FusionPattern, ...]:
        """The backend's and its extensions' fused pairs (hook ``quantplug_fusion_patterns``)."""
        if self._fusion_patterns is None:
            results = self._backend.hook.quantplug_fusion_patterns(context=self.context)
            self._fusion_patterns = tuple(p for r in reversed(results) for p in r)
        return self._fusion_patterns

    def _plan_fusions(
        self, graph: torch.fx.Graph, selected: dict[str, tuple[QuantizationConfig | None, str]]
    ) -> FusionPlan:
        patterns = self.fusion_patterns
        if not patterns:
            return FusionPlan()
        by_name = {n.name: n for n in graph.nodes if n.op == "call_function"}
        nodes = [
            OpNode(
                n.name,
                op_name(n.target),
                tuple(u.name for u in n.users),
                n.args[0].name if n.args and isinstance(n.args[0], Node) else None,
            )
            for n in by_name.values()
        ]

        def holds(pattern: FusionPattern, head: str, tail: str) -> bool:
            assert pattern.when is not None
            try:
                return bool(pattern.when(by_name[head], by_name[tail], self.context))
            except Exception as exc:
                raise BackendFailedError(
                    self.backend,
                    None,
                    getattr(pattern.when, "__module__", "?"),
                    f"the condition of fusion pattern {pattern.name or sorted(pattern.heads)!r} on "
                    f"{head!r} -> {tail!r}",
                    exc,
                ) from exc

        return plan_fusions(
            nodes, patterns, lambda name: selected.get(name, (None, ""))[0] is not None, holds
        )

    def config_for(self, node: Node) -> QuantizationConfig | None:
        """The config the user's overrides select for ``node`` (None: kept float). Also
        ``context.config_for(node)`` inside hooks and rules."""
        return self.selector.select(node)[0]

    def _check_module_names(self, graph: torch.fx.Graph) -> None:
        """Every ``set_module_name`` names a module of the program: a typo must not silently
        leave the override unused."""
        wanted = [name for name in self.selector.module_names if name]
        if not wanted:
            return
        modules = {
            str(fqn) for n in graph.nodes for fqn, _ in (n.meta.get("nn_module_stack") or {}).values() if fqn
        }
        for name in wanted:
            if name in modules or any(m.startswith(name + ".") for m in modules):
                continue
            shown = ", ".join(sorted(modules)[:8]) + (", ..." if len(modules) > 8 else "")
            raise OptionError(
                f"set_module_name({name!r}) names no module of this program{did_you_mean(name, modules)}; "
                f"its modules: {shown or 'none (no module information in the graph)'}"
            )

    def _apply(self, rule: AnnotatorRule, node: Node, config: QuantizationConfig) -> None:
        try:
            if rule.takes_context:
                rule.fn(node, config, self.context)
            else:
                rule.fn(node, config)
        except QuantplugError:
            raise  # a rule's own typed error (a block size that divides nothing) reaches the user as is
        except Exception as exc:
            raise BackendFailedError(
                self.backend,
                None,
                getattr(rule.fn, "__module__", "?"),
                f"rule {rule.fn.__name__} on node {node.name!r} ({rule.op})",
                exc,
            ) from exc

    def constraints(self, op: str, backend_op: str | None) -> list[OpConstraint]:
        key = (op, backend_op)
        found = self._constraint_cache.get(key)
        if found is None:
            results = self._backend.hook.quantplug_op_constraints(
                op=op, backend_op=backend_op, context=self.context
            )
            found = self._constraint_cache[key] = [c for r in reversed(results) for c in r]
        return found

    def validate(self, model: GraphModule, *, sharing: SharingGroups | None = None) -> ValidationReport:
        """Check annotations against the backend's constraints; raise if strict, else warn.

        Relations between ports (same scale, bias = input x weight scale...) are checked against
        the sharing groups: ``prepare`` passes the groups it resolved; without them they are
        resolved here as ``prepare`` would (with the backend's sharing hook).
        """
        if sharing is None:
            sharing = self.resolve_sharing(collect_keys(model.graph).problem(model.graph))
        report = validate_graph(
            model, self.constraints, _backend_ops(model.graph), arch=self.arch, sharing=sharing.group_of
        )
        return report.enforce(self.strict)

    def calibrated_checks(self, model: GraphModule, sharing: SharingGroups) -> CalibratedPlan:
        """What ``convert`` checks on the calibrated encodings (limits, relations), as plain data."""
        return calibrated_plan(
            model.graph, self.constraints, _backend_ops(model.graph), sharing.group_of, strict=self.strict
        )

    # -- quantplug extras ---------------------------------------------------------------------
    def resolve_sharing(self, problem: SharingProblem) -> SharingGroups:
        """The backend's sharing (hook, else the core), after the merges that ``enforce="share"``
        relations ask for."""
        if problem.graph is not None:
            merges = relation_merges(problem.graph, self.constraints, _backend_ops(problem.graph))
            merges = [(a, b) for a, b in merges if a in problem.specs and b in problem.specs]
            if merges:
                problem = problem.with_merges(merges)  # type: ignore[arg-type]
        groups = self._backend.hook.quantplug_resolve_sharing(
            problem=problem, resolve=solve, context=self.context
        )
        return groups if groups is not None else solve(problem)

    def lowering_plan(self) -> LoweringPlan:
        hook = self._backend.hook
        passes = tuple(p for r in reversed(hook.quantplug_lowering_passes(context=self.context)) for p in r)
        writer = hook.quantplug_artifact_writer(context=self.context)
        return LoweringPlan(passes=passes, writer=writer)

    def coverage(self, program: torch.export.ExportedProgram | GraphModule) -> CoverageReport:
        """Which op nodes this quantizer quantizes and why the others stay float (no side effects).

        Runs what ``prepare`` runs up to observer sharing, on a copy: the same rewrites
        (:data:`_quantplug.rewrites.pipeline.PIPELINE`, as for ``prepare(..., qat=...)`` with this
        quantizer's QAT option and no algorithm), the backend's passes, annotation with fusion,
        sharing with the backend's hook (an encoding the hook drops counts as float).
        """
        gm = working_copy(program)
        option = self.info.qat_option
        qat = option is not None and self.options.get(option) is True
        rewrite_for_annotation(gm, qat=qat, algorithms=False)
        gm = self.transform_for_annotation(gm)
        self.annotate(gm)
        try:
            groups: SharingGroups | None = self.resolve_sharing(collect_keys(gm.graph).problem(gm.graph))
        except AnnotationError:
            groups = None  # prepare would refuse these annotations; report them as written
        return coverage_of(gm, groups, backend=self.backend)


def _backend_ops(graph: torch.fx.Graph) -> dict[str, str | None]:
    """ATen op name -> backend op of the rule that annotated it, for the ops with a rule."""
    return {
        op_name(n.target): n.meta[RULE_KEY].backend_op
        for n in graph.nodes
        if n.op == "call_function" and RULE_KEY in n.meta
    }


def _has_specs(node: Node) -> bool:
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return False
    return any(s is not None for s in ann.input_qspec_map.values()) or ann.output_qspec is not None


def coverage_of(gm: GraphModule, groups: SharingGroups | None = None, *, backend: str = "") -> CoverageReport:
    """Coverage of an annotated graph (reasons recorded by ``Quantizer.annotate``).

    With ``groups`` (the resolved sharing), annotated keys missing from them (dropped by a
    backend's sharing hook) count as float: a node left with none is float, a node whose output
    was dropped is quantized with a note.
    """
    kept = None if groups is None else groups.group_of
    entries = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fused_with = node.meta.get(FUSED_TAIL_KEY) or node.meta.get(FUSED_HEAD_KEY)
        quantized = _has_specs(node)
        reason = "" if quantized else node.meta.get(FLOAT_REASON_KEY, "not annotated")
        note = str(node.meta.get(NOTE_KEY, "")) if quantized else ""
        if quantized and kept is not None:
            keys = _annotated_keys(node)
            survivors = [k for k in keys if k in kept]
            by = f"backend {backend!r}" if backend else "the backend"
            if not survivors:
                quantized = False
                reason = f"its encodings were dropped by {by}'s observer sharing (its neighbours stay float)"
            elif node.name in keys and node.name not in kept:
                note = f"output float: its encoding was dropped by {by}'s observer sharing"
        entries.append(NodeCoverage(node.name, op_name(node.target), quantized, reason, fused_with, note))
    return CoverageReport(tuple(entries))


def _annotated_keys(node: Node) -> list[Any]:
    ann = node.meta[Q_ANNOTATION_KEY]
    keys: list[Any] = [(a.name, node.name) for a, s in ann.input_qspec_map.items() if s is not None]
    if ann.output_qspec is not None:
        keys.append(node.name)
    return keys


def make_quantizer(backend: LoadedBackend, options: dict[str, Any]) -> Quantizer:
    """Resolve ``options`` (``strict`` like any bool option, the rest against the backend's)."""
    strict = STRICT_OPTION.coerce(
        options.pop(STRICT_OPTION.name, STRICT_OPTION.default), backend=backend.info.name
    )
    resolved = backend.info.resolve_options(options)
    return Quantizer(backend, resolved, strict=strict)


def _why_unannotated(node: Node) -> str:
    """Why a node its rule saw holds no quantization: nothing of it can be quantized, or the
    configuration quantizes none of it (a weight-only preset on a product of two activations)."""
    if not any(is_float_tensor(n) for n in (node, *node.all_input_nodes)):
        return "its rule left it float (no floating-point tensor: integer or boolean values)"
    return "its rule quantized none of its tensors under this configuration"
