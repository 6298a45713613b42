"""The plugin contract end to end: discovery, loading, errors, environment, and every hook.

Backends under test come from three places, as in real use:

* in-process plugins (``quantplug.registered_backend``) implementing every hook of
  ``hookspecs.py``;
* throwaway distributions written to ``tmp_path`` (a ``*.dist-info`` folder with ``METADATA`` and
  ``entry_points.txt`` next to the plugin module, the folder put on ``sys.path``), to provoke load
  failures, name conflicts and environment filtering without installing anything;
* the example third-party distribution ``tests/example_plugin`` (``pip install -e
  tests/example_plugin``), found through its real entry points.

Models are real ``torch.export`` programs; nothing of torch is mocked.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

import quantplug
from _quantplug.conformance.profile import ConformanceProfile
from _quantplug.flow.inspect import encodings
from _quantplug.meta import RULE_KEY, STATE_KEY
from _quantplug.plugins import hookspecs, registry
from _quantplug.quantizer.fusion import FusionPattern
from _quantplug.sharing.problem import SharingProblem
from _quantplug.sharing.resolution import SharingGroups
from _quantplug.validation.constraints import OUTPUT
from quantplug import (
    ArchRequirement,
    Artifact,
    BackendContext,
    BackendInfo,
    BackendOption,
    NamedPass,
    OpConstraint,
    PortConstraint,
    Preset,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
    derived_bias_spec,
)

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

HOOK_NAMES = frozenset(n for n in vars(hookspecs) if n.startswith("quantplug_"))


# --------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts and ends with no cached backends and no quantplug environment."""
    monkeypatch.delenv(registry.ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.delenv(registry.ENV_BACKENDS, raising=False)
    registry.reset_cache()
    yield
    registry.reset_cache()


def _uid() -> str:
    return uuid.uuid4().hex[:10]


@dataclass
class FakeSite:
    """A folder on ``sys.path`` holding throwaway plugin modules and ``.dist-info`` metadata."""

    root: Path
    modules: list[str] = field(default_factory=list)

    def module(self, name: str, source: str) -> str:
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        self.modules.append(name)
        return name

    def dist(
        self,
        name: str,
        *,
        backends: dict[str, str] | None = None,
        extensions: dict[str, str] | None = None,
        version: str = "0.1.0",
    ) -> None:
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines: list[str] = []
        for group, entries in ((registry.BACKENDS_GROUP, backends), (registry.EXTENSIONS_GROUP, extensions)):
            if entries:
                lines.append(f"[{group}]")
                lines.extend(f"{k} = {v}" for k, v in entries.items())
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    fake = FakeSite(root)
    registry.reset_cache()
    yield fake
    for name in fake.modules:
        sys.modules.pop(name, None)


#: a minimal working backend module for throwaway distributions ({name} is filled in)
MINIMAL_PLUGIN = """
import quantplug
from quantplug import BackendInfo, BackendOption

@quantplug.hookimpl
def quantplug_backend_info():
    return BackendInfo(name={name!r}, description="throwaway backend",
                       options=(BackendOption("level", int, 1, "a number"),))
"""


def _minimal_plugin(name: str) -> str:
    return MINIMAL_PLUGIN.replace("{name!r}", repr(name))


def _export(model: nn.Module, *inputs: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model.eval(), inputs)


def _names(entries: Sequence[registry.BackendEntry]) -> dict[str, registry.BackendEntry]:
    return {e.name: e for e in entries}


def _run_python(code: str, cwd: Path) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (no quantplug env vars); it prints one JSON line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# an in-process backend implementing every hook, and an extension of it
# --------------------------------------------------------------------------------------------

DENSE_RULES = """
import torch
from quantplug import annotate_weighted, register_annotator

@register_annotator([torch.ops.aten.linear.default], backend_op="Dense")
def annotate_dense(node, config):
    annotate_weighted(node, config)
"""

MISC_RULES = """
import torch
from quantplug import (SharedQuantizationSpec, annotate_binary, annotate_single_in_single_out,
                       is_float_tensor, register_annotator)
from _quantplug.annotation.specs import annotate_node

aten = torch.ops.aten

@register_annotator([aten.relu.default], backend_op="Act")
def annotate_act(node, config, context):   # three parameters: the rule also gets the context
    context.state.setdefault("rule_saw", []).append(node.name)
    annotate_single_in_single_out(node, config)

@register_annotator([aten.add.Tensor], backend_op="Add")
def annotate_add(node, config):
    annotate_binary(node, config)

@register_annotator([aten.cat.default], backend_op="Concat")
def annotate_cat(node, config):
    inputs = [a for a in node.args[0] if is_float_tensor(a)]
    specs = {a: config.input_activation for a in inputs}
    annotate_node(node, specs, SharedQuantizationSpec((inputs[0], node)))
"""

#: an extension's rules module: relu stays float (it claims the op, then leaves it unannotated)
EXT_RULES = """
import torch
from quantplug import register_annotator

@register_annotator([torch.ops.aten.relu.default], backend_op="ExtAct")
def keep_relu_float(node, config):
    pass
"""

CHIPS = {"A1": 1, "A2": 2}


@dataclass(frozen=True)
class ToyRules:
    dense: str
    misc: str
    ext: str


@pytest.fixture
def toy_rules(site: FakeSite) -> ToyRules:
    uid = _uid()
    return ToyRules(
        dense=site.module(f"qp_toy_dense_rules_{uid}", DENSE_RULES),
        misc=site.module(f"qp_toy_misc_rules_{uid}", MISC_RULES),
        ext=site.module(f"qp_toy_ext_rules_{uid}", EXT_RULES),
    )


def toy_config(precision: str, weight_symmetric: bool = True) -> QuantizationConfig:
    act = QuantizationSpec(
        dtype=torch.uint16 if precision == "16a8w" else torch.uint8, qscheme=torch.per_tensor_affine
    )
    weight = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-127,
        quant_max=127,
        qscheme=torch.per_channel_symmetric if weight_symmetric else torch.per_channel_affine,
        ch_axis=0,
    )
    return QuantizationConfig(act, act, weight, bias=lambda n: derived_bias_spec(n, weight_spec=weight))


