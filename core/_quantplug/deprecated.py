"""Every deprecated spelling of quantplug, and the path each keeps working on until its removal.

Version 0.2.0 made the core private (:mod:`_quantplug`) and gave plugins one public SDK,
:mod:`quantplug.backend`. Plugins written against 0.1.0 import core modules by their old paths
(``quantplug.observers.minmax``, ``quantplug.flow.inspect``, ``quantplug.annotation.specs`` ...),
which the 0.1.0 guide named. Those paths keep working until 0.4.0: :data:`MODULES` maps each to the
module that holds its code now, and importing one gives that very module (same classes, same
functions: ``isinstance`` checks hold) with a :class:`DeprecationWarning` naming the public place
to import from instead. The table is the 0.1.0 module tree as released; ``CHANGELOG.md`` records it.

The public modules themselves (``quantplug``, ``quantplug.backend``, ``quantplug.debug``,
``quantplug.distributed``, ``quantplug.conformance``) are not in the table.

Keywords of public functions replaced since 0.1.0 are in :data:`KEYWORDS`; the function keeps
accepting each, with a :class:`DeprecationWarning` naming the new spelling
(:func:`warn_old_keyword`), until the same release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

#: the release that removes the spellings below
REMOVED_IN = "0.4.0"

#: old module path (0.1.0) -> the module holding its code now
MODULES: dict[str, str] = {
    "quantplug.algorithms": "_quantplug.algorithms",
    "quantplug.algorithms.adaround": "_quantplug.algorithms.adaround",
    "quantplug.algorithms.bias_correction": "_quantplug.algorithms.bias_correction",
    "quantplug.algorithms.cle": "_quantplug.algorithms.cle",
    "quantplug.algorithms.collectors": "_quantplug.algorithms.collectors",
    "quantplug.algorithms.experts": "_quantplug.algorithms.experts",
    "quantplug.algorithms.finite_inputs": "_quantplug.algorithms.finite_inputs",
    "quantplug.algorithms.gptq": "_quantplug.algorithms.gptq",
    "quantplug.algorithms.guard": "_quantplug.algorithms.guard",
    "quantplug.algorithms.merge": "_quantplug.algorithms.merge",
    "quantplug.algorithms.mixed_precision": "_quantplug.mixed_precision",
    "quantplug.algorithms.option_checks": "_quantplug.algorithms.option_checks",
    "quantplug.algorithms.recurrent": "_quantplug.graph.recurrent",
    "quantplug.algorithms.registry": "_quantplug.algorithms.registry",
    "quantplug.algorithms.runtime": "_quantplug.algorithms.runtime",
    "quantplug.algorithms.seq_mse": "_quantplug.algorithms.seq_mse",
    "quantplug.algorithms.sequential": "_quantplug.algorithms.sequential",
    "quantplug.algorithms.smoothquant": "_quantplug.algorithms.smoothquant",
    "quantplug.algorithms.spec": "_quantplug.algorithms.spec",
    "quantplug.algorithms.weight_layers": "_quantplug.algorithms.weight_layers",
    "quantplug.algorithms.weight_matrix": "_quantplug.algorithms.weight_matrix",
    "quantplug.annotation": "_quantplug.annotation",
    "quantplug.annotation.annotators": "_quantplug.annotation.annotators",
    "quantplug.annotation.dtypes": "_quantplug.annotation.dtypes",
    "quantplug.annotation.spec_view": "_quantplug.annotation.spec_view",
    "quantplug.annotation.specs": "_quantplug.annotation.specs",
    "quantplug.api": "_quantplug.api",
    "quantplug.archive": "_quantplug.archive",
    "quantplug.cli": "_quantplug.cli",
    "quantplug.cli.algorithms": "_quantplug.cli.algorithms",
    "quantplug.cli.checks": "_quantplug.cli.checks",
    "quantplug.cli.conformance": "_quantplug.cli.conformance",
    "quantplug.cli.console": "_quantplug.cli.console",
    "quantplug.cli.distributed": "_quantplug.cli.distributed",
    "quantplug.cli.errors": "_quantplug.cli.errors",
    "quantplug.cli.inputs": "_quantplug.cli.inputs",
    "quantplug.cli.main": "_quantplug.cli.main",
    "quantplug.cli.mixed_precision": "_quantplug.cli.mixed_precision",
    "quantplug.cli.options": "_quantplug.cli.options",
    "quantplug.cli.output": "_quantplug.cli.output",
    "quantplug.cli.scaffold": "_quantplug.cli.scaffold",
    "quantplug.conformance.checks": "_quantplug.conformance.checks",
    "quantplug.conformance.checks.discovery": "_quantplug.conformance.checks.discovery",
    "quantplug.conformance.checks.flow": "_quantplug.conformance.checks.flow",
    "quantplug.conformance.checks.ops": "_quantplug.conformance.checks.ops",
    "quantplug.conformance.checks.session": "_quantplug.conformance.checks.session",
    "quantplug.conformance.checks.sharing": "_quantplug.conformance.checks.sharing",
    "quantplug.conformance.checks.validation": "_quantplug.conformance.checks.validation",
    "quantplug.conformance.profile": "_quantplug.conformance.profile",
    "quantplug.conformance.pytest_plugin": "_quantplug.conformance.pytest_plugin",
    "quantplug.conformance.report": "_quantplug.conformance.report",
    "quantplug.conformance.runner": "_quantplug.conformance.runner",
    "quantplug.conformance.samples": "_quantplug.conformance.samples",
    "quantplug.debug.artifact": "_quantplug.debug.artifact",
    "quantplug.debug.compare": "_quantplug.debug.compare",
    "quantplug.demo": "_quantplug.demo",
    "quantplug.demo.model": "_quantplug.demo.model",
    "quantplug.distributed.collectors": "_quantplug.distributed.collectors",
    "quantplug.distributed.ddp": "_quantplug.distributed.ddp",
    "quantplug.distributed.fingerprint": "_quantplug.distributed.fingerprint",
    "quantplug.distributed.shard": "_quantplug.distributed.shard",
    "quantplug.distributed.sync": "_quantplug.distributed.sync",
    "quantplug.errors": "_quantplug.errors",
    "quantplug.files": "_quantplug.files",
    "quantplug.flow": "_quantplug.flow",
    "quantplug.flow.batchnorm": "_quantplug.rewrites.batchnorm",
    "quantplug.flow.calls": "_quantplug.graph.calls",
    "quantplug.flow.computed_weights": "_quantplug.rewrites.computed_weights",
    "quantplug.flow.constants": "_quantplug.graph.constants",
    "quantplug.flow.convert": "_quantplug.flow.convert",
    "quantplug.flow.embedding_bag": "_quantplug.rewrites.embedding_bag",
    "quantplug.flow.fast_matching": "_quantplug.peers.torchao_matching",
    "quantplug.flow.graph_copy": "_quantplug.graph.working_copy",
    "quantplug.flow.hand_written_linear": "_quantplug.rewrites.hand_written_linear",
    "quantplug.flow.inspect": "_quantplug.flow.inspect",
    "quantplug.flow.no_op_arguments": "_quantplug.rewrites.no_op_arguments",
    "quantplug.flow.parameter_writes": "_quantplug.rewrites.parameter_writes",
    "quantplug.flow.prepare": "_quantplug.flow.prepare",
    "quantplug.flow.softmax_inputs": "_quantplug.graph.softmax_inputs",
    "quantplug.flow.unread_writes": "_quantplug.rewrites.unread_writes",
    "quantplug.lowering": "_quantplug.lowering",
    "quantplug.lowering.artifact": "_quantplug.lowering.artifact",
    "quantplug.lowering.capture": "_quantplug.lowering.onnx.capture",
    "quantplug.lowering.contiguous": "_quantplug.peers.onnx_contiguous",
    "quantplug.lowering.in_place_writes": "_quantplug.peers.onnx_in_place_writes",
    "quantplug.lowering.lower": "_quantplug.lowering.lower",
    "quantplug.lowering.onnx_export": "_quantplug.lowering.onnx.export",
    "quantplug.lowering.onnx_translate": "_quantplug.peers.onnx_translate",
    "quantplug.lowering.projected_lstm": "_quantplug.peers.onnx_projected_lstm",
    "quantplug.lowering.provenance": "_quantplug.lowering.onnx.provenance",
    "quantplug.lowering.qdq_sites": "_quantplug.lowering.onnx.qdq_sites",
    "quantplug.observers": "_quantplug.observers",
    "quantplug.observers.accelerated": "_quantplug.peers.torchao_observers",
    "quantplug.observers.base": "_quantplug.observers.base",
    "quantplug.observers.factory": "_quantplug.observers.factory",
    "quantplug.observers.fake_quantize": "_quantplug.observers.fake_quantize",
    "quantplug.observers.fixed": "_quantplug.observers.fixed",
    "quantplug.observers.histogram": "_quantplug.observers.histogram",
    "quantplug.observers.kernels": "_quantplug.observers.kernels",
    "quantplug.observers.merge": "_quantplug.observers.merge",
    "quantplug.observers.minmax": "_quantplug.observers.minmax",
    "quantplug.observers.nonfinite": "_quantplug.observers.nonfinite",
    "quantplug.observers.per_block": "_quantplug.observers.per_block",
    "quantplug.observers.torchao_fast": "_quantplug.peers.torchao_observer_classes",
    "quantplug.ops": "_quantplug.observers.block_ops",
    "quantplug.plugins": "_quantplug.plugins",
    "quantplug.plugins.contract": "_quantplug.plugins.contract",
    "quantplug.plugins.hookspecs": "_quantplug.plugins.hookspecs_1_0",  # the 1.0 hooks only
    "quantplug.plugins.metadata": "_quantplug.plugins.metadata",
    "quantplug.plugins.registry": "_quantplug.plugins.registry",
    "quantplug.quantizer": "_quantplug.quantizer",
    "quantplug.quantizer.context": "_quantplug.quantizer.context",
    "quantplug.quantizer.fusion": "_quantplug.quantizer.fusion",
    "quantplug.quantizer.index_arithmetic": "_quantplug.graph.index_arithmetic",
    "quantplug.quantizer.mutation": "_quantplug.graph.mutation",
    "quantplug.quantizer.quantizer": "_quantplug.quantizer.quantizer",
    "quantplug.quantizer.rules": "_quantplug.quantizer.rules",
    "quantplug.quantizer.selection": "_quantplug.quantizer.selection",
    "quantplug.report": "_quantplug.report",
    "quantplug.report.data": "_quantplug.report.data",
    "quantplug.report.html": "_quantplug.report.html",
    "quantplug.report.plot": "_quantplug.report.plot",
    "quantplug.report.text": "_quantplug.report.text",
    "quantplug.scaffold": "_quantplug.scaffold",
    "quantplug.scaffold.templates": "_quantplug.scaffold.templates",
    "quantplug.sharing": "_quantplug.sharing",
    "quantplug.sharing.keys": "_quantplug.sharing.keys",
    "quantplug.sharing.problem": "_quantplug.sharing.problem",
    "quantplug.sharing.resolution": "_quantplug.sharing.resolution",
    "quantplug.suggest": "_quantplug.suggest",
    "quantplug.validation": "_quantplug.validation",
    "quantplug.validation.calibrated": "_quantplug.validation.calibrated",
    "quantplug.validation.constraints": "_quantplug.validation.constraints",
    "quantplug.validation.engine": "_quantplug.validation.engine",
    "quantplug.validation.relations": "_quantplug.validation.relations",
    "quantplug.validation.report": "_quantplug.validation.report",
}


#: (function, old keyword) -> the spelling that replaces it
KEYWORDS: dict[tuple[str, str], str] = {
    **{
        (function, old): f"{function}(..., algorithms=quantplug.Algorithms([...], {new}=...))"
        for function in ("prepare", "quantize")
        for old, new in (
            ("calibration", "calibration"),
            ("algorithm_guard", "guard"),
            ("held_out", "held_out"),
        )
        if (function, old) != ("quantize", "calibration")  # quantize's calibration is its data
    },
}


def warn_old_keyword(function: str, keyword: str, *, stacklevel: int = 3) -> None:
    """The warning a replaced keyword of a public function gives (``stacklevel`` 3: the caller of
    the function that calls this)."""
    warnings.warn(
        f"{function}(..., {keyword}=...) is deprecated since quantplug 0.2.0 and works until "
        f"quantplug {REMOVED_IN}; write {KEYWORDS[function, keyword]}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def warn_old_module_attribute(old: str, instead: str) -> None:
    """The warning a 0.1.0 module attribute that lost its meaning gives when read (``instead``
    says what replaced it)."""
    warnings.warn(
        f"{old} is deprecated since quantplug 0.2.0 and resolves until quantplug {REMOVED_IN}: {instead}",
        DeprecationWarning,
        stacklevel=3,
    )


def _caller_stacklevel() -> int:
    """``stacklevel`` for a warning given in :func:`warn_old_module`: the importing code's frame.

    ``warnings.warn`` skips importlib's bootstrap frames without counting them; every other frame
    between the loader and the importing code (``importlib.import_module``) counts.
    """
    level, frame = 2, sys._getframe(3)  # 1: warn_old_module, 2: the loader; then who imported
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen importlib._bootstrap"):
            level += 1
            if name != __file__ and not name.endswith("importlib/__init__.py"):
                break
        frame = frame.f_back  # type: ignore[assignment]
    return level


def warn_old_module(old: str) -> None:
    """The warning an old module path gives when first imported."""
    warnings.warn(
        f"{old} is a private module since quantplug 0.2.0; import from quantplug.backend (plugins) or "
        f"quantplug (users) instead. The old path works until quantplug {REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )


class _AliasLoader(importlib.abc.Loader):
    """Loads an old module path as the module that holds its code now (same object)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warn_old_module(self.old)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        if self.old in PACKAGE_VIEWS:
            return _PackageView(self.old, module, PACKAGE_VIEWS[self.old])
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if not isinstance(module, _PackageView):
            module.__spec__ = self._spec  # the import system set the alias's spec on the real module

    def get_code(self, fullname: str) -> Any:
        """For ``python -m OLD.PATH`` (runpy): the code of the module that holds it now."""
        spec = importlib.util.find_spec(self.new)
        loader = None if spec is None else spec.loader
        get_code = getattr(loader, "get_code", None)
        return None if get_code is None else get_code(self.new)

    def is_package(self, fullname: str) -> bool:
        spec = importlib.util.find_spec(self.new)
        return bool(spec and spec.submodule_search_locations is not None)


