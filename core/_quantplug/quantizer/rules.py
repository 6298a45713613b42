"""Lazy rule loading: import only the rules modules that cover ops present in a graph."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence

from _quantplug.annotation.annotators import AnnotatorRule, rules_in_module
from _quantplug.errors import BackendLoadError
from _quantplug.plugins.contract import RulesModule


class RuleSet:
    """The ops a backend (plus extensions) can annotate, and the modules that hold their rules.

    Modules are imported on first need and cached; ``imported`` records which, so tests and users
    can check that a graph of linears never imported the conv rules.
    """

    def __init__(self, backend: str, modules: Sequence[RulesModule]) -> None:
        self.backend = backend
        self.modules = list(modules)
        self._op_to_modules: dict[str, list[str]] = {}
        for spec in self.modules:
            for op in spec.ops:
                self._op_to_modules.setdefault(op, []).append(spec.module)
        self._cache: dict[str, dict[str, AnnotatorRule]] = {}

    @property
    def ops(self) -> frozenset[str]:
        return frozenset(self._op_to_modules)

    @property
    def imported(self) -> list[str]:
        return list(self._cache)

    def _module_rules(self, module: str) -> dict[str, AnnotatorRule]:
        rules = self._cache.get(module)
        if rules is None:
            try:
                mod = importlib.import_module(module)
            except Exception as exc:
                raise BackendLoadError(self.backend, None, module, exc) from exc
            rules = self._cache[module] = rules_in_module(mod)
        return rules

    def for_ops(self, ops: Iterable[str]) -> dict[str, AnnotatorRule]:
        """Rules for the given op names; the last module declaring an op (an extension) wins."""
        found: dict[str, AnnotatorRule] = {}
        for op in ops:
            for module in self._op_to_modules.get(op, ()):
                rule = self._module_rules(module).get(op)
                if rule is not None:
                    found[op] = rule
        return found
