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

from quantplug.annotation.annotators import AnnotatorRule
from quantplug.annotation.specs import Q_ANNOTATION_KEY, QuantizationConfig
from quantplug.errors import BackendLoadError, ConstraintViolationError, OptionError
from quantplug.plugins.contract import BackendInfo, LoweringPlan, NamedPass, op_name
from quantplug.plugins.registry import LoadedBackend
from quantplug.quantizer.context import BackendContext
from quantplug.quantizer.rules import RuleSet
from quantplug.quantizer.selection import ConfigSelector
from quantplug.sharing.problem import SharingProblem, solve
from quantplug.sharing.resolution import SharingGroups
from quantplug.validation.constraints import OpConstraint
from quantplug.validation.engine import validate_graph
from quantplug.validation.report import ValidationReport

logger = logging.getLogger("quantplug")

FLOAT_REASON_KEY = "quantplug_float_reason"
RULE_KEY = "quantplug_rule"
#: node meta a rule may set on a node it quantizes differently from what the options asked for
#: (e.g. a smaller LPBQ block): shown by ``coverage()`` next to the node
NOTE_KEY = "quantplug_coverage_note"

AnnotationCallback = Callable[[GraphModule, BackendContext], None]


@dataclass(frozen=True)
class NodeCoverage:
    """Whether one op node is quantized, and why not when it stays float."""

    node: str
    op: str
    quantized: bool
    reason: str
    #: how a quantized node departs from the requested options (empty when it does not)
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

    def format(self) -> str:
        lines = [f"{len(self.quantized_nodes)} node(s) quantized, {len(self.float_nodes)} float"]
        for n in self.float_nodes:
            lines.append(f"  float {n.node} [{n.op}]: {n.reason}")
        for n in self.noted_nodes:
            lines.append(f"  note  {n.node} [{n.op}]: {n.note}")
        return "\n".join(lines)


class Quantizer:
    """A configured backend. Build with ``quantplug.get_quantizer(name, **options)``."""

    def __init__(self, backend: LoadedBackend, options: dict[str, Any], *, strict: bool = True) -> None:
        self._backend = backend
        self.context = BackendContext(backend=backend.info.name, options=options, strict=strict)
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

    # -- description -------------------------------------------------------------------------
    @property
    def strict(self) -> bool:
        """Raise on constraint violations and incomplete artifacts (False: warn)."""
        return self.context.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.context.strict = bool(value)

    @property
    def backend(self) -> str:
        return self._backend.info.name

    @property
    def info(self) -> BackendInfo:
        return self._backend.info

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.context.options)

    @property
    def global_config(self) -> QuantizationConfig | None:
        return self.selector.global_config

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.context.options.items())
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
        """Apply each node's rule with the config selected for it; record why others stay float."""
        graph = model.graph
        present = {op_name(n.target) for n in graph.nodes if n.op == "call_function"}
        rules = self.rules.for_ops(present)
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            name = op_name(node.target)
            rule = rules.get(name)
            if rule is None:
                node.meta.setdefault(FLOAT_REASON_KEY, f"backend {self.backend!r} has no rule for {name}")
                continue
            node.meta[RULE_KEY] = rule
            config, why = self.selector.select(node)
            if config is None:
                node.meta[FLOAT_REASON_KEY] = f"discarded by override ({why})"
                continue
            self._apply(rule, node, config)
        for callback in self._callbacks:
            callback(model, self.context)
        for node in graph.nodes:
            if node.op == "call_function" and _has_specs(node) and FLOAT_REASON_KEY in node.meta:
                del node.meta[FLOAT_REASON_KEY]
            elif node.op == "call_function" and RULE_KEY in node.meta and not _has_specs(node):
                node.meta.setdefault(FLOAT_REASON_KEY, "its rule left it float (non-float tensors, or fused)")
        return model

    def _apply(self, rule: AnnotatorRule, node: Node, config: QuantizationConfig) -> None:
        try:
            if rule.takes_context:
                rule.fn(node, config, self.context)
            else:
                rule.fn(node, config)
        except (OptionError, ConstraintViolationError):
            raise
        except Exception as exc:
            if type(exc).__module__.startswith("quantplug"):
                raise
            raise BackendLoadError(
                self.backend,
                None,
                getattr(rule.fn, "__module__", "?"),
                f"rule {rule.fn.__name__} failed on node {node.name!r} ({rule.op}): "
                f"{type(exc).__name__}: {exc}",
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

    def validate(self, model: GraphModule) -> ValidationReport:
        """Check annotations against the backend's constraints; raise if strict, else warn."""
        backend_ops = {
            op_name(n.target): n.meta[RULE_KEY].backend_op
            for n in model.graph.nodes
            if n.op == "call_function" and RULE_KEY in n.meta
        }
        report = validate_graph(model, self.constraints, backend_ops, arch=self.arch)
        if not report.ok:
            if self.strict:
                raise ConstraintViolationError(report)
            report.log_warnings()
        return report

    # -- quantplug extras ---------------------------------------------------------------------
    def resolve_sharing(self, problem: SharingProblem) -> SharingGroups:
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
        """Which op nodes this quantizer quantizes and why the others stay float (no side effects)."""
        from quantplug.flow.batchnorm import fold_batch_norm
        from quantplug.flow.graph_copy import working_copy

        gm = working_copy(program)
        fold_batch_norm(gm)
        gm = self.transform_for_annotation(gm)
        self.annotate(gm)
        return coverage_of(gm)


def _has_specs(node: Node) -> bool:
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return False
    return any(s is not None for s in ann.input_qspec_map.values()) or ann.output_qspec is not None


def coverage_of(gm: GraphModule) -> CoverageReport:
    """Coverage of an annotated graph (reasons recorded by ``Quantizer.annotate``)."""
    entries = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        quantized = _has_specs(node)
        reason = "" if quantized else node.meta.get(FLOAT_REASON_KEY, "not annotated")
        note = str(node.meta.get(NOTE_KEY, "")) if quantized else ""
        entries.append(NodeCoverage(node.name, op_name(node.target), quantized, reason, note))
    return CoverageReport(tuple(entries))


def make_quantizer(backend: LoadedBackend, options: dict[str, Any]) -> Quantizer:
    strict = options.pop("strict", True)
    if isinstance(strict, str) and strict.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        strict = strict.strip().lower() in ("true", "1", "yes")
    if not isinstance(strict, bool):
        raise OptionError(f"option 'strict' must be bool, got {strict!r}")
    resolved = backend.info.resolve_options(options)
    return Quantizer(backend, resolved, strict=strict)
