"""What keeps lowering linear in the program's size and its output the same on every machine; the
errors it gives name the user's modules and parameters. No wall-clock assertions: each test pins
a property whose loss shows up in ``python -m bench.lowering`` (issue 12.10)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import _quantplug.flow.inspect
import quantplug
from _quantplug.lowering.onnx.export import compact_node_metadata, export_qdq_onnx
from _quantplug.peers import onnx_translate

from .models import batches, build, quantize
from .test_exact_mapping import check_exact

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("quantplug_qnn_htp")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parents[2]


def _program(model: str, backend: str, **options: Any) -> tuple[quantplug.Quantizer, torch.fx.GraphModule]:
    net, shape = build(model)
    program = torch.export.export(net, batches(shape, 1, seed=0)[0])
    return quantize(program, backend, options, batches(shape, 2, seed=1))


class _Forbidden(Exception):
    pass


def _forbid(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise _Forbidden(f"{getattr(owner, '__name__', owner)}.{name} was called")

    monkeypatch.setattr(owner, name, fail)


@pytest.mark.parametrize(
    "backend,options", [("reference", {}), ("qnn_htp", {"precision": "16a4w_block", "block_size": 16})]
)
def test_no_second_trace_no_decomposition_no_optimizer(
    monkeypatch, backend: str, options: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    """The costs that grew with the graph (a torch.export re-trace, the exporter's decomposition
    re-trace and type-promotion interpretation, onnxscript's quadratic rewriter) are not paid when
    nothing needs them."""
    import onnxscript.optimizer
    from torch.onnx._internal.exporter import _fx_passes

    quantizer, program = _program("transformer_block", backend, **options)
    _forbid(monkeypatch, torch.export, "export")
    _forbid(monkeypatch, torch.export.ExportedProgram, "run_decompositions")
    _forbid(monkeypatch, _fx_passes, "insert_type_promotion_nodes")
    _forbid(monkeypatch, onnxscript.optimizer, "optimize_ir")
    _forbid(monkeypatch, torch.onnx, "export")
    artifact = quantplug.lower(program, quantizer)
    assert artifact.files["model.onnx"]


def test_decomposition_runs_when_an_op_needs_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """RMSNorm, hardshrink, square and var have no torchlib translation: the exporter's
    decomposition runs (re-tracing the program), and the Q/DQ sites survive it by their keys."""
    calls = []
    original = torch.export.ExportedProgram.run_decompositions

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", spy)
    _, program = _program("decomposed", "reference")
    result = export_qdq_onnx(program)
    assert calls == [1]
    check_exact(program, result.model, result.encodings)


def test_public_exporter_gives_the_same_model(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where torch's exporter internals are missing, the public torch.onnx.export runs (slower):
    same Q/DQ placement, same values."""
    _, program = _program("sdpa", "reference")
    fast = export_qdq_onnx(program)
    monkeypatch.setattr(onnx_translate, "_internals", lambda: None)
    slow = export_qdq_onnx(program)
    check_exact(program, slow.model, slow.encodings)

    def qdq(model: Any) -> Counter[str]:
        return Counter(n.op_type for n in model.graph.node if "Linear" in n.op_type)

    assert qdq(slow.model) == qdq(fast.model)
    (x,) = batches((2, 8, 32), 1, seed=5)[0]
    runs = [
        ort.InferenceSession(r.model_bytes(), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[
            0
        ]
        for r in (fast, slow)
    ]
    np.testing.assert_array_equal(runs[0], runs[1])


def _digest(directory: Path) -> str:
    files = sorted(
        p for p in directory.iterdir() if p.name in ("model.onnx", "model.encodings", "encodings.json")
    )
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


_SCRIPT = """
import sys, torch, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {root!r})
import quantplug
from tests.lowering.test_structure import _program
torch.set_num_threads({threads})
quantizer, program = _program("transformer_block", "qnn_htp", precision="16a4w_block", block_size=16)
quantplug.lower(program, quantizer).save({out!r})
"""


def test_same_files_whatever_the_hash_seed_and_thread_count(tmp_path: Path) -> None:
    """Set iteration order (PYTHONHASHSEED) and thread count do not reach the files: this
    session's files against a fresh interpreter's, with another hash seed and thread count (and
    none of the session's warm caches)."""
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    threads = 2 if torch.get_num_threads() == 1 else 1
    quantizer, program = _program("transformer_block", "qnn_htp", precision="16a4w_block", block_size=16)
    quantplug.lower(program, quantizer).save(tmp_path / "session")
    env = {**os.environ, "PYTHONHASHSEED": seed}
    script = _SCRIPT.format(root=str(ROOT), threads=threads, out=str(tmp_path / "fresh"))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=ROOT, capture_output=True)
    assert _digest(tmp_path / "session") == _digest(tmp_path / "fresh")


# --- errors name what the user wrote --------------------------------------------------------------


def test_a_parameter_is_named_by_its_module_path() -> None:
    from _quantplug.lowering.onnx.provenance import describe

    _, program = _program("transformer_block", "qnn_htp", precision="16a8w")
    nodes = {n.name: n for n in program.graph.nodes}
    entries = [e for e in _quantplug.flow.inspect.encodings(program) if e["kind"] == "constant"]
    described = {describe(nodes[e["node"]]).split(" (")[0] for e in entries}
    assert {
        "parameter ln1.weight",
        "parameter ln2.weight",
        "parameter ln2.bias",
        "parameter fc1.weight",
    } <= described
    activation = next(e for e in _quantplug.flow.inspect.encodings(program) if e["kind"] == "activation")
    assert describe(nodes[activation["node"]]) == "model input 'x'"


def test_qnn_names_a_tensor_missing_from_the_model_by_its_parameter() -> None:
    """A Q/DQ node nothing reads is not in the ONNX model: QNN would get no encoding for it. The
    error says which parameter (a second, dangling dequantize of ln2's weight here)."""
    from quantplug_qnn_htp.lowering import onnx_encodings

    quantizer, program = _program("transformer_block", "qnn_htp", precision="16a8w")
    dq = next(
        n
        for n in program.graph.nodes
        if n.op == "call_function"
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].name == "ln2_weight_q0"
    )
    with program.graph.inserting_after(dq):
        program.graph.call_function(dq.target, dq.args, dq.kwargs)
    with pytest.raises(quantplug.LoweringError) as info:
        onnx_encodings(program, quantizer.context)
    message = str(info.value)
    assert "parameter ln2.weight" in message and "not in the exported ONNX model" in message