def mul_by_two_to_add(gm: GraphModule, context: BackendContext) -> GraphModule:
    """``x * 2`` -> ``x + x`` (exact), so the backend's adder runs it."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.mul.Tensor and node.args[1] in (2, 2.0):
            node.target = aten.add.Tensor
            node.args = (node.args[0], node.args[0])
    gm.recompile()
    context.state.setdefault("before", []).append("backend")
    return gm


def unify_cat(problem: SharingProblem, resolve: Callable[[SharingProblem], SharingGroups]) -> SharingGroups:
    assert problem.graph is not None
    merges: list[tuple[Any, Any]] = []
    for node in problem.graph.nodes:
        if node.op == "call_function" and node.target == aten.cat.default:
            edges = [(a.name, node.name) for a in node.args[0] if (a.name, node.name) in problem.specs]
            merges.extend((edges[0], e) for e in edges[1:])
    return resolve(problem.with_merges(merges))


class ToyBackend:
    """Implements every hook of ``hookspecs.py`` and records what the core asked."""

    def __init__(self, rules: ToyRules, name: str = "toy") -> None:
        self.name = name
        self.rules = rules
        self.constraint_calls: list[tuple[str, str | None]] = []
        self.sharing_calls: list[SharingProblem] = []
        self.lowering_hook_calls = 0

    @quantplug.hookimpl
    def quantplug_backend_info(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            description="in-process test backend",
            options=(
                BackendOption("precision", str, "8a8w", "preset", choices=("8a8w", "16a8w")),
                BackendOption("chip", str, "A2", "target chip", choices=tuple(CHIPS)),
                BackendOption("weight_symmetric", bool, True, "symmetric weights"),
                BackendOption("unify_cat", bool, True, "one observer for all cat inputs"),
                BackendOption("gain", float, 1.0, "unused number"),
            ),
            presets=(Preset("8a8w", "8-bit"), Preset("16a8w", "16-bit activations")),
            preset_option="precision",
        )

    @quantplug.hookimpl
    def quantplug_annotation_rules(self, context: BackendContext) -> Sequence[RulesModule]:
        return [
            RulesModule(self.rules.dense, [aten.linear.default]),
            RulesModule(self.rules.misc, ["aten.relu.default", "aten.add.Tensor", "aten.cat.default"]),
        ]

    @quantplug.hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: BackendContext
    ) -> QuantizationConfig:
        return toy_config(preset or "8a8w", context.option("weight_symmetric"))

    @quantplug.hookimpl
    def quantplug_target_arch(self, context: BackendContext) -> int:
        return CHIPS[context.option("chip")]

    @quantplug.hookimpl
    def quantplug_op_constraints(
        self, op: str, backend_op: str | None, context: BackendContext
    ) -> Sequence[OpConstraint]:
        self.constraint_calls.append((op, backend_op))
        if backend_op != "Dense":
            return []
        return [
            OpConstraint(
                op="Dense",
                ports={1: PortConstraint(dtypes=frozenset({torch.int8}), symmetric=True)},
                arch=(
                    ArchRequirement(
                        min_arch=2,
                        reason="16-bit Dense needs A2",
                        when=lambda ports: getattr(ports.get(OUTPUT), "dtype", None) == torch.uint16,
                    ),
                ),
            )
        ]

    @quantplug.hookimpl
    def quantplug_resolve_sharing(
        self,
        problem: SharingProblem,
        resolve: Callable[[SharingProblem], SharingGroups],
        context: BackendContext,
    ) -> SharingGroups | None:
        self.sharing_calls.append(problem)
        return unify_cat(problem, resolve) if context.option("unify_cat") else None

    @quantplug.hookimpl
    def quantplug_passes_before_annotation(self, context: BackendContext) -> Sequence[NamedPass]:
        return [NamedPass("mul_by_two_to_add", mul_by_two_to_add)]

    @quantplug.hookimpl
    def quantplug_fusion_patterns(self, context: BackendContext) -> Sequence[FusionPattern]:
        return ()  # fusion: tests/core/test_fusion.py

    @quantplug.hookimpl
    def quantplug_annotation_passes(self, context: BackendContext) -> Sequence[NamedPass]:
        return ()  # tests/core/test_hook_contract.py

    @quantplug.hookimpl
    def quantplug_io_config(self, context: BackendContext) -> QuantizationConfig | None:
        return None  # tests/core/test_hook_contract.py

    @quantplug.hookimpl
    def quantplug_conformance_profile(self, context: BackendContext) -> ConformanceProfile:
        return ConformanceProfile(artifact_files=("toy.json",))  # the kit: tests/conformance/

    @quantplug.hookimpl
    def quantplug_lowering_passes(self, context: BackendContext) -> Sequence[NamedPass]:
        self.lowering_hook_calls += 1

        def record(gm: GraphModule, ctx: BackendContext) -> None:
            ctx.state.setdefault("lowering", []).append("backend")

        return [NamedPass("record_backend", record)]

    @quantplug.hookimpl
    def quantplug_artifact_writer(
        self, context: BackendContext
    ) -> Callable[[GraphModule, BackendContext], Artifact]:
        def write(program: GraphModule, ctx: BackendContext) -> Artifact:
            table = encodings(program)
            return Artifact(
                backend=ctx.backend,
                files={"toy.json": json.dumps(table)},
                metadata={"lowering": list(ctx.state.get("lowering", [])), "tensors": len(table)},
            )

        return write


class ToyExtension:
    """An extension: adds a rules module, a constraint, passes; optionally overrides firstresult hooks."""

    def __init__(
        self,
        rules: ToyRules | None = None,
        *,
        config: QuantizationConfig | None = None,
        arch: int | None = None,
        writer: bool = False,
        add_constraint: bool = False,
    ) -> None:
        self.rules = rules
        self.add_constraint = add_constraint
        self.config = config
        self.arch = arch
        self.writer = writer

    @quantplug.hookimpl
    def quantplug_annotation_rules(self, context: BackendContext) -> Sequence[RulesModule]:
        return [RulesModule(self.rules.ext, ["aten.relu.default"])] if self.rules else []

    @quantplug.hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: BackendContext
    ) -> QuantizationConfig | None:
        return self.config

    @quantplug.hookimpl
    def quantplug_target_arch(self, context: BackendContext) -> int | None:
        return self.arch

    @quantplug.hookimpl
    def quantplug_op_constraints(
        self, op: str, backend_op: str | None, context: BackendContext
    ) -> Sequence[OpConstraint]:
        if backend_op != "Add" or not self.add_constraint:
            return []
        return [OpConstraint(op="Add", ports={OUTPUT: PortConstraint(dtypes=frozenset({torch.int8}))})]

    @quantplug.hookimpl
    def quantplug_resolve_sharing(
        self,
        problem: SharingProblem,
        resolve: Callable[[SharingProblem], SharingGroups],
        context: BackendContext,
    ) -> SharingGroups | None:
        context.state["extension_saw_sharing"] = True
        return None  # defer to the backend's hook

    @quantplug.hookimpl
    def quantplug_passes_before_annotation(self, context: BackendContext) -> Sequence[NamedPass]:
        def record(gm: GraphModule, ctx: BackendContext) -> None:
            ctx.state.setdefault("before", []).append("extension")

        return [NamedPass("record_extension_before", record)]

    @quantplug.hookimpl
    def quantplug_fusion_patterns(self, context: BackendContext) -> Sequence[FusionPattern]:
        return ()

    @quantplug.hookimpl
    def quantplug_annotation_passes(self, context: BackendContext) -> Sequence[NamedPass]:
        return ()

    @quantplug.hookimpl
    def quantplug_io_config(self, context: BackendContext) -> QuantizationConfig | None:
        return None

    @quantplug.hookimpl
    def quantplug_conformance_profile(self, context: BackendContext) -> ConformanceProfile | None:
        return None

    @quantplug.hookimpl
    def quantplug_lowering_passes(self, context: BackendContext) -> Sequence[NamedPass]:
        def record(gm: GraphModule, ctx: BackendContext) -> None:
            ctx.state.setdefault("lowering", []).append("extension")

        return [NamedPass("record_extension", record)]

    @quantplug.hookimpl
    def quantplug_artifact_writer(
        self, context: BackendContext
    ) -> Callable[[GraphModule, BackendContext], Artifact] | None:
        if not self.writer:
            return None
        return lambda program, ctx: Artifact(
            backend=ctx.backend, files={"extension.txt": "written by extension"}
        )


class ToyNet(nn.Module):
    """x * 2 (becomes x + x) and linear -> relu, concatenated.

    The cat output shares the first input's observer, so that observer sees both halves; the
    relu's own output observer sees only values >= 0. Different encodings, unless the backend
    unifies the cat inputs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.fc(x))
        b = x * 2.0
        return torch.cat([b, a], dim=1)


class LinearOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _calibrated(
    ep: torch.export.ExportedProgram, q: quantplug.Quantizer, *batches: torch.Tensor
) -> GraphModule:
    prepared = quantplug.prepare(ep, q)
    with torch.no_grad():
        for b in batches:
            prepared(b)
    return quantplug.convert(prepared)


def _cat_input_scales(converted: GraphModule) -> list[float]:
    cat = next(n for n in converted.graph.nodes if n.target == aten.cat.default)
    dqs = cat.args[0]
    assert all(d.target == qd.dequantize_per_tensor.default for d in dqs)
    return [float(d.args[1]) for d in dqs]


def _data(n: int = 4, shape: tuple[int, ...] = (2, 4), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 2 for _ in range(n)]


# --------------------------------------------------------------------------------------------
# discovery: what is imported when
# --------------------------------------------------------------------------------------------

_PLUGIN_PACKAGES = """
import json, sys
from importlib import metadata
plugin_packages = sorted({ep.value.split(".")[0] for group in ("quantplug.backends", "quantplug.extensions")
                          for ep in metadata.entry_points(group=group)})
def loaded(prefixes):
    return sorted(m for m in sys.modules if m.split(".")[0] in prefixes)
"""


def test_list_backends_imports_no_plugin_module(tmp_path: Path) -> None:
    result = _run_python(
        _PLUGIN_PACKAGES
        + """
import quantplug
after_import = loaded(plugin_packages)
entries = quantplug.list_backends()
print(json.dumps({"packages": plugin_packages, "after_import": after_import,
                  "after_list": loaded(plugin_packages), "names": [e.name for e in entries],
                  "status": sorted({e.status for e in entries})}))
""",
        tmp_path,
    )
    assert "quantplug_reference" in result["packages"]
    assert "reference" in result["names"]
    assert result["after_import"] == []
    assert result["after_list"] == []
    assert result["status"] == ["available"]


def test_get_quantizer_imports_only_the_asked_backend(tmp_path: Path) -> None:
    result = _run_python(
        _PLUGIN_PACKAGES
        + """
import quantplug
quantplug.get_quantizer("reference")
print(json.dumps({"loaded": loaded(plugin_packages),
                  "status": {e.name: e.status for e in quantplug.list_backends()}}))
""",
        tmp_path,
    )
    loaded = set(result["loaded"])
    assert "quantplug_reference.plugin" in loaded
    assert not any(m.startswith("quantplug_qnn_htp") for m in loaded)
    # rules modules are imported by prepare, for the ops a graph has; never by get_quantizer
    assert not any(m.startswith("quantplug_reference.rules.") for m in loaded)
    # another installed plugin's backend module stays unimported (its reference extension may load)
    assert "quantplug_example_vendor.plugin" not in loaded
    assert result["status"]["reference"] == "loaded"
    assert {s for n, s in result["status"].items() if n != "reference"} <= {"available"}


