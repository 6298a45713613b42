"""What exists for a peer's speed or defects: one table of verified versions, and the plain path.

Every module of ``_quantplug/peers`` is in ``versions.PIECES``; a piece that stands in for a
peer's own code (``"replaces"``) checks :func:`verified` and, on a version it was not verified
on, stands down: the peer's own path runs and gives the same results. Each fallback is run here
by declaring the installed version unverified, side by side with the fast path.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.peers import onnx_translate, torchao_matching, torchao_observers, versions

PEERS = Path(versions.__file__).parent
ROOT = Path(__file__).resolve().parents[2]


def test_every_piece_is_in_the_table_with_what_verified_it() -> None:
    modules = {p.stem for p in PEERS.glob("*.py")} - {"__init__", "versions", "torchao_observer_classes"}
    assert modules == set(versions.PIECES), "a module of peers/ without its table entry, or the reverse"
    for name, piece in versions.PIECES.items():
        assert piece.kind in ("replaces", "rewrites") and piece.verified_on and piece.why
        for test in piece.verified_by:
            assert (ROOT / test).is_file(), f"{name}: {test}"
        source = (PEERS / f"{name}.py").read_text(encoding="utf-8")
        if piece.kind == "replaces":  # stands down on an unverified version
            assert f'verified("{name}"' in source, name


def test_the_installed_peers_are_the_verified_ones() -> None:
    """The suite runs the fast paths: if this fails, a peer was upgraded and every "replaces"
    piece stood down; re-verify them on the new version and extend the table."""
    pytest.importorskip("torchao")
    assert all(versions.verified(name) for name in versions.PIECES)


@pytest.fixture
def unverified(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Declare the installed version of a piece's peers unverified (as a newer release would be)."""

    def declare(name: str) -> None:
        piece = versions.PIECES[name]
        stale = versions.PeerPiece(
            piece.module, {d: ("0.0.0-not-this",) for d in piece.verified_on}, piece.kind, piece.why
        )
        monkeypatch.setitem(versions.PIECES, name, stale)
        onnx_translate._internals.cache_clear()

    yield declare
    onnx_translate._internals.cache_clear()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)) + torch.sigmoid(x).mean()
        return self.fc(torch.flatten(torch.nn.functional.max_pool2d(y, 2), 1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


def _inputs(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 12, 12, generator=g) for _ in range(n)]


def _reference_quantized() -> tuple[torch.fx.GraphModule, Any]:
    """The small net exported, prepared with ``reference`` (min/max), calibrated and converted."""
    program = torch.export.export(_net(), (_inputs()[0],))
    quantizer = quantplug.get_quantizer("reference", activation_observer="minmax")
    prepared = quantplug.prepare(program, quantizer)
    for x in _inputs():
        prepared(x)
    return quantplug.convert(prepared), quantizer


def _x86_quantized() -> torch.fx.GraphModule:
    pytest.importorskip("torchao.quantization.pt2e")
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    program = torch.export.export(_net(), (_inputs()[0],))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = quantplug.prepare(program, quantizer)
        for x in _inputs():
            prepared(x)
        return quantplug.convert(prepared)


def _qdq(gm: torch.fx.GraphModule) -> list[tuple[str, str, tuple[Any, ...]]]:
    """Every Q/DQ node: its name, op and constant arguments (scales and zero points as lists)."""
    out = []
    for n in gm.graph.nodes:
        if getattr(n.target, "namespace", None) != "quantized_decomposed":
            continue
        args = tuple(
            getattr(gm, a.target).tolist() if isinstance(a, torch.fx.Node) and a.op == "get_attr" else str(a)
            for a in n.args[1:]
        )
        out.append((n.name, str(n.target), args))
    return out


def test_partition_matching_and_torchao_observers_stand_down_with_the_same_result(unverified: Any) -> None:
    fast = _x86_quantized()
    unverified("torchao_matching")
    unverified("torchao_observers")
    assert torchao_matching._originals() == {}  # nothing of torch's or torchao's is rebound
    plain = _x86_quantized()
    assert _qdq(plain) == _qdq(fast) and _qdq(fast)
    x = _inputs(1)[0]
    assert torch.equal(plain(x), fast(x))


def test_an_unverified_torchao_keeps_its_own_observer_classes(unverified: Any) -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    assert type(torchao_observers.accelerate(ao.HistogramObserver())) is not ao.HistogramObserver
    unverified("torchao_observers")
    obs = torchao_observers.accelerate(ao.HistogramObserver())
    assert type(obs) is ao.HistogramObserver
    obs(torch.randn(100))
    (scale, zp), *_ = torchao_observers.calculate_qparams_many([obs])
    ref_scale, ref_zp = obs.calculate_qparams()
    assert torch.equal(scale, ref_scale) and torch.equal(zp, ref_zp)


def test_the_public_onnx_exporter_runs_where_its_internals_are_unverified(unverified: Any) -> None:
    pytest.importorskip("onnxruntime")
    quantized, quantizer = _reference_quantized()
    fast = quantplug.lower(quantized, quantizer)
    unverified("onnx_translate")
    assert onnx_translate._internals() is None
    plain = quantplug.lower(quantized, quantizer)
    x = _inputs(1)[0]
    assert torch.equal(torch.as_tensor(plain.run(x)[0]), torch.as_tensor(fast.run(x)[0]))


def test_the_registry_of_torchlibs_functions_is_the_exporters() -> None:
    """Built without each function's IR, the registry holds what ``from_torchlib`` registers: the
    same functions for the same ops, in the same order (at opset 21, lowering's default)."""
    internals = onnx_translate._internals()
    assert internals is not None

    def entries(registry: Any) -> list[tuple[Any, list[tuple[Any, ...]]]]:
        return [
            (op, [(m.onnx_function, m.fx_target, m.is_custom, m.is_complex, str(m.signature)) for m in metas])
            for op, metas in registry.functions.items()
        ]

    fast = onnx_translate._from_torchlib(internals.registration, 21)
    exporters = internals.registration.ONNXRegistry.from_torchlib(opset_version=21)
    assert fast.opset_version == exporters.opset_version == 21
    assert len(fast.functions) > 400 and entries(fast) == entries(exporters)


def test_code_generation_stands_down_with_the_same_code_and_leaves_the_graph_intact(unverified: Any) -> None:
    import torch.fx.graph as fx_graph

    from _quantplug.peers import torch_codegen

    functions = {name: getattr(fx_graph, name) for name in torch_codegen._MEMOIZED}
    fast = _x86_quantized()
    assert {name: getattr(fx_graph, name) for name in functions} == functions  # torch's own, rebound
    table = fast.graph._find_nodes_lookup_table
    filed = {key: list(nodes) for key, nodes in table.table.items()}
    with torch_codegen.generating_code(fast.graph):
        assert fast.graph._find_nodes_lookup_table == ()  # hidden while the code is generated
        assert fx_graph._get_qualified_name is not functions["_get_qualified_name"]
        fast.recompile()
    assert fast.graph._find_nodes_lookup_table is table
    assert {key: list(nodes) for key, nodes in table.table.items()} == filed
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    assert fast.graph.find_nodes(op="call_function", target=quantize)
    unverified("torch_codegen")
    unverified("torch_python_code")
    plain = _x86_quantized()  # torch.fx's own code generation throughout
    assert plain.code == fast.code and "quantize_per_tensor" in fast.code
    with torch_codegen.generating_code(plain.graph):  # stood down: nothing hidden, nothing rebound
        assert not isinstance(plain.graph._find_nodes_lookup_table, tuple)
        assert fx_graph._get_qualified_name is functions["_get_qualified_name"]


class Odd(nn.Module):
    """What exported programs print: getitem of tuples, kwargs, None, dtypes, devices, memory
    formats, lists, slices, infinities and NaN, keyword inputs and a nested output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.LayerNorm(10, elementwise_affine=False)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> Any:
        y = self.conv(x).contiguous(memory_format=torch.channels_last)
        top, where = torch.max(y, dim=1, keepdim=True)
        first, second = torch.split(y, [1, 3], dim=1)
        z = torch.nan_to_num(first[:, :, 1:9, ::2], nan=float("nan"), posinf=float("inf"))
        z = z.masked_fill(z > 10, float("-inf")) * scale
        ones = torch.ones(2, 1, 10, 10, dtype=torch.float16, device="cpu").to(torch.float32)
        return (self.norm(second.sum(dim=(1,), keepdim=True) + ones), [z, where.to(torch.int32)]), top


class Traced(nn.Module):
    """Traced: call_module, call_method, operators, getattr, Ellipsis, a dict output; the fixture
    renames two of its values after globals (``torch``, ``inf``), which the code suffixes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, getattr_):  # type: ignore[no-untyped-def]  # unannotated: no node types
        y = self.fc(x).relu() + x.shape[0]
        z = y[..., 1:3].flatten(1)
        return {"out": z * getattr_, "size": y.size(-1)}


