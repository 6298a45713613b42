"""The checks of the conformance kit: what a user of any backend relies on.

Each check is a function of a :class:`Session` (one backend, its options and profile) and a case
(an op for the per-op checks, ``""`` otherwise). It returns a message on success and raises
:class:`Failed` or :class:`Skipped` otherwise, so the command line, the pytest plugin and tests
run exactly the same code. Checks needing a capability the backend declares unsupported are
skipped with the backend's reason.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import re
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

import quantplug
from quantplug.annotation.spec_view import SpecKind, spec_kind, spec_range
from quantplug.annotation.specs import Q_ANNOTATION_KEY, QuantizationConfig, QuantizationSpec
from quantplug.conformance.profile import ConformanceProfile
from quantplug.conformance.samples import Sample, module_sample, sample_for
from quantplug.errors import ConstraintViolationError, OptionError, QuantplugError
from quantplug.flow.inspect import DEQUANTIZE_OPS, encodings
from quantplug.flow.prepare import STATE_KEY, PreparedState
from quantplug.plugins.contract import op_name
from quantplug.plugins.registry import BackendEntry, list_backends, load_backend
from quantplug.quantizer.quantizer import FLOAT_REASON_KEY, RULE_KEY, Quantizer
from quantplug.validation.constraints import OUTPUT

CALIBRATION_BATCHES = 4


class Failed(Exception):
    """The backend does not do what the check verifies; the message says what and where."""


class Skipped(Exception):
    """The check does not apply (a capability the backend declares unsupported, say)."""


@dataclass(frozen=True)
class Check:
    """One check: its name, what it verifies, the capabilities it needs, how to run a case."""

    name: str
    title: str
    run: Callable[[Session, str], str]
    requires: tuple[str, ...] = ()
    cases: Callable[[Session], list[str]] | None = None

    def case_ids(self, session: Session) -> list[str]:
        return self.cases(session) if self.cases is not None else [""]


# ------------------------------------------------------------------------------------------------
# the session: one backend, its options and profile, shared caches
# ------------------------------------------------------------------------------------------------


@dataclass
class Session:
    """A backend under test. ``options`` are applied to every quantizer the kit builds."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    _profile: ConformanceProfile | None = None
    _programs: dict[str, Any] = field(default_factory=dict)

    def quantizer(self, extra: Mapping[str, Any] | None = None, **more: Any) -> Quantizer:
        return quantplug.get_quantizer(self.name, **{**self.options, **(extra or {}), **more})

    @property
    def entry(self) -> BackendEntry | None:
        return next((e for e in list_backends() if e.name == self.name), None)

    @property
    def profile(self) -> ConformanceProfile:
        if self._profile is None:
            q = self.quantizer()
            found = q._backend.hook.quantplug_conformance_profile(context=q.context)
            if found is not None and not isinstance(found, ConformanceProfile):
                raise Failed(
                    f"quantplug_conformance_profile returned {type(found).__name__}, not a ConformanceProfile"
                )
            self._profile = found or ConformanceProfile()
        return self._profile

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


def _case_options(session: Session, case: str) -> tuple[str, dict[str, Any]]:
    """A per-op case id is ``op`` or ``op @ k=v,...`` (one per option set beyond the first)."""
    op, _, opts = case.partition(" @ ")
    sets = session.option_sets()
    if not opts:
        return op, sets[0]
    for s in sets:
        if _options_label(s) == opts:
            return op, s
    raise Failed(f"unknown option set {opts!r}")