def test_get_quantizer_of_example_vendor_imports_nothing_else(tmp_path: Path) -> None:
    pytest.importorskip("quantplug_example_vendor")
    result = _run_python(
        _PLUGIN_PACKAGES
        + """
import quantplug
quantplug.get_quantizer("example_vendor")
before_prepare = loaded(plugin_packages)
print(json.dumps({"loaded": before_prepare}))
""",
        tmp_path,
    )
    loaded = set(result["loaded"])
    assert "quantplug_example_vendor.plugin" in loaded
    assert not any(m.startswith(("quantplug_reference", "quantplug_qnn_htp")) for m in loaded)
    # its extension of `reference` and its rules modules are not needed yet
    assert "quantplug_example_vendor.reference_ext" not in loaded
    assert "quantplug_example_vendor.rules.weighted_rules" not in loaded


# --------------------------------------------------------------------------------------------
# registry errors
# --------------------------------------------------------------------------------------------


def test_unknown_backend_lists_installed_names(toy_rules: ToyRules) -> None:
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        with pytest.raises(quantplug.UnknownBackendError) as info:
            quantplug.get_quantizer("no_such_backend")
    err = info.value
    assert err.name == "no_such_backend"
    assert "toy" in err.installed and "reference" in err.installed
    assert "toy" in str(err) and "reference" in str(err) and "no_such_backend" in str(err)
    assert isinstance(err, LookupError) and isinstance(err, quantplug.QuantplugError)


def test_entry_point_backend_is_listed_then_loaded(site: FakeSite) -> None:
    uid = _uid()
    module = site.module(f"qp_tmp_ok_{uid}", _minimal_plugin("tmp_ok"))
    site.dist("quantplug-tmp-ok", backends={"tmp_ok": module}, version="1.2.3")
    entry = _names(quantplug.list_backends())["tmp_ok"]
    assert (entry.module, entry.distribution, entry.version, entry.source, entry.status) == (
        module,
        "quantplug-tmp-ok",
        "1.2.3",
        "entry-point",
        "available",
    )
    assert module not in sys.modules
    q = quantplug.get_quantizer("tmp_ok", level="7")  # text from a command line is converted
    assert q.backend == "tmp_ok" and q.options == {"level": 7, "strict": True}
    assert _names(quantplug.list_backends())["tmp_ok"].status == "loaded"


def test_entry_point_backend_that_fails_to_import(site: FakeSite, toy_rules: ToyRules) -> None:
    uid = _uid()
    broken = site.module(f"qp_tmp_broken_{uid}", "raise RuntimeError('boom: missing vendor SDK')\n")
    site.dist("quantplug-tmp-broken", backends={"tmp_broken": broken})
    assert _names(quantplug.list_backends())["tmp_broken"].status == "available"  # listing imports nothing

    with pytest.raises(quantplug.BackendLoadError) as info:
        quantplug.get_quantizer("tmp_broken")
    err = info.value
    assert (err.name, err.distribution, err.module) == ("tmp_broken", "quantplug-tmp-broken", broken)
    assert "backend 'tmp_broken'" in str(err)
    assert isinstance(err.cause, RuntimeError)
    assert "quantplug-tmp-broken" in str(err) and "boom: missing vendor SDK" in str(err)
    assert isinstance(err, ImportError)

    entry = _names(quantplug.list_backends())["tmp_broken"]
    assert entry.status == "error" and "boom" in (entry.error or "")
    # other backends keep working
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        assert quantplug.get_quantizer("toy").backend == "toy"
    assert quantplug.get_quantizer("reference").backend == "reference"


def test_entry_point_module_without_backend_info(site: FakeSite) -> None:
    module = site.module(f"qp_tmp_noinfo_{_uid()}", "X = 1\n")
    site.dist("quantplug-tmp-noinfo", backends={"tmp_noinfo": module})
    with pytest.raises(quantplug.BackendLoadError, match="quantplug_backend_info"):
        quantplug.get_quantizer("tmp_noinfo")


def test_in_process_plugin_with_a_bad_hook_signature() -> None:
    class BadPlugin:
        @quantplug.hookimpl
        def quantplug_backend_info(self) -> BackendInfo:
            return BackendInfo(name="bad", description="")

        @quantplug.hookimpl
        def quantplug_target_arch(
            self, context: BackendContext, soc: str
        ) -> int:  # `soc` is no hook argument
            return 1

    with quantplug.registered_backend("bad", BadPlugin()):
        with pytest.raises(quantplug.BackendLoadError) as info:
            quantplug.get_quantizer("bad")
    assert (info.value.name, info.value.distribution) == ("bad", None)
    assert "soc" in str(info.value)


def test_broken_extension_and_broken_rules_module(site: FakeSite, toy_rules: ToyRules) -> None:
    ext = site.module(f"qp_tmp_bad_ext_{_uid()}", "raise ImportError('extension needs libfoo')\n")
    site.dist("quantplug-tmp-bad-ext", extensions={"toy": ext})
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        with pytest.raises(quantplug.BackendLoadError) as info:
            quantplug.get_quantizer("toy")
    assert info.value.module == ext and info.value.distribution == "quantplug-tmp-bad-ext"
    assert info.value.name == "toy" and info.value.extension_of == "toy"
    assert "libfoo" in str(info.value) and "Other backends are unaffected" in str(info.value)
    assert quantplug.get_quantizer("reference").backend == "reference"  # it is true

    bad_rules = ToyRules(
        dense=site.module(f"qp_tmp_bad_rules_{_uid()}", "1/0\n"), misc=toy_rules.misc, ext=""
    )
    with quantplug.registered_backend("toy2", ToyBackend(bad_rules, name="toy2")):
        q = quantplug.get_quantizer("toy2")  # rules modules load lazily: no error yet
        with pytest.raises(quantplug.BackendLoadError, match="ZeroDivisionError"):
            quantplug.prepare(_export(LinearOnly(), torch.randn(2, 4)), q)