@torch.library.custom_op("quantplug_lowering_test::wobble", mutates_args=())
def _wobble(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_wobble.register_fake
def _(x):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


class _Wobble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantplug_lowering_test.wobble(x)


def test_an_untranslatable_op_is_named_with_its_module() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Sequential(_Wobble())).eval()
    program = torch.export.export(net, (torch.randn(2, 8),))
    quantizer, converted = quantize(program, "reference", {}, [(torch.randn(2, 8),)])
    with pytest.raises(quantplug.LoweringError) as info:
        quantplug.lower(converted, quantizer)
    message = str(info.value)
    assert "quantplug_lowering_test.wobble" in message and "in module 1.0 (_Wobble)" in message
    assert "custom_translations" in message


def test_example_inputs_must_fit_the_program() -> None:
    _, program = _program("sdpa", "reference")
    with pytest.raises(quantplug.LoweringError, match=r"example input 'x'.*\[2, 8, 31\].*\[2, 8, 32\]"):
        export_qdq_onnx(program, (torch.randn(2, 8, 31),))
    assert json.dumps(export_qdq_onnx(program, (torch.randn(2, 8, 32),)).unmapped) == "[]"


def test_renamed_inputs_and_outputs_keep_the_mapping() -> None:
    _, program = _program("sdpa", "reference")
    result = export_qdq_onnx(program, input_names=["tokens"], output_names=["logits"])
    assert result.input_names == ["tokens"] and result.output_names == ["logits"]
    check_exact(program, result.model, result.encodings)
    assert result.tensor_encodings["tokens"]["kind"] == "activation"
    assert "logits" in result.tensor_encodings


