"""quantplug: PyTorch 2 export quantization with hardware backends as plugins.

ep = torch.export.export(model.eval(), example_inputs)
quantizer = quantplug.get_quantizer("reference")
prepared = quantplug.prepare(ep, quantizer)
for batch in data: prepared(*batch)
quantized = quantplug.convert(prepared)
artifact = quantplug.lower(quantized, quantizer)

The public modules are this one (users), :mod:`quantplug.backend` (the SDK backend plugins are
written against), :mod:`quantplug.debug`, :mod:`quantplug.distributed` and
:mod:`quantplug.conformance`. Everything else lives in the private package ``_quantplug`` and may
change in any release; the 0.1.0 module paths keep working, deprecated, until 0.4.0
(``_quantplug.deprecated``).

``import quantplug`` imports neither torch nor any plugin: each name is imported from the private
module defining it on first use, so ``quantplug --help`` and ``list_backends()`` answer at once.
Type checkers read ``__init__.pyi``, generated from :data:`_DECLARATION` by ``python
scripts/generate.py``.
"""

from __future__ import annotations

from _quantplug import deprecated as _deprecated
from _quantplug import lazy as _lazy

__version__ = "0.2.0"

#: the version of the plugin contract (hook specs and ``quantplug.backend``) this release provides;
#: a backend can require one with ``BackendInfo(requires_api=...)`` (see ``quantplug.backend``)
PLUGIN_API_VERSION = "1.1"

#: private module -> the public names it defines (each name declared once)
_DECLARATION: dict[str, tuple[str, ...]] = {
    "_quantplug.api": ("get_quantizer", "quantize"),
    "_quantplug.flow.prepare": ("prepare",),
    "_quantplug.flow.convert": ("convert",),
    "_quantplug.lowering.lower": ("lower",),
    "_quantplug.lowering.artifact": ("Artifact",),
    "_quantplug.archive": ("load_program",),
    "_quantplug.algorithms.config": ("Algorithms",),
    "_quantplug.algorithms.registry": (
        "AlgorithmEntry",
        "list_algorithms",
        "register_algorithm",
        "unregister_algorithm",
    ),
    "_quantplug.algorithms.spec": (
        "Algorithm",
        "AlgorithmOption",
        "Collector",
        "MergeableCollector",
        "WeightChoice",
        "WeightGrid",
        "WeightSite",
    ),
    "_quantplug.plugins.registry": (
        "BackendEntry",
        "list_backends",
        "register_backend",
        "register_extension",
        "registered_backend",
        "unregister",
    ),
    "_quantplug.quantizer.quantizer": ("CoverageReport", "Quantizer"),
    "_quantplug.errors": (
        "AlgorithmError",
        "AnnotationError",
        "BackendDisabledError",
        "BackendFailedError",
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
    # the plugin vocabulary, here since 0.1.0; quantplug.backend holds it all
    "_quantplug.annotation.specs": (
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
    "_quantplug.annotation.annotators": (
        "annotate_binary",
        "annotate_shared_in_out",
        "annotate_single_in",
        "annotate_single_in_single_out",
        "annotate_weighted",
        "derived_bias_spec",
        "is_float_tensor",
        "register_annotator",
    ),
    "_quantplug.plugins.contract": (
        "BackendInfo",
        "BackendOption",
        "LoweringPlan",
        "NamedPass",
        "Preset",
        "RulesModule",
    ),
    "_quantplug.plugins.hookspecs": ("hookimpl",),
    "_quantplug.quantizer.context": ("BackendContext",),
    "_quantplug.quantizer.fusion": ("FusionPattern", "fused_head", "fused_tail"),
    "_quantplug.conformance.profile": ("ConformanceProfile",),
    "_quantplug.sharing.problem": ("SharingProblem",),
    "_quantplug.sharing.resolution": ("KeySpec", "SharingGroups"),
    "_quantplug.validation.constraints": (
        "OUTPUT",
        "ArchRequirement",
        "OpConstraint",
        "PortConstraint",
        "RequantRatio",
        "SameEncoding",
        "SameScale",
        "ScaleProduct",
    ),
    "_quantplug.validation.report": ("ValidationReport", "Violation"),
}

#: modules reachable as attributes: the public ones, and (deprecated) the 0.1.0 subpackages
_MODULES = {
    "backend": "quantplug.backend",
    "debug": "quantplug.debug",
    "distributed": "quantplug.distributed",
    "conformance": "quantplug.conformance",
    **{name: f"quantplug.{name}" for name in ("algorithms", "report", "cli", "demo", "observers", "flow")},
}

_deprecated.install()
__all__ = [*_lazy.install(__name__, _DECLARATION, modules=_MODULES), "PLUGIN_API_VERSION"]