def _options_label(options: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "defaults"


# ------------------------------------------------------------------------------------------------
# the built-in end-to-end model
# ------------------------------------------------------------------------------------------------

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
    artifact = quantplug.lower(converted, q) if lower and _has_writer(q) else None
    return E2ERun(model, program, q, prepared, converted, sample.batch(0), artifact)


def _has_writer(q: Quantizer) -> bool:
    return q.lowering_plan().writer is not None


# ------------------------------------------------------------------------------------------------
# listed without import
# ------------------------------------------------------------------------------------------------


def check_listed(session: Session, case: str) -> str:
    entry = session.entry
    if entry is None:
        raise Failed(f"list_backends() does not list {session.name!r}")
    if entry.status in ("error", "conflict", "disabled"):
        raise Failed(
            f"list_backends() shows {session.name!r} with status {entry.status!r}: {entry.error or ''}"
        )
    if entry.source == "entry-point":
        found = _probe(session.name)
        problems = []
        if not found["listed"]:
            problems.append("not listed in a fresh interpreter")
        if found["imported_by_listing"]:
            problems.append("list_backends() imported " + ", ".join(found["imported_by_listing"]))
        if found["rules_imported"]:
            problems.append("get_quantizer() imported rules modules " + ", ".join(found["rules_imported"]))
        if found["others_imported"]:
            problems.append(
                "get_quantizer() imported modules of other backends " + ", ".join(found["others_imported"])
            )
        if not entry.version:
            problems.append(f"distribution {entry.distribution!r} has no version")
        if problems:
            raise Failed("; ".join(problems))
        return (
            f"listed from {entry.distribution} {entry.version} without importing it; get_quantizer() imports "
            "no rules module and nothing of other backends"
        )
    # in-process: listing imports nothing by construction; rules must still load lazily
    rules = [m.module for m in session.quantizer().rules.modules]
    saved = {m: sys.modules.pop(m) for m in rules if m in sys.modules}
    try:
        session.quantizer()
        eager = [m for m in rules if m in sys.modules]
    finally:
        for m in rules:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
    if eager:
        raise Failed(
            "get_quantizer() imported rules modules " + ", ".join(eager) + " (import them only in rules)"
        )
    return "listed (in-process); get_quantizer() imports no rules module"


PROBE = """
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
before = set(sys.modules)
q = quantplug.get_quantizer(name)
new = set(sys.modules) - before
print(json.dumps({
    "listed": entry is not None,
    "imported_by_listing": imported_by_listing,
    "rules_imported": sorted(m.module for m in q.rules.modules if m.module in new),
    "others_imported": sorted(m for m in others if m in new),
}))
"""


def _probe(name: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, name], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Failed(f"a fresh interpreter could not load it: {tail}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------------
# options validated with typed errors
# ------------------------------------------------------------------------------------------------

_OPTION_TYPES = (bool, int, float, str)


def check_options(session: Session, case: str) -> str:
    info = load_backend(session.name).info
    problems: list[str] = []
    tried = 0

    def attempt(options: dict[str, Any], *, expect_error: bool, what: str) -> Quantizer | None:
        nonlocal tried
        tried += 1
        try:
            q = quantplug.get_quantizer(session.name, **options)
        except OptionError as exc:
            if not expect_error:
                problems.append(f"{what}: rejected ({exc})")
            return None
        except Exception as exc:
            problems.append(f"{what}: raised {type(exc).__name__} ({exc}) instead of OptionError")
            return None
        if expect_error:
            problems.append(f"{what}: accepted, expected an OptionError")
        return q

    for o in info.options:
        if o.type not in _OPTION_TYPES:
            problems.append(f"option {o.name!r}: type {o.type!r} is not bool, int, float or str")
            continue
        if o.default is not None and not _is_type(o.default, o.type):
            problems.append(f"option {o.name!r}: default {o.default!r} is not a {o.type.__name__}")
        if o.choices is not None and o.default is not None and o.default not in o.choices:
            problems.append(f"option {o.name!r}: default {o.default!r} is not one of its choices")
    if info.preset_option is not None:
        preset = info.option(info.preset_option)
        if preset is None:
            problems.append(f"preset_option {info.preset_option!r} is not a declared option")
        elif preset.default is not None and preset.default not in {p.name for p in info.presets}:
            problems.append(f"the default {info.preset_option} {preset.default!r} is not a preset")
    attempt({}, expect_error=False, what="the defaults")
    unknown = "conformance_no_such_option"
    attempt({unknown: 1}, expect_error=True, what=f"an unknown option {unknown!r}")
    for o in info.options:
        if o.type not in _OPTION_TYPES:
            continue
        if o.type is not str:
            attempt(
                {o.name: f"not-a-{o.type.__name__}"},
                expect_error=True,
                what=f"{o.name}='not-a-{o.type.__name__}'",
            )
        elif o.choices is not None:
            attempt(
                {o.name: "conformance-not-a-choice"}, expect_error=True, what=f"{o.name} outside its choices"
            )
        values = list(o.choices) if o.choices is not None else ([True, False] if o.type is bool else [])
        for value in values:
            q = attempt({o.name: value}, expect_error=False, what=f"{o.name}={value!r}")
            if q is not None and q.options[o.name] != value:
                problems.append(f"{o.name}={value!r} resolved to {q.options[o.name]!r}")
            if o.type is not str:
                text = str(value).lower() if isinstance(value, bool) else str(value)
                q = attempt({o.name: text}, expect_error=False, what=f"{o.name}={text!r} (text)")
                if q is not None and q.options[o.name] != value:
                    problems.append(f"{o.name}={text!r} (text) resolved to {q.options[o.name]!r}")
    q = attempt({"strict": "false"}, expect_error=False, what="strict='false'")
    if q is not None and q.context.options.get("strict") is not False:
        problems.append("strict='false' is not visible as context.options['strict'] == False")
    attempt({"strict": "maybe"}, expect_error=True, what="strict='maybe'")
    if problems:
        raise Failed(f"{len(problems)} problem(s): " + "; ".join(problems))
    return (
        f"{len(info.options)} option(s): defaults, types, choices and text forms ({tried} quantizers built)"
    )


def _is_type(value: Any, typ: type) -> bool:
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


# ------------------------------------------------------------------------------------------------
# every claimed op: annotated on a real graph, within the SQNR floor
# ------------------------------------------------------------------------------------------------


def op_cases(session: Session) -> list[str]:
    sets = session.option_sets()
    ops = session.claimed_ops()
    cases = list(ops)
    for extra in sets[1:]:
        cases.extend(f"{op} @ {_options_label(extra)}" for op in ops)
    return cases


def _keys_of(node: Node) -> list[Any]:
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return []
    keys: list[Any] = [(a.name, node.name) for a, s in ann.input_qspec_map.items() if s is not None]
    if ann.output_qspec is not None:
        keys.append(node.name)
    return keys


def _has_float_tensor(node: Node) -> bool:
    def is_float(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.is_floating_point()

    values = [a.meta.get("val") for a in node.all_input_nodes]
    out = node.meta.get("val")
    values.extend(out if isinstance(out, (tuple, list)) else [out])
    return any(is_float(v) for v in values)


def _float_outputs(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result] if result.is_floating_point() else []
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _float_outputs(r)]
    if isinstance(result, dict):
        return [t for r in result.values() for t in _float_outputs(r)]
    return []


def sqnr_db(reference: list[torch.Tensor], quantized: list[torch.Tensor]) -> float:
    """Signal-to-quantization-noise ratio of all float outputs together (dB; inf when exact)."""
    if len(reference) != len(quantized):
        raise Failed(f"{len(quantized)} float outputs, the float program has {len(reference)}")
    signal = noise = 0.0
    for r, q in zip(reference, quantized):
        if r.shape != q.shape:
            raise Failed(f"output shape {tuple(q.shape)}, the float program gives {tuple(r.shape)}")
        r64, q64 = r.detach().double(), q.detach().double()
        finite = torch.isfinite(r64)
        if not torch.equal(torch.isfinite(q64), finite):
            raise Failed("the quantized program gives non-finite values where the float one does not")
        signal += float((r64[finite] ** 2).sum())
        noise += float(((r64[finite] - q64[finite]) ** 2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def check_op(session: Session, case: str) -> str:
    op, options = _case_options(session, case)
    reason = session.profile.skip_ops.get(op)
    if reason is not None:
        raise Skipped(f"excluded by the backend: {reason}")
    sample = session.sample(op)
    if sample is None:
        raise Failed(
            "the kit has no sample graph for this op; give one in ConformanceProfile.samples, "
            "or exclude it with a reason in ConformanceProfile.skip_ops"
        )
    q = session.quantizer(options)
    try:
        prepared = quantplug.prepare(session.program(sample), q)
    except ConstraintViolationError as exc:
        raise Failed(
            f"the default config breaks the backend's own constraints: {exc.report.format().strip()}"
        ) from exc
    state: PreparedState = prepared.meta[STATE_KEY]
    nodes = [n for n in prepared.graph.nodes if n.op == "call_function" and op_name(n.target) == op]
    if not nodes:
        return "rewritten by the backend's passes before annotation (no node left to annotate)"
    float_nodes = [
        n for n in nodes if _has_float_tensor(n) and not any(k in state.group_of for k in _keys_of(n))
    ]
    if float_nodes:
        why = "; ".join(
            f"{n.name}: {n.meta.get(FLOAT_REASON_KEY) or 'its encodings were dropped by observer sharing'}"
            for n in float_nodes
        )
        raise Failed(f"claimed but left float on its sample graph ({why})")
    if not any(_has_float_tensor(n) for n in nodes):
        return "annotated (no float tensor to quantize)"
    with torch.no_grad():
        for seed in range(CALIBRATION_BATCHES):
            prepared(*sample.batch(seed))
        converted = quantplug.convert(prepared)
        if sample.random:
            converted(*sample.batch(0))
            return "annotated and converted (a random op: outputs not compared)"
        expected = _float_outputs(sample.model(*sample.batch(0)))
        got = _float_outputs(converted(*sample.batch(0)))
    sqnr = sqnr_db(expected, got)
    floor = session.profile.sqnr_floor(op)
    if sqnr < floor:
        raise Failed(f"SQNR {sqnr:.1f} dB is below the floor of {floor:.1f} dB")
    return f"annotated; SQNR {sqnr:.1f} dB (floor {floor:.1f})"


# ------------------------------------------------------------------------------------------------
# sharing groups valid
# ------------------------------------------------------------------------------------------------


def sharing_problems(prepared: GraphModule) -> list[str]:
    """What is wrong with a prepared model's observer groups (empty: they are consistent)."""
    state: PreparedState = prepared.meta[STATE_KEY]
    nodes = {n.name: n for n in prepared.graph.nodes}
    specs: dict[Any, Any] = {}
    for node in prepared.graph.nodes:
        ann = node.meta.get(Q_ANNOTATION_KEY)
        if ann is None:
            continue
        for arg, spec in ann.input_qspec_map.items():
            if spec is not None:
                specs[(arg.name, node.name)] = spec
        if ann.output_qspec is not None:
            specs[node.name] = ann.output_qspec
    problems: list[str] = []
    members: dict[int, list[Any]] = {}
    for key, gid in state.group_of.items():
        if key not in specs:
            problems.append(f"{_key(key)} is in group {gid} but has no quantization spec")
        members.setdefault(gid, []).append(key)
    if sorted(members) != list(range(len(state.groups))):
        problems.append(f"group ids {sorted(members)} do not match the {len(state.groups)} groups")

    def concrete(spec: Any, seen: int = 0) -> Any:
        while spec is not None and spec_kind(spec) is SpecKind.SHARED and seen < 1000:
            t = spec.edge_or_node
            spec = specs.get((t[0].name, t[1].name) if isinstance(t, tuple) else t.name)
            seen += 1
        return spec

    for gid, keys in members.items():
        grids = {}
        fixed = set()
        derived = set()
        for key in keys:
            spec = concrete(specs.get(key))
            if spec is None:
                continue
            kind = spec_kind(spec)
            grids[key] = (
                str(spec.dtype),
                spec_range(spec),
                getattr(spec, "qscheme", None) in (torch.per_channel_affine, torch.per_channel_symmetric),
                getattr(spec, "ch_axis", None),
                getattr(spec, "block_size", None),
                bool(getattr(spec, "is_dynamic", False)),
            )
            if kind is SpecKind.FIXED:
                fixed.add((float(spec.scale), int(spec.zero_point)))
            if kind is SpecKind.DERIVED:
                derived.add(id(spec))
        if len(set(grids.values())) > 1:
            shown = sorted({f"{g[0]}[{g[1][0]},{g[1][1]}]" for g in grids.values()})
            problems.append(
                f"group {gid} mixes different grids: {', '.join(shown)} ({', '.join(map(_key, keys[:4]))})"
            )
        if len(fixed) > 1:
            problems.append(f"group {gid} holds different fixed encodings {sorted(fixed)}")
        if derived and len(derived) + len(fixed) > 1:
            problems.append(f"group {gid} mixes a derived spec with other encodings")
    for key, spec in specs.items():
        if key not in state.group_of:
            continue  # dropped by the backend's sharing: float
        if spec_kind(spec) is SpecKind.SHARED:
            t = spec.edge_or_node
            target = (t[0].name, t[1].name) if isinstance(t, tuple) else t.name
            if target in state.group_of and state.group_of[target] != state.group_of[key]:
                problems.append(f"{_key(key)} shares {_key(target)}'s encoding but is in another group")
        if spec_kind(spec) is SpecKind.DERIVED:
            for source in spec.derived_from:
                s = (source[0].name, source[1].name) if isinstance(source, tuple) else source.name
                if s not in state.group_of:
                    problems.append(f"{_key(key)} derives from {_key(s)}, which has no group")
    observed = {
        int(str(n.target).rsplit(".g", 1)[1])
        for n in nodes.values()
        if n.op == "call_module" and ".g" in str(n.target)
    }
    for group in state.groups:
        if not group.constant and group.gid not in observed:
            problems.append(f"group {group.gid} ({group.describe()}) has no observer in the graph")
    return problems


def _key(key: Any) -> str:
    return f"input {key[0]!r} of {key[1]!r}" if isinstance(key, tuple) else f"output of {key!r}"


def check_sharing(session: Session, case: str) -> str:
    q = session.quantizer(session.option_sets()[0])
    problems: list[str] = []
    checked = 0
    run = run_e2e(session, q, lower=False)
    for p in sharing_problems(run.prepared):
        problems.append(f"end-to-end model: {p}")
    checked += 1
    for op in session.claimed_ops():
        sample = session.sample(op)
        if sample is None or op in session.profile.skip_ops:
            continue
        try:
            prepared = quantplug.prepare(session.program(sample), q)
        except QuantplugError:
            continue  # reported by the op's own check
        checked += 1
        problems.extend(f"{op}: {p}" for p in sharing_problems(prepared))
    if problems:
        raise Failed(f"{len(problems)} inconsistent group(s): " + "; ".join(problems[:10]))
    return f"observer groups consistent on {checked} prepared graphs (one grid per group)"


# ------------------------------------------------------------------------------------------------
# validation reports violations
# ------------------------------------------------------------------------------------------------

#: grids tried, in order, to break an activation port's ``dtypes`` (int32 and int4 are valid
#: grids that activation ports rarely allow)
_GRIDS = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, getattr(torch, "int4"))  # noqa: B009


def _violating_config(
    constraints: list[Any], config: QuantizationConfig, ports: set[Any]
) -> tuple[QuantizationConfig, str] | None:
    """A config breaking a constraint on one of ``ports`` (input 0 and/or the output, those the
    node's default annotation quantizes) through the activation specs."""
    for c in constraints:
        for port, pc in c.ports.items():
            if port not in ports:
                continue
            where = "output" if port == OUTPUT else "input 0"
            spec: QuantizationSpec | None = None
            what = ""
            bad = next((d for d in _GRIDS if d not in pc.dtypes), None) if pc.dtypes is not None else None
            if bad is not None:
                spec = QuantizationSpec(dtype=bad, qscheme=torch.per_tensor_affine)
                what = f"{where} dtype {str(bad).removeprefix('torch.')}"
            elif pc.symmetric is not None:
                dtype = sorted(pc.dtypes, key=str)[0] if pc.dtypes else torch.int8
                scheme = torch.per_tensor_affine if pc.symmetric else torch.per_tensor_symmetric
                spec = QuantizationSpec(dtype=dtype, qscheme=scheme)
                what = f"{where} qscheme {str(scheme).removeprefix('torch.')}"
            if spec is None:
                continue
            try:
                bad_config = dataclasses.replace(config, input_activation=spec, output_activation=spec)
            except TypeError:
                bad_config = QuantizationConfig(spec, spec, config.weight, config.bias)
            return bad_config, what
    return None


@contextmanager
def _captured(logger: str) -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger(logger)
    saved = (log.handlers[:], log.level, log.propagate)
    log.handlers[:] = [Handler(logging.WARNING)]  # the kit provokes these: keep them off the console
    log.propagate = False
    log.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]


def check_validation(session: Session, case: str) -> str:
    options = session.option_sets()[0]
    q = session.quantizer(options)
    constrained = []
    for op in session.claimed_ops():
        sample = session.sample(op)
        if sample is None or op in session.profile.skip_ops:
            continue
        gm = q.transform_for_annotation(_copy(session.program(sample)))
        q.annotate(gm)
        for node in gm.graph.nodes:
            rule = node.meta.get(RULE_KEY)
            if node.op != "call_function" or rule is None or op_name(node.target) != op:
                continue
            constraints = q.constraints(op, rule.backend_op)
            config = q.config_for(node)
            if not constraints or config is None:
                continue
            constrained.append(op)
            found = _violating_config(constraints, config, _activation_ports(node))
            if found is None:
                continue
            bad_config, what = found
            strict = session.quantizer(options).set_node_name(node.name, bad_config)
            try:
                quantplug.prepare(session.program(sample), strict)
            except ConstraintViolationError as exc:
                named = [v for v in exc.report.violations if v.node == node.name]
                if not named:
                    raise Failed(f"{op}: the violation report names other nodes, not {node.name!r}") from exc
            except QuantplugError as exc:
                raise Failed(
                    f"{op} with {what}: {type(exc).__name__} instead of ConstraintViolationError: {exc}"
                ) from exc
            else:
                raise Failed(
                    f"{op} with {what} breaks the backend's constraint, yet strict prepare() accepted it"
                )
            lenient = session.quantizer(options, strict=False).set_node_name(node.name, bad_config)
            with _captured("quantplug.validation") as records:
                prepared = quantplug.prepare(session.program(sample), lenient)
            report = prepared.meta[STATE_KEY].validation
            if report is None or report.ok:
                raise Failed(
                    f"{op} with {what}: strict=False kept no violation in the prepared model's report"
                )
            if not any(node.name in r.getMessage() for r in records):
                raise Failed(f"{op} with {what}: strict=False logged no warning naming {node.name!r}")
            return (
                f"{op} with {what}: strict prepare raised ConstraintViolationError naming {node.name!r}; "
                "strict=False warned and kept the report"
            )
    if not constrained:
        raise Failed(
            "quantplug_op_constraints returns no constraint for any op the rules claim (check the "
            "rules' backend_op names); declare constraints, or the capability 'constraints' as unsupported"
        )
    raise Skipped(
        f"{len(set(constrained))} constrained op(s), but no dtype or symmetry restriction on an activation "
        "port that a config could break"
    )


def _activation_ports(node: Node) -> set[Any]:
    """Which of input 0 and the output the node's annotation quantizes."""
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return set()
    ports: set[Any] = set()
    first = next((a for a in node.all_input_nodes), None)
    if first is not None and ann.input_qspec_map.get(first) is not None:
        ports.add(0)
    if ann.output_qspec is not None:
        ports.add(OUTPUT)
    return ports


def _copy(program: Any) -> GraphModule:
    from quantplug.flow.graph_copy import working_copy

    return working_copy(program)


# ------------------------------------------------------------------------------------------------
# prepare leaves the caller's program untouched
# ------------------------------------------------------------------------------------------------


def _snapshot(model: nn.Module, program: torch.export.ExportedProgram) -> dict[str, Any]:
    return {
        "code": program.graph_module.code,
        "nodes": [(n.name, str(n.target), sorted(n.meta)) for n in program.graph.nodes],
        "state": {k: (id(v), v.detach().clone()) for k, v in program.state_dict.items()},
        "constants": {
            k: (id(v), v.detach().clone())
            for k, v in program.constants.items()
            if isinstance(v, torch.Tensor)
        },
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    if before["code"] != after["code"]:
        found.append("its graph code changed")
    if before["nodes"] != after["nodes"]:
        changed = [a[0] for a, b in zip(after["nodes"], before["nodes"]) if a != b] or ["node list"]
        found.append("node names, targets or metadata changed: " + ", ".join(changed[:5]))
    for group in ("state", "constants"):
        for k, (ident, value) in before[group].items():
            now = after[group].get(k)
            if now is None:
                found.append(f"{group} entry {k!r} disappeared")
            elif now[0] != ident:
                found.append(f"{group} entry {k!r} was replaced")
            elif not torch.equal(now[1], value):
                found.append(f"{group} entry {k!r} was modified in place")
    for k, value in before["model"].items():
        if not torch.equal(after["model"][k], value):
            found.append(f"the model's {k!r} was modified in place")
    return found


def check_untouched(session: Session, case: str) -> str:
    model, example = session.e2e_factory()()
    program = torch.export.export(model, tuple(example))
    before = _snapshot(model, program)
    q = session.quantizer(session.option_sets()[0])
    prepared = quantplug.prepare(program, q)
    sample = module_sample("model", lambda: (model, example))
    with torch.no_grad():
        for seed in range(CALIBRATION_BATCHES):
            prepared(*sample.batch(seed))
    converted = quantplug.convert(prepared)
    if _has_writer(q):
        artifact = quantplug.lower(converted, q)
        with tempfile.TemporaryDirectory() as tmp:
            artifact.save(tmp)
    changes = _changes(before, _snapshot(model, program))
    if changes:
        raise Failed("the caller's program changed: " + "; ".join(changes))
    return "the exported program and the model are unchanged after prepare, calibration, convert and lower"


# ------------------------------------------------------------------------------------------------
# convert gives integer weights
# ------------------------------------------------------------------------------------------------

WEIGHTED = {
    "aten.linear.default": 1,
    "aten.conv1d.default": 1,
    "aten.conv2d.default": 1,
    "aten.conv3d.default": 1,
}


def check_integer_weights(session: Session, case: str) -> str:
    run = run_e2e(session, lower=False)
    coverage = {n.node: n for n in run.quantizer.coverage(run.program).nodes}
    checked: list[str] = []
    problems: list[str] = []
    for node in run.converted.graph.nodes:
        index = WEIGHTED.get(op_name(node.target)) if node.op == "call_function" else None
        if index is None or node.name not in coverage or not coverage[node.name].quantized:
            continue
        weight = node.args[index] if len(node.args) > index else None
        if not (isinstance(weight, Node) and weight.target in DEQUANTIZE_OPS):
            problems.append(f"{node.name}: its weight is not dequantized from a stored integer tensor")
            continue
        stored = weight.args[0]
        value = (
            getattr(run.converted, str(stored.target), None)
            if isinstance(stored, Node) and stored.op == "get_attr"
            else None
        )
        if not isinstance(value, torch.Tensor) or value.is_floating_point():
            problems.append(
                f"{node.name}: its weight is stored as {getattr(value, 'dtype', type(value).__name__)}"
            )
            continue
        checked.append(f"{node.name} ({str(value.dtype).removeprefix('torch.')})")
    if problems:
        raise Failed("; ".join(problems))
    if not checked:
        raise Skipped("the end-to-end model has no weighted op this backend quantizes")
    return "weights stored as integers: " + ", ".join(checked)


# ------------------------------------------------------------------------------------------------
# lower / save produce the declared files
# ------------------------------------------------------------------------------------------------


def check_lowering(session: Session, case: str) -> str:
    problems: list[str] = []
    notes: list[str] = []
    for options in session.option_sets():
        q = session.quantizer(options)
        if not _has_writer(q):
            raise Failed(
                "no artifact writer (hook quantplug_artifact_writer); declare 'lowering' unsupported"
            )
        run = run_e2e(session, q)
        artifact = run.artifact
        declared = session.profile.artifact_files or tuple(artifact.files)
        with tempfile.TemporaryDirectory() as tmp:
            written = artifact.save(tmp)
            names = sorted(str(p.relative_to(tmp)) for p in written)
            root = Path(tmp)
            meta = (
                json.loads((root / "artifact.json").read_text())
                if (root / "artifact.json").is_file()
                else None
            )
            if meta is None or meta.get("backend") != session.name:
                problems.append(
                    f"{_options_label(options)}: artifact.json missing or not naming backend {session.name!r}"
                )
            for pattern in declared:
                matches = [n for n in names if fnmatch(n, pattern)]
                if not matches:
                    problems.append(
                        f"{_options_label(options)}: declared file {pattern!r} not written (wrote {names})"
                    )
                elif all((root / n).stat().st_size == 0 for n in matches):
                    problems.append(f"{_options_label(options)}: declared file {pattern!r} is empty")
            missing = [n for n in artifact.files if not (root / n).is_file()]
            if missing:
                problems.append(
                    f"{_options_label(options)}: files the artifact lists were not saved: {missing}"
                )
            leftovers = [p.name for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")]
            if leftovers:
                problems.append(f"{_options_label(options)}: temporary files left behind: {leftovers}")
        notes.append(f"{_options_label(options)}: {', '.join(names)}")
    if problems:
        raise Failed("; ".join(problems))
    return "saved " + "; ".join(notes)


# ------------------------------------------------------------------------------------------------
# deterministic across two runs
# ------------------------------------------------------------------------------------------------


def _artifact_bytes(artifact: Any) -> dict[str, Any]:
    """Saved file name -> content; a zip archive (torch's ``.pt2``) as its members, without the
    random ``serialization_id`` torch writes into every archive."""
    if artifact is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        artifact.save(tmp)
        files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        return {str(p.relative_to(tmp)): _content(p.read_bytes()) for p in files}


#: in torch archives, what differs between two saves of the same program: a random
#: serialization id, and the memory address of graphs recorded in each node's provenance
_ARCHIVE_NOISE = re.compile(rb'(\\?"graph_id\\?": )\d+')


def _content(data: bytes) -> Any:
    if not data.startswith(b"PK\x03\x04"):
        return data
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return {
                name: _ARCHIVE_NOISE.sub(rb"\1_", archive.read(name))
                for name in archive.namelist()
                if not name.endswith(".data/serialization_id")
            }
    except zipfile.BadZipFile:
        return data


def check_deterministic(session: Session, case: str) -> str:
    runs = []
    for _ in range(2):
        run = run_e2e(session, session.quantizer(session.option_sets()[0]))
        with torch.no_grad():
            out = _float_outputs(run.converted(*run.batch))
        runs.append(
            (
                json.dumps(encodings(run.converted), sort_keys=True, default=str),
                out,
                _artifact_bytes(run.artifact),
            )
        )
    (enc_a, out_a, files_a), (enc_b, out_b, files_b) = runs
    problems = []
    if enc_a != enc_b:
        problems.append("the encodings differ")
    if len(out_a) != len(out_b) or any(not torch.equal(a, b) for a, b in zip(out_a, out_b)):
        problems.append("the quantized outputs differ")
    if sorted(files_a) != sorted(files_b):
        problems.append(f"the saved file names differ ({sorted(files_a)} vs {sorted(files_b)})")
    else:
        problems.extend(f"saved file {name!r} differs" for name in files_a if files_a[name] != files_b[name])
    if problems:
        raise Failed("two runs of the same flow disagree: " + "; ".join(problems))
    return f"two runs agree bit for bit: encodings, outputs and {len(files_a)} saved file(s)"


# ------------------------------------------------------------------------------------------------
# no model kept alive
# ------------------------------------------------------------------------------------------------


def _flow_refs(session: Session, q: Quantizer) -> dict[str, weakref.ref[Any]]:
    run = run_e2e(session, q)
    refs: dict[str, weakref.ref[Any]] = {
        "the model": weakref.ref(run.model),
        "the exported program": weakref.ref(run.program),
        "the prepared model": weakref.ref(run.prepared),
        "the converted model": weakref.ref(run.converted),
    }
    if run.artifact is not None:
        with tempfile.TemporaryDirectory() as tmp:
            run.artifact.save(tmp)
    return refs


def check_no_leak(session: Session, case: str) -> str:
    q = session.quantizer(session.option_sets()[0])  # the user keeps their quantizer
    refs = _flow_refs(session, q)
    gc.collect()
    alive = {name: r() for name, r in refs.items() if r() is not None}
    if alive:
        held = []
        for name, obj in alive.items():
            owners = sorted(
                {
                    type(o).__name__
                    for o in gc.get_referrers(obj)
                    if o is not refs and not isinstance(o, weakref.ref)
                }
            )
            held.append(f"{name} (referenced by {', '.join(owners[:4]) or 'nothing visible'})")
        del alive
        raise Failed(
            "still alive after the flow and gc.collect(), while the quantizer is kept: " + "; ".join(held)
        )
    return (
        "model, exported program, prepared and converted models are freed; the quantizer keeps none of them"
    )


# ------------------------------------------------------------------------------------------------

CHECKS: tuple[Check, ...] = (
    Check("listed", "listed without importing the plugin; rules load lazily", check_listed),
    Check("options", "options resolved or rejected with OptionError", check_options),
    Check(
        "ops", "every claimed op is annotated on a real graph, above the SQNR floor", check_op, cases=op_cases
    ),
    Check("sharing", "observer groups are consistent", check_sharing),
    Check(
        "validation",
        "a config the hardware cannot run is reported",
        check_validation,
        requires=("constraints",),
    ),
    Check("untouched", "the caller's program and model are never modified", check_untouched),
    Check(
        "integer-weights",
        "convert stores weights as integers",
        check_integer_weights,
        requires=("integer_weights",),
    ),
    Check("lowering", "lower() and save() write the declared files", check_lowering, requires=("lowering",)),
    Check("deterministic", "two runs give identical encodings, outputs and files", check_deterministic),
    Check("no-leak", "no model is kept alive by the backend", check_no_leak),
)


def check_named(name: str) -> Check:
    for check in CHECKS:
        if check.name == name:
            return check
    raise KeyError(f"no conformance check {name!r}; checks: {', '.join(c.name for c in CHECKS)}")