@pytest.fixture(scope="module")
def graphs() -> dict[str, torch.fx.GraphModule]:
    """Real programs' graphs: exported (lifted and unlifted), prepared, converted and traced."""
    pytest.importorskip("torchao.quantization.pt2e")
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    torch.manual_seed(0)
    odd = torch.export.export(Odd().eval(), (torch.randn(2, 3, 12, 12),), {"scale": torch.tensor(2.0)})
    net = torch.export.export(_net(), (_inputs()[0],))
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = quantplug.prepare(net, quantizer)
        prepared(_inputs(1)[0])
        converted = quantplug.convert(prepared)
    traced = torch.fx.symbolic_trace(Traced())
    for node in traced.graph.nodes:  # values named like globals: the code renames them
        if node.name in ("relu", "flatten"):
            node._rename({"relu": "torch", "flatten": "inf"}[node.name])
    return {
        "odd exported": odd.graph_module,
        "odd module": odd.module(),
        "net module": net.module(),
        "prepared": prepared,
        "converted": converted,
        "traced": traced,
    }


@pytest.mark.parametrize(
    "name", ["odd exported", "odd module", "net module", "prepared", "converted", "traced"]
)
def test_python_code_is_torchs_text_globals_and_line_map(
    graphs: dict[str, torch.fx.GraphModule], name: str
) -> None:
    from _quantplug.peers import torch_python_code

    graph = graphs[name].graph
    theirs = torch.fx.Graph.python_code(graph, root_module="self")
    ours = torch_python_code.python_code(graph, "self")
    assert ours is not None, "the graph was left to torch's path"
    assert ours.src == theirs.src
    assert ours.globals.keys() == theirs.globals.keys()
    assert all(ours.globals[k] is theirs.globals[k] for k in theirs.globals)
    assert ours._lineno_map == theirs._lineno_map and ours._prologue_start == theirs._prologue_start