def test_half_precision_programs_cast_around_their_qdq() -> None:
    """A float16 program: QuantizeLinear reads a float32 Cast of the activation, DequantizeLinear
    is followed by a Cast back; the encodings name what the model's ops read."""
    net, shape = build("sdpa")
    net = net.half()
    x = torch.randn(shape).half()
    _, program = quantize(torch.export.export(net, (x,)), "reference", {}, [(x,)])
    result = export_qdq_onnx(program)
    check_exact(program, result.model, result.encodings)
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["Cast"] >= ops["QuantizeLinear"] + ops["DequantizeLinear"]
    session = ort.InferenceSession(result.model_bytes(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": x.numpy()})
    assert out.dtype == np.float16
    step = max(e["scale"] for e in result.encodings if e["kind"] == "activation")
    assert float(np.abs(out.astype(np.float32) - program(x).float().numpy()).max()) <= 2 * step


def test_opsets_from_18() -> None:
    """torch's translations are opset-18 ONNX: converted up exactly; down, they would not load."""
    _, program = _program("sdpa", "reference")
    (x,) = batches((2, 8, 32), 1, seed=5)[0]
    expected = program(x).numpy()
    for opset in (18, 19, 21, 23):
        result = export_qdq_onnx(program, opset=opset)
        assert [i.version for i in result.model.opset_import if i.domain == ""] == [opset]
        check_exact(program, result.model, result.encodings)
        session = ort.InferenceSession(result.model_bytes(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(session.run(None, {"x": x.numpy()})[0], expected)
    with pytest.raises(quantplug.LoweringError, match="opset 17 is not supported: use 18 to"):
        export_qdq_onnx(program, opset=17)


class _DashedNames(nn.Module):
    """Modules registered under names that are not identifiers (RegNet's ``block1-0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("stem-0", nn.Conv2d(3, 4, 3))
        self.heads = nn.ModuleDict({"head 1": nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, "stem-0")(x).mean((2, 3))
        return F.hardshrink(self.heads["head 1"](y))  # hardshrink: the exporter's decomposition runs


@pytest.mark.parametrize("preset", ["weight_only_int4", "int8"])
def test_module_names_that_are_not_identifiers_lower(preset: str) -> None:
    """The float conv's weight (weight_only_int4 quantizes linears only) becomes a placeholder
    named after ``stem-0``; the exporter's decomposition (hardshrink has no ONNX translation)
    regenerates the program's code from those names: it used to fail with a SyntaxError."""
    model = _DashedNames().eval()
    x = torch.randn(2, 3, 8, 8)
    quantizer = quantplug.get_quantizer("reference", preset=preset)
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    prepared(x)
    converted = quantplug.convert(prepared)
    artifact = quantplug.lower(converted, quantizer)
    assert torch.allclose(torch.as_tensor(artifact.run(x)), converted(x), atol=1e-4)


@pytest.mark.parametrize(
    "backend,options", [("reference", {}), ("qnn_htp", {"precision": "16a4w_block", "block_size": 16})]
)
def test_the_artifact_keeps_only_each_nodes_module_path(backend: str, options: dict[str, Any]) -> None:
    """The exporter notes a stack trace, the FX node's text, class hierarchy and name scopes on
    every ONNX node; the shipped model keeps the module path (``namespace``) of every node that
    had one, and nothing else of them (the model as exported had them all)."""
    quantizer, program = _program("transformer_block", backend, **options)
    raw = export_qdq_onnx(program).model
    noted = {p.key for n in raw.graph.node for p in n.metadata_props}
    assert {"namespace", "pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node"} <= noted
    shipped = onnx.load_from_string(quantplug.lower(program, quantizer).files["model.onnx"])
    paths = {n.name: [p.value for p in n.metadata_props] for n in shipped.graph.node}
    assert all(p.key == "namespace" for n in shipped.graph.node for p in n.metadata_props)
    had = {n.name for n in raw.graph.node if any(p.key == "namespace" for p in n.metadata_props)}
    assert had and all(len(paths[name]) == 1 for name in had if name in paths)


def test_compacting_metadata_reaches_subgraphs_and_reports_the_bytes() -> None:
    """``compact_node_metadata`` walks nested graphs (an ``If``'s branches) and functions, and
    returns exactly the bytes it removed."""
    from onnx import helper

    def noted(name: str, op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> Any:
        node = helper.make_node(op, inputs, outputs, name=name, **attrs)
        node.metadata_props.add(key="namespace", value=f"m: {name}")
        node.metadata_props.add(key="pkg.torch.onnx.stack_trace", value="File x.py, line 1\n" * 20)
        return node

    branch = helper.make_graph(
        [noted("inner", "Identity", ["x"], ["y"])],
        "branch",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    graph = helper.make_graph(
        [noted("cond", "If", ["c"], ["y"], then_branch=branch, else_branch=branch)],
        "g",
        [
            helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    function = helper.make_function("local", "f", ["a"], ["b"], [noted("fn", "Identity", ["a"], ["b"])], [])
    model = helper.make_model(graph, functions=[function])
    before = model.ByteSize()
    removed = compact_node_metadata(model)
    assert removed == before - model.ByteSize() > 0
    nodes = [
        model.graph.node[0],
        *(a.g.node[0] for a in model.graph.node[0].attribute),
        model.functions[0].node[0],
    ]
    for node in nodes:
        assert [(p.key, p.value) for p in node.metadata_props] == [("namespace", f"m: {node.name}")]
