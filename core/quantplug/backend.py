"""quantplug.backend: everything a backend plugin is written against, and nothing else.

A backend plugin (and an extension of one) imports from here and from ``quantplug``, never from
``_quantplug``: these names are the plugin contract, versioned by :data:`PLUGIN_API_VERSION`
(minor versions only add; removals are deprecated for at least one minor release first, see
``CHANGELOG.md``). A test of quantplug fails when a name here changes without a record there.

What is here, by the phase that uses it (``docs/writing-a-backend.md`` has a section for each):

* the contract: ``hookimpl``, :class:`BackendInfo` and its options and presets, the context
  every hook receives, the conformance profile, the plugin API version;
* annotation: the PT2E spec vocabulary, the common annotators, a rules package's index
  (``rules_from_index``), reading specs, integer grids, fusion patterns, notes and per-node data
  for the backend's compiler, input/output specs;
* constraints and the validation report; observer sharing (problem, groups);
* observers: the base class and merge protocol, the built-in observers, the NaN/inf and mask
  policy a vendor's observer follows (``nonfinite``);
* reading programs: a converted program's encodings, prepare's state, node metadata;
* lowering: the shared QDQ ONNX exporter, ``Artifact``, tensor names for messages;
* errors.

Importing this module imports neither torch nor anything else: each name comes from its private
module on first use. Type checkers read ``backend.pyi``, generated from :data:`_DECLARATION`.
"""

from __future__ import annotations

from _quantplug import lazy as _lazy

#: the names ``quantplug`` exports too, declared here once: the plugin vocabulary it has held since
#: 0.1.0, the errors plugins raise, ``Artifact`` and the plugin API version
_SHARED: dict[str, tuple[str, ...]] = {
    # -- the contract --------------------------------------------------------------------------
    "_quantplug.plugins.hookspecs": ("hookimpl",),
    "_quantplug.plugins.api_version": ("PLUGIN_API_VERSION",),
    "_quantplug.plugins.contract": (
        "BackendInfo",
        "BackendOption",
        "LoweringPlan",
        "NamedPass",
        "Preset",
        "RulesModule",
    ),
    "_quantplug.quantizer.context": ("BackendContext",),
    "_quantplug.conformance.profile": ("ConformanceProfile",),
    # -- annotation ----------------------------------------------------------------------------
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
    "_quantplug.quantizer.fusion": ("FusionPattern", "fused_head", "fused_tail"),
    # -- constraints and sharing ---------------------------------------------------------------
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
    "_quantplug.sharing.problem": ("SharingProblem",),
    "_quantplug.sharing.resolution": ("KeySpec", "SharingGroups"),
    # -- lowering and errors -------------------------------------------------------------------
    "_quantplug.lowering.artifact": ("Artifact",),
    "_quantplug.errors": (
        "AnnotationError",
        "BackendFailedError",
        "CalibrationError",
        "ConstraintViolationError",
        "ConversionError",
        "LoweringError",
        "NonFiniteError",
        "ObserverMergeError",
        "OptionError",
        "QuantplugError",
        "TensorKwargError",
    ),
}

#: private module -> the public names it defines: ``_SHARED`` and the rest of the SDK below (each
#: declared once; ``scripts/generate.py`` writes ``backend.pyi`` from it)
_DECLARATION: dict[str, tuple[str, ...]] = _lazy.merged(
    _SHARED,
    {
        # -- the contract ----------------------------------------------------------------------
        "_quantplug.plugins.api_version": ("require_api",),
        "_quantplug.plugins.contract": ("op_name",),
        "_quantplug.conformance.profile": ("CAPABILITIES",),
        # -- annotation ------------------------------------------------------------------------
        "_quantplug.annotation.specs": ("get_annotation",),
        "_quantplug.annotation.annotators": ("constant_value", "floor_bias_scale", "output_spec_of"),
        "_quantplug.annotation.spec_view": ("SpecKind", "is_per_channel", "spec_kind", "spec_range"),
        "_quantplug.annotation.dtypes": ("INT2", "INT4", "UINT2", "UINT4", "full_range"),
        "_quantplug.quantizer.rules_index": ("rules_from_index",),
        "_quantplug.quantizer.node_data": (
            "backend_node_data",
            "float_reason",
            "is_discarded",
            "set_backend_node_data",
            "set_coverage_note",
        ),
        # -- constraints and sharing -----------------------------------------------------------
        "_quantplug.validation.constraints": ("Port", "PortRelation"),
        "_quantplug.sharing.resolution": ("Key",),
        # -- observers -------------------------------------------------------------------------
        "_quantplug.observers.base": ("ObserverBase", "ObserverFactory"),
        "_quantplug.observers.minmax": (
            "MinMaxObserver",
            "MovingAverageMinMaxObserver",
            "MovingAveragePerChannelMinMaxObserver",
            "PerChannelMinMaxObserver",
        ),
        "_quantplug.observers.histogram": ("HistogramObserver",),
        "_quantplug.observers.per_block": ("PerBlockMinMaxObserver",),
        "_quantplug.observers.merge": ("merge_observers", "merge_state"),
        # -- reading programs ------------------------------------------------------------------
        "_quantplug.flow.inspect": (
            "DEQUANTIZE_OPS",
            "QUANTIZE_OPS",
            "calibrated_report",
            "encodings",
            "example_inputs",
            "prepared_state",
        ),
        "_quantplug.graph.working_copy": ("working_copy",),
        "_quantplug.graph.mutation": ("writes_in_place",),
        "_quantplug.graph.recurrent": ("RecurrentLayout", "recurrent_layout"),
        "_quantplug.meta": ("kept_meta",),
        # -- lowering --------------------------------------------------------------------------
        "_quantplug.lowering.onnx.export": (
            "compact_node_metadata",
            "export_qdq_onnx",
            "pack_int4_constants",
        ),
        "_quantplug.lowering.onnx.capture": ("to_exported_program",),
        "_quantplug.lowering.onnx.provenance": ("describe",),
    },
)

#: modules a plugin uses as namespaces: ``nonfinite.handle(observer, values)`` in its observers
_MODULES = {"nonfinite": "_quantplug.observers.nonfinite"}

__all__ = [*_lazy.install(__name__, _DECLARATION, modules=_MODULES), *_MODULES]