def test_a_broken_extension_of_every_backend_says_it_stops_every_backend(
    site: FakeSite, toy_rules: ToyRules
) -> None:
    """A ``"*"`` extension takes part in every backend's results (rules, constraints, passes):
    each backend fails to load while it is broken, and the message says so, naming it."""
    ext = site.module(f"qp_tmp_star_broken_{_uid()}", "raise ImportError('extension needs libbar')\n")
    site.dist("quantplug-tmp-star-broken", extensions={"*": ext})
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        for name in ("toy", "reference"):
            with pytest.raises(quantplug.BackendLoadError) as info:
                quantplug.get_quantizer(name)
            message = str(info.value)
            assert (info.value.name, info.value.module, info.value.extension_of) == (name, ext, "*")
            assert "Other backends are unaffected" not in message
            assert f"extension {ext!r} from distribution 'quantplug-tmp-star-broken'" in message
            assert "registered for every backend" in message and "none can be used" in message
            assert "libbar" in message


def test_a_plugin_calling_sys_exit_fails_to_load(site: FakeSite) -> None:
    """``sys.exit`` at import or in ``quantplug_backend_info`` is the plugin's load failure, not
    the end of the process (``quantplug backends --check`` would exit 0 saying nothing)."""
    uid = _uid()
    at_import = site.module(f"qp_tmp_exit_{uid}", "import sys\nsys.exit(0)\n")
    in_info = site.module(
        f"qp_tmp_exit_info_{uid}",
        """
        import sys
        import quantplug

        @quantplug.hookimpl
        def quantplug_backend_info():
            sys.exit("no licence")
        """,
    )
    site.dist("quantplug-tmp-exit", backends={"tmp_exit": at_import, "tmp_exit_info": in_info})
    with pytest.raises(quantplug.BackendLoadError, match=r"importing it called sys\.exit\(0\)") as info:
        quantplug.get_quantizer("tmp_exit")
    assert info.value.module == at_import and isinstance(info.value.__cause__, SystemExit)
    with pytest.raises(quantplug.BackendLoadError, match="SystemExit: no licence"):
        quantplug.get_quantizer("tmp_exit_info")
    assert _names(quantplug.list_backends())["tmp_exit"].status == "error"