def test_python_code_leaves_to_torch_what_it_does_not_know(
    graphs: dict[str, torch.fx.GraphModule], unverified: Any
) -> None:
    from _quantplug.peers import torch_codegen, torch_python_code

    def annotated(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    typed = torch.fx.symbolic_trace(annotated)  # its placeholder has a type: torch prints it
    assert torch_python_code.python_code(typed.graph, "self") is None
    graph = graphs["converted"].graph
    assert torch_python_code.python_code(graph, "self", verbose=True) is None
    with torch_codegen.generating_code(typed.graph):
        assert typed.graph.python_code("self").src == torch.fx.Graph.python_code(typed.graph, "self").src
    assert "python_code" not in typed.graph.__dict__  # torch's method again
    unverified("torch_python_code")
    assert torch_python_code.python_code(graph, "self") is None


_OBJECTS = [None, None, getattr, float("inf"), torch.device, object(), object(), object()]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(alphabet="ab_019.-éx", max_size=7)
            | st.sampled_from(["getattr", "inf", "torch", "add_1", "_0"]),
            st.integers(0, len(_OBJECTS) - 1),
        ),
        max_size=25,
    )
)
def test_the_namespace_names_as_torchs(calls: list[tuple[str, int]]) -> None:
    """Names (suffixes, sanitizing, builtins not shadowed, one name per object) as torch.fx's."""
    import torch.fx.graph as fx_graph

    from _quantplug.peers.torch_python_code import Namespace

    ours, theirs = Namespace(), fx_graph._Namespace()
    for candidate, which in calls:
        obj = _OBJECTS[which]
        assert ours.create_name(candidate, obj) == theirs.create_name(candidate, obj), (candidate, obj)


def test_saving_a_program_checks_its_canonical_form_on_a_pickled_copy_and_writes_the_same_file(
    unverified: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("onnxruntime")
    import copy

    from torch._export.serde import serialize

    from _quantplug.peers import torch_export_save

    artifact = quantplug.lower(*_reference_quantized())
    copies: list[Any] = []
    pickled = torch_export_save._copy

    def counted(obj: Any, memo: Any = None) -> Any:
        copies.append(obj)
        return pickled(obj, memo)

    monkeypatch.setattr(torch_export_save, "_copy", counted)
    artifact.save(tmp_path / "fast")
    assert len(copies) == 1 and type(copies[0]).__name__ == "ExportedProgram"  # the check's copy
    assert serialize.copy is copy  # torch's own again
    unverified("torch_export_save")
    artifact.save(tmp_path / "plain")
    assert len(copies) == 1  # torch's deepcopy ran
    fast, plain = ((tmp_path / d / "model.pt2").read_bytes() for d in ("fast", "plain"))
    assert fast == plain and len(fast) > 1000
