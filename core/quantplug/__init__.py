"""quantplug: PyTorch 2 export quantization with hardware backends as plugins.

ep = torch.export.export(model.eval(), example_inputs)
quantizer = quantplug.get_quantizer("reference")
prepared = quantplug.prepare(ep, quantizer)
for batch in data: prepared(*batch)
quantized = quantplug.convert(prepared)
artifact = quantplug.lower(quantized, quantizer)

``import quantplug`` imports neither torch nor any plugin: each public name is imported from its
module on first use (PEP 562), so ``quantplug --help`` and ``list_backends()`` answer at once.
``from quantplug import X`` and ``quantplug.X`` work as usual; type checkers and IDEs read the
imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module defining it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "annotate_binary",
            "annotate_shared_in_out",
            "annotate_single_in",
            "annotate_single_in_single_out",
            "annotate_weighted",
            "derived_bias_spec",
            "is_float_tensor",
            "register_annotator",
        ),
        "quantplug.annotation.annotators",
    ),
    **dict.fromkeys(
        (
            "Q_ANNOTATION_KEY",
            "DerivedQuantizationSpec",
            "EdgeOrNode",
            "FixedQParamsQuantizationSpec",
            "QuantizationAnnotation",
            "QuantizationConfig",
            "QuantizationSpec",
            "QuantizationSpecBase",
            "SharedQuantizationSpec",
            "annotate_node",
            "is_annotated",
        ),
        "quantplug.annotation.specs",
    ),
    **dict.fromkeys(
        ("AlgorithmEntry", "list_algorithms", "register_algorithm", "unregister_algorithm"),
        "quantplug.algorithms.registry",
    ),
    **dict.fromkeys(
        (
            "Algorithm",
            "AlgorithmOption",
            "Collector",
            "MergeableCollector",
            "WeightChoice",
            "WeightGrid",
            "WeightSite",
        ),
        "quantplug.algorithms.spec",
    ),
    **dict.fromkeys(("get_quantizer", "quantize"), "quantplug.api"),
    "ConformanceProfile": "quantplug.conformance.profile",
    **dict.fromkeys(("load_program",), "quantplug.archive"),
    **dict.fromkeys(
        (
            "AlgorithmError",
            "AnnotationError",
            "BackendDisabledError",
            "BackendLoadError",
            "CalibrationError",
            "CollectorMergeError",
            "ConstraintViolationError",
            "ConversionError",
            "DistributedError",
            "DuplicateBackendError",
            "LoweringError",
            "NonFiniteError",
            "ObserverMergeError",
            "OptionError",
            "QuantplugError",
            "UnknownAlgorithmError",
            "UnknownBackendError",
            "UnsafeArchiveError",
        ),
        "quantplug.errors",
    ),
    "convert": "quantplug.flow.convert",
    "prepare": "quantplug.flow.prepare",
    "Artifact": "quantplug.lowering.artifact",
    "lower": "quantplug.lowering.lower",
    **dict.fromkeys(
        ("BackendInfo", "BackendOption", "LoweringPlan", "NamedPass", "Preset", "RulesModule"),
        "quantplug.plugins.contract",
    ),
    "hookimpl": "quantplug.plugins.hookspecs",
    **dict.fromkeys(
        (
            "BackendEntry",
            "list_backends",
            "register_backend",
            "register_extension",
            "registered_backend",
            "unregister",
        ),
        "quantplug.plugins.registry",
    ),
    "BackendContext": "quantplug.quantizer.context",
    **dict.fromkeys(("FusionPattern", "fused_head", "fused_tail"), "quantplug.quantizer.fusion"),
    **dict.fromkeys(("CoverageReport", "Quantizer"), "quantplug.quantizer.quantizer"),
    "SharingProblem": "quantplug.sharing.problem",
    **dict.fromkeys(("KeySpec", "SharingGroups"), "quantplug.sharing.resolution"),
    **dict.fromkeys(
        (
            "OUTPUT",
            "ArchRequirement",
            "OpConstraint",
            "PortConstraint",
            "RequantRatio",
            "SameEncoding",
            "SameScale",
            "ScaleProduct",
        ),
        "quantplug.validation.constraints",
    ),
    **dict.fromkeys(("ValidationReport", "Violation"), "quantplug.validation.report"),
}

#: subpackages reachable as attributes (``quantplug.debug.compare``), imported on first use
_SUBPACKAGES = ("algorithms", "debug", "report", "cli", "demo", "observers", "flow", "distributed")

__all__ = [
    "OUTPUT",
    "Q_ANNOTATION_KEY",
    "Algorithm",
    "AlgorithmEntry",
    "AlgorithmError",
    "AlgorithmOption",
    "AnnotationError",
    "ArchRequirement",
    "Artifact",
    "BackendContext",
    "BackendDisabledError",
    "BackendEntry",
    "BackendInfo",
    "BackendLoadError",
    "BackendOption",
    "CalibrationError",
    "Collector",
    "CollectorMergeError",
    "ConformanceProfile",
    "ConstraintViolationError",
    "ConversionError",
    "CoverageReport",
    "DerivedQuantizationSpec",
    "DistributedError",
    "DuplicateBackendError",
    "EdgeOrNode",
    "FixedQParamsQuantizationSpec",
    "FusionPattern",
    "KeySpec",
    "LoweringError",
    "LoweringPlan",
    "MergeableCollector",
    "NamedPass",
    "NonFiniteError",
    "ObserverMergeError",
    "OpConstraint",
    "OptionError",
    "PortConstraint",
    "Preset",
    "QuantizationAnnotation",
    "QuantizationConfig",
    "QuantizationSpec",
    "QuantizationSpecBase",
    "Quantizer",
    "QuantplugError",
    "RequantRatio",
    "RulesModule",
    "SameEncoding",
    "SameScale",
    "ScaleProduct",
    "SharedQuantizationSpec",
    "SharingGroups",
    "SharingProblem",
    "UnknownAlgorithmError",
    "UnknownBackendError",
    "UnsafeArchiveError",
    "ValidationReport",
    "Violation",
    "WeightChoice",
    "WeightGrid",
    "WeightSite",
    "annotate_binary",
    "annotate_node",
    "annotate_shared_in_out",
    "annotate_single_in",
    "annotate_single_in_single_out",
    "annotate_weighted",
    "convert",
    "derived_bias_spec",
    "fused_head",
    "fused_tail",
    "get_quantizer",
    "hookimpl",
    "is_annotated",
    "is_float_tensor",
    "list_algorithms",
    "list_backends",
    "load_program",
    "lower",
    "prepare",
    "quantize",
    "register_algorithm",
    "register_annotator",
    "register_backend",
    "register_extension",
    "registered_backend",
    "unregister",
    "unregister_algorithm",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"quantplug.{name}")
    raise AttributeError(f"module 'quantplug' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})


if TYPE_CHECKING:
    from quantplug.algorithms.registry import (
        AlgorithmEntry,
        list_algorithms,
        register_algorithm,
        unregister_algorithm,
    )
    from quantplug.algorithms.spec import (
        Algorithm,
        AlgorithmOption,
        Collector,
        MergeableCollector,
        WeightChoice,
        WeightGrid,
        WeightSite,
    )
    from quantplug.annotation.annotators import (
        annotate_binary,
        annotate_shared_in_out,
        annotate_single_in,
        annotate_single_in_single_out,
        annotate_weighted,
        derived_bias_spec,
        is_float_tensor,
        register_annotator,
    )
    from quantplug.annotation.specs import (
        Q_ANNOTATION_KEY,
        DerivedQuantizationSpec,
        EdgeOrNode,
        FixedQParamsQuantizationSpec,
        QuantizationAnnotation,
        QuantizationConfig,
        QuantizationSpec,
        QuantizationSpecBase,
        SharedQuantizationSpec,
        annotate_node,
        is_annotated,
    )
    from quantplug.api import get_quantizer, quantize
    from quantplug.archive import load_program
    from quantplug.conformance.profile import ConformanceProfile
    from quantplug.errors import (
        AlgorithmError,
        AnnotationError,
        BackendDisabledError,
        BackendLoadError,
        CalibrationError,
        CollectorMergeError,
        ConstraintViolationError,
        ConversionError,
        DistributedError,
        DuplicateBackendError,
        LoweringError,
        NonFiniteError,
        ObserverMergeError,
        OptionError,
        QuantplugError,
        UnknownAlgorithmError,
        UnknownBackendError,
        UnsafeArchiveError,
    )
    from quantplug.flow.convert import convert
    from quantplug.flow.prepare import prepare
    from quantplug.lowering.artifact import Artifact
    from quantplug.lowering.lower import lower
    from quantplug.plugins.contract import (
        BackendInfo,
        BackendOption,
        LoweringPlan,
        NamedPass,
        Preset,
        RulesModule,
    )
    from quantplug.plugins.hookspecs import hookimpl
    from quantplug.plugins.registry import (
        BackendEntry,
        list_backends,
        register_backend,
        register_extension,
        registered_backend,
        unregister,
    )
    from quantplug.quantizer.context import BackendContext
    from quantplug.quantizer.fusion import FusionPattern, fused_head, fused_tail
    from quantplug.quantizer.quantizer import CoverageReport, Quantizer
    from quantplug.sharing.problem import SharingProblem
    from quantplug.sharing.resolution import KeySpec, SharingGroups
    from quantplug.validation.constraints import (
        OUTPUT,
        ArchRequirement,
        OpConstraint,
        PortConstraint,
        RequantRatio,
        SameEncoding,
        SameScale,
        ScaleProduct,
    )
    from quantplug.validation.report import ValidationReport, Violation