def test_two_distributions_claiming_one_name(site: FakeSite) -> None:
    uid = _uid()
    a = site.module(f"qp_tmp_twin_a_{uid}", _minimal_plugin("twin"))
    b = site.module(f"qp_tmp_twin_b_{uid}", _minimal_plugin("twin"))
    site.dist("quantplug-twin-a", backends={"twin": a})
    site.dist("quantplug-twin-b", backends={"twin": b})

    entry = _names(quantplug.list_backends())["twin"]
    assert entry.status == "conflict"
    assert entry.claimants == ("quantplug-twin-a", "quantplug-twin-b")
    with pytest.raises(quantplug.DuplicateBackendError) as info:
        quantplug.get_quantizer("twin")
    assert info.value.claimants == ["quantplug-twin-a", "quantplug-twin-b"]
    assert "quantplug-twin-a" in str(info.value) and "quantplug-twin-b" in str(info.value)
    assert a not in sys.modules and b not in sys.modules


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def test_disable_autoload_keeps_only_in_process_plugins(
    site: FakeSite, toy_rules: ToyRules, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid = _uid()
    backend = site.module(f"qp_tmp_env_{uid}", _minimal_plugin("tmp_env"))
    star_ext = site.module(f"qp_tmp_star_ext_{uid}", "LOADED = True\n")
    site.dist("quantplug-tmp-env", backends={"tmp_env": backend}, extensions={"*": star_ext})

    # without the variable: the "*" extension is applied to every backend, in-process ones too
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        assert star_ext in registry.load_backend("toy").extensions
    sys.modules.pop(star_ext, None)
    registry.reset_cache()

    monkeypatch.setenv(registry.ENV_DISABLE_AUTOLOAD, "1")
    entries = _names(quantplug.list_backends())
    assert entries["tmp_env"].status == "disabled" and entries["reference"].status == "disabled"
    with pytest.raises(quantplug.BackendDisabledError, match=registry.ENV_DISABLE_AUTOLOAD):
        quantplug.get_quantizer("tmp_env")
    with pytest.raises(quantplug.UnknownBackendError) as info:
        quantplug.get_quantizer("nothing")
    assert "reference" not in info.value.installed  # disabled backends are not offered
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        assert quantplug.get_quantizer("toy").backend == "toy"
        assert registry.load_backend("toy").extensions == []
    assert backend not in sys.modules and star_ext not in sys.modules

    monkeypatch.setenv(registry.ENV_DISABLE_AUTOLOAD, "0")
    registry.reset_cache()
    assert quantplug.get_quantizer("tmp_env").backend == "tmp_env"


def test_backends_variable_restricts_autoloading(site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    uid = _uid()
    one = site.module(f"qp_tmp_one_{uid}", _minimal_plugin("tmp_one"))
    two = site.module(f"qp_tmp_two_{uid}", _minimal_plugin("tmp_two"))
    site.dist("quantplug-tmp-one", backends={"tmp_one": one})
    site.dist("quantplug-tmp-two", backends={"tmp_two": two})

    monkeypatch.setenv(registry.ENV_BACKENDS, " tmp_one , reference")
    entries = _names(quantplug.list_backends())
    assert entries["tmp_one"].status == "available"
    assert entries["reference"].status == "available"
    assert entries["tmp_two"].status == "disabled"
    assert quantplug.get_quantizer("tmp_one").backend == "tmp_one"
    with pytest.raises(quantplug.BackendDisabledError, match=registry.ENV_BACKENDS):
        quantplug.get_quantizer("tmp_two")
    assert two not in sys.modules


# --------------------------------------------------------------------------------------------
# every hook, through an in-process backend
# --------------------------------------------------------------------------------------------


def test_toy_backend_implements_every_hook() -> None:
    implemented = {n for n in vars(ToyBackend) if n.startswith("quantplug_")}
    assert implemented == HOOK_NAMES
    assert {n for n in vars(ToyExtension) if n.startswith("quantplug_")} == HOOK_NAMES - {
        "quantplug_backend_info"
    }


def test_backend_info_options_and_presets(toy_rules: ToyRules) -> None:
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        q = quantplug.get_quantizer("toy")
        assert q.options == {
            "precision": "8a8w",
            "chip": "A2",
            "weight_symmetric": True,
            "unify_cat": True,
            "gain": 1.0,
            "strict": True,  # reserved, accepted by every backend, visible to every hook
        }
        assert q.info.name == "toy" and q.info.preset_option == "precision"
        q = quantplug.get_quantizer("toy", weight_symmetric="false", gain=2, chip="A1")
        assert q.options["weight_symmetric"] is False and q.options["gain"] == 2.0 and q.arch == 1
        assert q.strict is True and quantplug.get_quantizer("toy", strict=False).strict is False

        with pytest.raises(quantplug.OptionError, match="valid values: 8a8w, 16a8w"):
            quantplug.get_quantizer("toy", precision="4a4w")
        with pytest.raises(quantplug.OptionError, match="valid options: chip, gain, precision"):
            quantplug.get_quantizer("toy", soc="X")
        with pytest.raises(quantplug.OptionError, match="must be bool"):
            quantplug.get_quantizer("toy", unify_cat=3)
        with pytest.raises(quantplug.OptionError, match="strict"):
            quantplug.get_quantizer("toy", strict="maybe")


def test_annotation_rules_are_imported_lazily(toy_rules: ToyRules) -> None:
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        q = quantplug.get_quantizer("toy")
        assert q.rules.ops == {
            "aten.linear.default",
            "aten.relu.default",
            "aten.add.Tensor",
            "aten.cat.default",
        }
        assert toy_rules.dense not in sys.modules and toy_rules.misc not in sys.modules

        prepared = quantplug.prepare(_export(LinearOnly(), torch.randn(2, 4)), q)
        assert q.rules.imported == [toy_rules.dense]
        assert toy_rules.misc not in sys.modules
        linear = next(n for n in prepared.graph.nodes if n.target == aten.linear.default)
        assert linear.meta[RULE_KEY].backend_op == "Dense"

        q = quantplug.get_quantizer("toy")
        quantplug.prepare(_export(ToyNet(), torch.randn(2, 4)), q)
        assert sorted(q.rules.imported) == sorted([toy_rules.dense, toy_rules.misc])
        assert q.context.state["rule_saw"] == ["relu"]  # the three-argument rule got the context
        assert not q.coverage(_export(ToyNet(), torch.randn(2, 4))).float_nodes


def test_extension_rules_module_wins_for_its_ops(toy_rules: ToyRules) -> None:
    ep = _export(ToyNet(), torch.randn(2, 4))
    with quantplug.registered_backend("toy", ToyBackend(toy_rules), ToyExtension(toy_rules)):
        q = quantplug.get_quantizer("toy")
        prepared = quantplug.prepare(ep, q)
    relu = next(n for n in prepared.graph.nodes if n.target == aten.relu.default)
    assert relu.meta[RULE_KEY].backend_op == "ExtAct"
    assert "quantization_annotation" not in relu.meta
    float_ops = q.coverage(ep).float_ops()
    assert float_ops == {"aten.relu.default": 1}


def test_quantization_config_follows_the_preset(toy_rules: ToyRules) -> None:
    ep = _export(LinearOnly(), torch.randn(2, 4))
    data = _data()
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        dtypes = {}
        for precision in ("8a8w", "16a8w"):
            q = quantplug.get_quantizer("toy", precision=precision)
            table = encodings(_calibrated(ep, q, *data))
            dtypes[precision] = {e["dtype"] for e in table if e["kind"] == "activation"}
            assert {e["dtype"] for e in table if e["kind"] == "constant"} == {"int8", "int32"}
    assert dtypes == {"8a8w": {"uint8"}, "16a8w": {"uint16"}}


def test_firstresult_hooks_prefer_the_extension(toy_rules: ToyRules) -> None:
    ext = ToyExtension(config=toy_config("16a8w"), arch=9)
    with quantplug.registered_backend("toy", ToyBackend(toy_rules), ext):
        q = quantplug.get_quantizer("toy", precision="8a8w", chip="A1")
    assert q.global_config is not None and q.global_config.input_activation.dtype == torch.uint16  # type: ignore[union-attr]
    assert q.arch == 9
    with quantplug.registered_backend("toy", ToyBackend(toy_rules), ToyExtension()):  # extension defers: None
        q = quantplug.get_quantizer("toy", precision="8a8w", chip="A1")
    assert q.global_config.input_activation.dtype == torch.uint8 and q.arch == 1  # type: ignore[union-attr]


def test_target_arch_and_op_constraints(toy_rules: ToyRules, caplog: pytest.LogCaptureFixture) -> None:
    ep = _export(ToyNet(), torch.randn(2, 4))
    backend = ToyBackend(toy_rules)
    with quantplug.registered_backend("toy", backend):
        quantplug.prepare(ep, quantplug.get_quantizer("toy"))  # defaults satisfy every constraint
        assert ("aten.linear.default", "Dense") in backend.constraint_calls
        assert ("aten.relu.default", "Act") in backend.constraint_calls

        # weights must be symmetric: strict (the default) raises, naming node, port and rule
        with pytest.raises(quantplug.ConstraintViolationError) as info:
            quantplug.prepare(ep, quantplug.get_quantizer("toy", weight_symmetric=False))
        (violation,) = info.value.report.violations
        assert (violation.node, violation.backend_op, violation.port, violation.rule) == (
            "linear",
            "Dense",
            "input 1",
            "symmetric",
        )

        # the arch gate applies only to 16-bit outputs, and only below A2
        assert quantplug.prepare(ep, quantplug.get_quantizer("toy", precision="16a8w", chip="A2"))
        q = quantplug.get_quantizer("toy", precision="16a8w", chip="A1", strict=False)
        assert q.arch == 1
        with caplog.at_level(logging.WARNING, logger="quantplug.validation"):
            prepared = quantplug.prepare(ep, q)
        report = prepared.meta[STATE_KEY].validation
        assert [(v.node, v.rule) for v in report.violations] == [("linear", "architecture")]
        assert "16-bit Dense needs A2" in report.format()
        assert "16-bit Dense needs A2" in caplog.text


def test_op_constraints_of_backend_and_extension_all_apply(toy_rules: ToyRules) -> None:
    ep = _export(ToyNet(), torch.randn(2, 4))
    with quantplug.registered_backend("toy", ToyBackend(toy_rules), ToyExtension(add_constraint=True)):
        q = quantplug.get_quantizer("toy", weight_symmetric=False, strict=False)
        report = quantplug.prepare(ep, q).meta[STATE_KEY].validation
    rules = sorted((v.backend_op, v.rule) for v in report.violations)
    assert rules == [("Add", "dtype"), ("Dense", "symmetric")]


def test_resolve_sharing_hook_unifies_cat_inputs(toy_rules: ToyRules) -> None:
    ep = _export(ToyNet(), torch.randn(2, 4))
    data = _data()
    backend = ToyBackend(toy_rules)
    with quantplug.registered_backend("toy", backend, ToyExtension()):  # the extension defers (None)
        separate = _cat_input_scales(_calibrated(ep, quantplug.get_quantizer("toy", unify_cat=False), *data))
        q = quantplug.get_quantizer("toy")
        unified = _cat_input_scales(_calibrated(ep, q, *data))
    assert q.context.state["extension_saw_sharing"] is True
    assert separate[0] != separate[1]  # the relu's observer saw only values >= 0
    assert unified == [separate[0], separate[0]]  # one observer saw everything the cat saw
    problem = backend.sharing_calls[-1]
    # keys are node names: the add made from `x * 2` keeps the name "mul"
    assert problem.graph is not None and ("relu", "cat") in problem.specs and ("mul", "cat") in problem.specs


def test_passes_before_annotation_run_backend_then_extension(toy_rules: ToyRules) -> None:
    model = ToyNet()
    ep = _export(model, torch.randn(2, 4))
    with quantplug.registered_backend("toy", ToyBackend(toy_rules), ToyExtension()):
        q = quantplug.get_quantizer("toy")
        prepared = quantplug.prepare(ep, q)
    targets = [n.target for n in prepared.graph.nodes if n.op == "call_function"]
    assert aten.mul.Tensor not in targets and aten.add.Tensor in targets
    add = next(n for n in prepared.graph.nodes if n.target == aten.add.Tensor)
    assert "quantization_annotation" in add.meta  # annotated by the Add rule after the rewrite
    assert q.context.state["before"] == ["backend", "extension"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(prepared(x), model(x))  # observers only measure; x + x == x * 2
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"].count(aten.mul.Tensor) == 1


def test_lowering_passes_and_artifact_writer(toy_rules: ToyRules, tmp_path: Path) -> None:
    ep = _export(ToyNet(), torch.randn(2, 4))
    backend = ToyBackend(toy_rules)
    with quantplug.registered_backend("toy", backend, ToyExtension()):
        q = quantplug.get_quantizer("toy")
        converted = _calibrated(ep, q, *_data())
        assert backend.lowering_hook_calls == 0  # asked for at lower() only
        artifact = quantplug.lower(converted, q)
    assert backend.lowering_hook_calls == 1
    assert isinstance(artifact, Artifact) and artifact.backend == "toy"
    assert artifact.metadata["lowering"] == ["backend", "extension"]
    table = json.loads(str(artifact.files["toy.json"]))
    assert len(table) == artifact.metadata["tensors"] == len(encodings(converted)) > 0

    written = artifact.save(tmp_path / "out")
    assert sorted(p.name for p in written) == ["artifact.json", "toy.json"]
    assert json.loads((tmp_path / "out" / "artifact.json").read_text())["backend"] == "toy"

    with quantplug.registered_backend("toy", ToyBackend(toy_rules), ToyExtension(writer=True)):
        q = quantplug.get_quantizer("toy")
        artifact = quantplug.lower(_calibrated(ep, q, *_data()), q)
    assert artifact.files == {"extension.txt": "written by extension"}  # firstresult: extension first


def test_lower_without_an_artifact_writer(site: FakeSite) -> None:
    module = site.module(f"qp_tmp_nowriter_{_uid()}", _minimal_plugin("tmp_nowriter"))
    site.dist("quantplug-tmp-nowriter", backends={"tmp_nowriter": module})
    q = quantplug.get_quantizer("tmp_nowriter")
    ep = _export(LinearOnly(), torch.randn(2, 4))
    converted = quantplug.convert(quantplug.prepare(ep, q))  # no rules: nothing to calibrate
    with pytest.raises(quantplug.LoweringError, match="no artifact writer"):
        quantplug.lower(converted, q)


def test_star_extension_in_process(toy_rules: ToyRules) -> None:
    ext = ToyExtension(arch=42)
    quantplug.register_extension("*", ext)
    try:
        with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
            assert quantplug.get_quantizer("toy").arch == 42
    finally:
        quantplug.unregister("*")
    with quantplug.registered_backend("toy", ToyBackend(toy_rules)):
        assert quantplug.get_quantizer("toy").arch == 2


# --------------------------------------------------------------------------------------------
# the installed example distribution (tests/example_plugin)
# --------------------------------------------------------------------------------------------


class VendorNet(nn.Module):
    """Every op the example vendor covers: linear, conv, relu, add with a scalar, cat."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(16, 8)
        self.fc3 = nn.Linear(16, 8)
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.relu(self.fc1(x))
        b = self.fc2(x) + 0.5
        head = torch.relu(self.fc3(x))  # its output grid starts at 0: the relu can be dropped
        return torch.cat([a, b], dim=1), self.conv(img), head


def _vendor_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, generator=gen), torch.randn(1, 3, 8, 8, generator=gen)


def test_example_vendor_is_found_through_its_entry_point() -> None:
    pytest.importorskip("quantplug_example_vendor")
    entry = _names(quantplug.list_backends())["example_vendor"]
    assert (entry.module, entry.distribution, entry.source) == (
        "quantplug_example_vendor.plugin",
        "quantplug-example-vendor",
        "entry-point",
    )
    from quantplug_example_vendor import plugin

    assert {n for n in vars(plugin) if n.startswith("quantplug_")} == HOOK_NAMES
    loaded = registry.load_backend("example_vendor")
    assert loaded.info.name == "example_vendor" and loaded.extensions == []
    with pytest.raises(quantplug.OptionError, match="EV100, EV200, EV300"):
        quantplug.get_quantizer("example_vendor", chip="EV999")


def test_example_vendor_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("quantplug_example_vendor")
    model = VendorNet().eval()
    ep = _export(model, *_vendor_inputs(0))
    q = quantplug.get_quantizer("example_vendor", chip="EV200")
    prepared = quantplug.prepare(ep, q)
    state = prepared.meta[STATE_KEY]
    assert state.validation.ok and state.validation.checked_nodes == 8
    # concat unification (the backend's resolve_sharing hook): the cat's input edges, hence
    # both producers' outputs, have one observer group
    cat_inputs = {
        key: gid for key, gid in state.group_of.items() if isinstance(key, tuple) and key[1] == "cat"
    }
    assert set(cat_inputs) == {("relu", "cat"), ("add", "cat")}
    assert len(set(cat_inputs.values())) == 1 and state.group_of["relu"] == state.group_of["add"]
    with torch.no_grad():
        for seed in range(4):
            prepared(*_vendor_inputs(seed))
    converted = quantplug.convert(prepared)
    assert not q.coverage(ep).float_nodes

    # the scalar of `fc2(x) + 0.5` was lifted to a constant and quantized, on the scale of the
    # adder's other input (the example's SameScale(enforce="share") constraint)
    table = encodings(converted)
    scalar = next(e for e in table if e["tensor"].startswith("_example_vendor_scalar"))
    assert scalar["scale"] == next(e for e in table if e["tensor"] == "linear_1")["scale"]
    first, second = _cat_input_scales(converted)
    assert first == second

    x = _vendor_inputs(0)  # a calibration batch: nothing clips
    with torch.no_grad():
        expected, got = model(*x), converted(*x)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=0.15, rtol=0.1)

    artifact = quantplug.lower(converted, q)
    assert artifact.metadata["dropped_relus"] == ["relu_1"]
    assert sum(n.target == aten.relu.default for n in converted.graph.nodes) == 2  # lower() copied
    lowered = converted
    for p in q.lowering_plan().passes:
        lowered = p.fn(lowered, q.context) or lowered
    assert sum(n.target == aten.relu.default for n in lowered.graph.nodes) == 1
    with torch.no_grad():
        for e, g in zip(converted(*x), lowered(*x)):
            assert torch.equal(e, g)  # the pass is exact

    written = artifact.save(tmp_path / "out")
    assert sorted(p.name for p in written) == ["artifact.json", "example_vendor_encodings.json"]
    document = json.loads((tmp_path / "out" / "example_vendor_encodings.json").read_text())
    assert (document["format"], document["chip"], document["arch"], document["precision"]) == (
        "example-vendor-encodings/1",
        "EV200",
        2,
        "8a8w",
    )
    assert len(document["encodings"]) == artifact.metadata["quantized_tensors"] == len(table)


def test_example_vendor_per_block_weights_need_ev300() -> None:
    pytest.importorskip("quantplug_example_vendor")
    ep = _export(VendorNet(), *_vendor_inputs(0))
    with pytest.raises(quantplug.ConstraintViolationError, match="per-block weights need EV300"):
        quantplug.prepare(ep, quantplug.get_quantizer("example_vendor", precision="8a4w_block", chip="EV100"))
    q = quantplug.get_quantizer("example_vendor", precision="8a4w_block", chip="EV300", block_size=8)
    prepared = quantplug.prepare(ep, q)
    with torch.no_grad():
        prepared(*_vendor_inputs(1))
    table = encodings(quantplug.convert(prepared))
    blocks = [e for e in table if e["granularity"] == "block"]
    assert len(blocks) == 3 and all(e["block_size"] == [1, 8] for e in blocks)  # the three linears
    conv_weight = next(e for e in table if e["tensor"].startswith("conv_weight"))
    assert conv_weight["granularity"] == "channel" and conv_weight["quant_max"] == 7


def test_example_vendor_extends_reference_with_abs() -> None:
    pytest.importorskip("quantplug_example_vendor")

    class AbsNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.abs(self.fc(x))

    ep = _export(AbsNet(), torch.randn(2, 8))
    q = quantplug.get_quantizer("reference", activation_observer="minmax")
    assert registry.load_backend("reference").extensions == ["quantplug_example_vendor.reference_ext"]
    prepared = quantplug.prepare(ep, q)
    abs_node = next(n for n in prepared.graph.nodes if n.target == aten.abs.default)
    assert abs_node.meta[RULE_KEY].fn.__module__ == "quantplug_example_vendor.rules.abs_rules"
    assert abs_node.meta[RULE_KEY].backend_op == "Abs"
    assert "quantplug_example_vendor.rules.abs_rules" in q.rules.imported
    with torch.no_grad():
        prepared(torch.randn(2, 8))
    converted = quantplug.convert(prepared)
    abs_node = next(n for n in converted.graph.nodes if n.target == aten.abs.default)
    assert abs_node.args[0].target == qd.dequantize_per_tensor.default  # type: ignore[union-attr]
    assert [u.target for u in abs_node.users] == [qd.quantize_per_tensor.default]

    # the extension's constraint applies too: abs output on a symmetric grid is rejected
    symmetric = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
    q = quantplug.get_quantizer("reference").set_op(
        aten.abs.default, QuantizationConfig(symmetric, symmetric, None, None)
    )
    with pytest.raises(quantplug.ConstraintViolationError) as info:
        quantplug.prepare(ep, q)
    assert [(v.op, v.rule) for v in info.value.report.violations] == [("aten.abs.default", "asymmetric")]
