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
from quantplug import backend as _backend

__version__ = "0.2.0"

#: private module -> the public names it defines: its own, then those it shares with
#: ``quantplug.backend``, which declares them (the plugin vocabulary, here since 0.1.0, the errors
#: plugins raise, ``Artifact``, and ``PLUGIN_API_VERSION``: the version of the plugin contract this
#: release provides, which a backend can require with ``BackendInfo(requires_api=...)``)
_DECLARATION: dict[str, tuple[str, ...]] = _lazy.merged(
    {
        "_quantplug.api": ("get_quantizer", "quantize"),
        "_quantplug.flow.prepare": ("prepare",),
        "_quantplug.flow.convert": ("convert",),
        "_quantplug.lowering.lower": ("lower",),
        "_quantplug.archive": ("load_program",),
        "_quantplug.algorithms.config": ("Algorithms",),
        "_quantplug.algorithms.registry": (
            "AlgorithmEntry",
            "list_algorithms",
            "register_algorithm",
            "unregister_algorithm",
        ),
        "_quantplug.algorithms.option_checks": ("AlgorithmOption",),
        "_quantplug.algorithms.spec": (
            "Algorithm",
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
            "BackendDisabledError",
            "BackendLoadError",
            "CollectorMergeError",
            "DistributedError",
            "DuplicateBackendError",
            "UnknownAlgorithmError",
            "UnknownBackendError",
            "UnsafeArchiveError",
        ),
    },
    _backend._SHARED,
)

#: modules reachable as attributes: the public ones, and (deprecated) the 0.1.0 subpackages
_MODULES = {
    "backend": "quantplug.backend",
    "debug": "quantplug.debug",
    "distributed": "quantplug.distributed",
    "conformance": "quantplug.conformance",
    **{name: f"quantplug.{name}" for name in ("algorithms", "report", "cli", "demo", "observers", "flow")},
}

_deprecated.install()
__all__ = _lazy.install(__name__, _DECLARATION, modules=_MODULES)
