"""What a backend declares to the conformance kit: capabilities it lacks, and what it promises.

Two ideas from established compliance suites:

* SQLAlchemy's dialect suite asks each dialect for a ``Requirements`` object whose properties
  open or close groups of tests. Here a backend lists the capabilities it does *not* have in
  :attr:`ConformanceProfile.unsupported`, each with a reason; the checks that need one are then
  reported as skipped with that reason, never as failures.
* ONNX's backend test suite runs one small graph per operator, compares with a reference within
  a stated tolerance, and lets a backend exclude tests by name. Here every op a backend's rules
  claim runs on a sample graph and must stay above an SQNR floor (per op where needed); ops the
  kit cannot sample are excluded by name with a reason (:attr:`ConformanceProfile.skip_ops`) or
  given a sample (:attr:`ConformanceProfile.samples`).

A backend returns its profile from the ``quantplug_conformance_profile`` hook; without one the
kit uses the defaults below (every capability expected, the files its artifact lists).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: a sample: a function returning ``(model, example_inputs)`` (``model`` an ``nn.Module`` in eval
#: mode, ``example_inputs`` a tuple of tensors); called with no arguments
SampleFactory = Callable[[], tuple[Any, tuple[Any, ...]]]

#: capability -> what the checks that need it verify
CAPABILITIES: dict[str, str] = {
    "lowering": "lower() and Artifact.save() write the files the backend declares",
    "integer_weights": "convert() stores the weights of weighted ops as integer tensors",
    "constraints": "quantplug_op_constraints constrains the ops the rules claim, so validation can "
    "report a config the hardware cannot run",
}

DEFAULT_SQNR_FLOOR_DB = 20.0


@dataclass(frozen=True)
class ConformanceProfile:
    """A backend's declaration to the conformance kit.

    Attributes:
        unsupported: capability name (see :data:`CAPABILITIES`) -> why the backend lacks it.
            The checks needing it are skipped with that reason.
        sqnr_floor_db: the least signal-to-quantization-noise ratio (dB) a sample's quantized
            output must reach against its float output.
        op_sqnr_floor_db: per-op floors where the default does not fit (an op whose output
            range is dominated by a few values, say).
        skip_ops: claimed op -> why it is not sampled (a custom op whose sample the vendor
            tests elsewhere). Every other claimed op needs a sample: built in, or in ``samples``.
        samples: op name -> factory of a small model whose exported graph contains that op;
            overrides the built-in sample of the same op.
        artifact_files: file names (glob patterns allowed) that ``Artifact.save`` must write,
            besides ``artifact.json``. Empty: the names the artifact itself lists.
        option_sets: the option sets the op and end-to-end checks run under (default: the
            backend's defaults). Option checks always cover every declared option.
        model: the end-to-end model (default: a small built-in model made of claimed ops).
    """

    unsupported: Mapping[str, str] = field(default_factory=dict)
    sqnr_floor_db: float = DEFAULT_SQNR_FLOOR_DB
    op_sqnr_floor_db: Mapping[str, float] = field(default_factory=dict)
    skip_ops: Mapping[str, str] = field(default_factory=dict)
    samples: Mapping[str, SampleFactory] = field(default_factory=dict)
    artifact_files: tuple[str, ...] = ()
    option_sets: tuple[Mapping[str, Any], ...] = ({},)
    model: SampleFactory | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.unsupported) - set(CAPABILITIES))
        if unknown:
            raise ValueError(
                f"ConformanceProfile.unsupported names unknown capabilities {unknown}; "
                f"known: {', '.join(sorted(CAPABILITIES))}"
            )
        if not self.option_sets:
            raise ValueError("ConformanceProfile.option_sets needs at least one option set ({} = defaults)")
        object.__setattr__(self, "artifact_files", tuple(self.artifact_files))
        object.__setattr__(self, "option_sets", tuple(dict(o) for o in self.option_sets))

    def supports(self, capability: str) -> bool:
        return capability not in self.unsupported

    def sqnr_floor(self, op: str) -> float:
        return float(self.op_sqnr_floor_db.get(op, self.sqnr_floor_db))
