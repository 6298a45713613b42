"""What every check works with: the backend under test (:class:`Session`), the outcomes
(:class:`Failed`, :class:`Skipped`), a check's description (:class:`Check`) and the built-in
end-to-end model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

import quantplug
from _quantplug.conformance.checks.base import Check as Check  # the checks read them here
from _quantplug.conformance.checks.base import Failed as Failed
from _quantplug.conformance.checks.base import Skipped as Skipped
from _quantplug.conformance.profile import ConformanceProfile
from _quantplug.conformance.samples import Sample, module_sample, sample_for
from _quantplug.plugins.registry import BackendEntry, list_backends, load_backend
from _quantplug.quantizer.quantizer import Quantizer

CALIBRATION_BATCHES = 4
#: seconds a fresh interpreter may take to import and load the backend
FRESH_TIMEOUT_S = 300


@dataclass
class Session:
    """A backend under test. ``options`` are applied to every quantizer the kit builds."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    _profile: ConformanceProfile | None = None
    _programs: dict[str, Any] = field(default_factory=dict)
    _fresh: dict[str, Any] | Failed | None = None

    def quantizer(self, extra: Mapping[str, Any] | None = None, **more: Any) -> Quantizer:
        return quantplug.get_quantizer(self.name, **{**self.options, **(extra or {}), **more})

    @property
    def entry(self) -> BackendEntry | None:
        return next((e for e in list_backends() if e.name == self.name), None)

    @property
    def profile(self) -> ConformanceProfile:
        if self._profile is None:
            q = self.quantizer()
            found = load_backend(self.name).hook.quantplug_conformance_profile(context=q.context)
            if found is not None and not isinstance(found, ConformanceProfile):
                raise Failed(
                    f"quantplug_conformance_profile returned {type(found).__name__}, not a ConformanceProfile"
                )
            self._profile = found or ConformanceProfile()
        return self._profile

    def as_installed(self) -> dict[str, Any]:
        """What a fresh interpreter sees of the backend as installed (:data:`FRESH_PROBE`), for
        ``listed`` and ``untouched``: one interpreter for both, as each start imports torch and
        the plugin (seconds). A failure to load is the answer of both checks."""
        if self._fresh is None:
            try:
                self._fresh = dict(in_fresh_interpreter(FRESH_PROBE, self.name))
            except Failed as exc:
                self._fresh = exc
        if isinstance(self._fresh, Failed):
            raise Failed(str(self._fresh))
        return self._fresh

    def option_sets(self) -> list[dict[str, Any]]:
        return [dict(o) for o in self.profile.option_sets]

    def claimed_ops(self) -> list[str]:
        return sorted(self.quantizer().rules.ops)

    def sample(self, op: str) -> Sample | None:
        return sample_for(op, self.profile.samples)

    def program(self, sample: Sample) -> Any:
        """What ``prepare`` receives: the built graph, or the exported module (cached)."""
        if sample.example is None:
            return sample.model
        found = self._programs.get(sample.op)
        if found is None:
            found = self._programs[sample.op] = torch.export.export(sample.model, sample.example)
        return found

    def e2e_factory(self) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
        if self.profile.model is not None:
            return self.profile.model
        claimed = set(self.claimed_ops())
        if not claimed & E2E_OPS:
            raise Failed(
                "the built-in end-to-end model uses none of the ops this backend claims "
                f"({', '.join(sorted(E2E_OPS))}); give ConformanceProfile.model"
            )
        return kit_model


def in_fresh_interpreter(script: str, *args: str) -> Any:
    """What ``script`` (run by ``python -c`` in this environment) prints last, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Failed(f"a fresh interpreter could not load it: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#: in a fresh interpreter, the backend named by argv[1] as installed: listed without importing
#: it? What get_quantizer() imports (rules modules, other backends), and the process-wide state
#: it changes (``process_state``, read after listing and before get_quantizer imports the plugin)
FRESH_PROBE = """
import json, sys
import quantplug
from importlib import metadata
name = sys.argv[1]
base = set(sys.modules)
entries = {e.name: e for e in quantplug.list_backends()}
listed = set(sys.modules) - base
entry = entries.get(name)
top = entry.module.split(".")[0] if entry else None
imported_by_listing = sorted(m for m in listed if top and (m == top or m.startswith(top + ".")))
others = {e.module for e in entries.values() if e.name != name and e.source == "entry-point"}
extensions = metadata.entry_points(group="quantplug.extensions")
others |= {ep.value for ep in extensions if ep.name not in (name, "*")}
from _quantplug.conformance import process_state
state = process_state.snapshot()
before = set(sys.modules)
q = quantplug.get_quantizer(name)
new = set(sys.modules) - before
print(json.dumps({
    "listed": entry is not None,
    "imported_by_listing": imported_by_listing,
    "rules_imported": sorted(m.module for m in q.rules.modules if m.module in new),
    "others_imported": sorted(m for m in others if m in new),
    "state_changed": process_state.changes(state, process_state.snapshot()),
}))
"""


def case_options(session: Session, case: str) -> tuple[str, dict[str, Any]]:
    """A per-op case id is ``op`` or ``op @ k=v,...`` (one per option set beyond the first)."""
    op, _, opts = case.partition(" @ ")
    sets = session.option_sets()
    if not opts:
        return op, sets[0]
    for s in sets:
        if options_label(s) == opts:
            return op, s
    raise Failed(f"unknown option set {opts!r}")


def options_label(options: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "defaults"


E2E_OPS = frozenset({"aten.conv2d.default", "aten.linear.default", "aten.relu.default", "aten.add.Tensor"})


class KitNet(nn.Module):
    """conv + relu, a second conv, add, flatten, two linears (one + relu), concat."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(64, 8)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(img)) + self.conv2(img)
        y = torch.flatten(y, 1)
        return torch.cat([self.fc(y), torch.relu(self.fc2(y))], dim=1)


def kit_model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    with torch.random.fork_rng(devices=[]):  # the same weights every time, the caller's RNG untouched
        torch.manual_seed(0)
        model = KitNet().eval()
    return model, (torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)),)


@dataclass
class E2ERun:
    """One pass of the whole flow on the end-to-end model."""

    model: nn.Module
    program: torch.export.ExportedProgram
    quantizer: Quantizer
    prepared: GraphModule
    converted: GraphModule
    batch: tuple[torch.Tensor, ...]
    artifact: Any = None


def run_e2e(session: Session, quantizer: Quantizer | None = None, *, lower: bool = True) -> E2ERun:
    model, example = session.e2e_factory()()
    sample = module_sample("model", lambda: (model, example))
    program = torch.export.export(model, tuple(example))
    q = quantizer or session.quantizer(session.option_sets()[0])
    prepared = quantplug.prepare(program, q)
    with torch.no_grad():
        for seed in range(CALIBRATION_BATCHES):
            prepared(*sample.batch(seed))
    converted = quantplug.convert(prepared)
    artifact = quantplug.lower(converted, q) if lower and has_writer(q) else None
    return E2ERun(model, program, q, prepared, converted, sample.batch(0), artifact)


def has_writer(q: Quantizer) -> bool:
    return q.lowering_plan().writer is not None