#: old package path -> {attribute: module} where the old path shows another module than the
#: package's own attribute: ``from quantplug.plugins import hookspecs`` gives plugin API 1.0's
#: hooks, as ``import quantplug.plugins.hookspecs`` does (:data:`MODULES`)
PACKAGE_VIEWS: dict[str, dict[str, str]] = {
    "quantplug.plugins": {"hookspecs": "_quantplug.plugins.hookspecs_1_0"},
}


class _PackageView(types.ModuleType):
    """An old package path whose attributes are the package's, but for :data:`PACKAGE_VIEWS`."""

    def __init__(self, old: str, package: types.ModuleType, views: dict[str, str]) -> None:
        super().__init__(old, package.__doc__)
        self.__dict__["_package"] = package
        self.__dict__["_views"] = views
        self.__path__ = list(getattr(package, "__path__", []))

    def __getattr__(self, name: str) -> Any:
        views = self.__dict__["_views"]
        if name in views:
            return importlib.import_module(views[name])
        return getattr(self.__dict__["_package"], name)


class LegacyModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MODULES` (first on ``sys.meta_path``)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MODULES.get(fullname)
        if new is None:
            return None
        loader = _AliasLoader(fullname, new)
        return importlib.util.spec_from_loader(fullname, loader, is_package=loader.is_package(fullname))


FINDER = LegacyModuleFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; ``import quantplug`` does it)."""
    if not any(isinstance(f, LegacyModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, FINDER)
