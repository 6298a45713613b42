"""quantplug: PyTorch 2 export quantization with hardware backends as plugins.

ep = torch.export.export(model.eval(), example_inputs)
quantizer = quantplug.get_quantizer("reference")
prepared = quantplug.prepare(ep, quantizer)
for batch in data: prepared(*batch)
quantized = quantplug.convert(prepared)
artifact = quantplug.lower(quantized, quantizer)
"""

from __future__ import annotations

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
from quantplug.conformance.profile import ConformanceProfile
from quantplug.errors import (
    AnnotationError,
    BackendDisabledError,
    BackendLoadError,
    CalibrationError,
    ConstraintViolationError,
    ConversionError,
    DuplicateBackendError,
    LoweringError,
    OptionError,
    QuantplugError,
    UnknownBackendError,
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

__version__ = "0.1.0"

_SUBPACKAGES = ("debug", "report", "cli", "demo", "observers", "flow")


def __getattr__(name: str) -> object:
    """``quantplug.debug`` and other heavier subpackages import on first use."""
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"quantplug.{name}")
    raise AttributeError(f"module 'quantplug' has no attribute {name!r}")


__all__ = [
    "OUTPUT",
    "Q_ANNOTATION_KEY",
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
    "ConformanceProfile",
    "ConstraintViolationError",
    "ConversionError",
    "CoverageReport",
    "DerivedQuantizationSpec",
    "DuplicateBackendError",
    "EdgeOrNode",
    "FixedQParamsQuantizationSpec",
    "FusionPattern",
    "KeySpec",
    "LoweringError",
    "LoweringPlan",
    "NamedPass",
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
    "UnknownBackendError",
    "ValidationReport",
    "Violation",
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
    "list_backends",
    "lower",
    "prepare",
    "quantize",
    "register_annotator",
    "register_backend",
    "register_extension",
    "registered_backend",
    "unregister",
]
