"""Lowering of the ``reference`` backend: QDQ ONNX run by ONNX Runtime, checked against the Q/DQ
program (the numerical reference). Also the backend-neutral exporter
``_quantplug.lowering.onnx.export`` it is built on."""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

import quantplug
from _quantplug.flow.inspect import encodings
from tests.reference.test_reference_flow import ATTN_SHAPE, CONV_SHAPE, AttentionBlock, ConvNet

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def batches(shape: tuple[int, ...], n: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen),) for _ in range(n)]


def quantize(model: nn.Module, shape: tuple[int, ...], *, lower: bool = True, **options):  # type: ignore[no-untyped-def]
    """(quantizer, converted program, artifact or None) of ``model`` through the reference backend."""
    options.setdefault("activation_observer", "minmax")
    ep = torch.export.export(model.eval(), batches(shape, 1, seed=0)[0])
    quantizer = quantplug.get_quantizer("reference", **options)
    prepared = quantplug.prepare(ep, quantizer)
    with torch.no_grad():
        for batch in batches(shape, 8, seed=1):
            prepared(*batch)
    converted = quantplug.convert(prepared)
    return quantizer, converted, quantplug.lower(converted, quantizer) if lower else None


def output_scale(artifact) -> float:  # type: ignore[no-untyped-def]
    """Scale of the encoding of the artifact's single output."""
    doc = json.loads(artifact.files["encodings.json"])
    out = artifact.outputs[0].name
    (entry,) = [e for e in doc["encodings"] if e["onnx"] and out in e["onnx"]["dequantized"]]
    return float(entry["scale"])


def ort_kernels(artifact, tmp_path) -> Counter:  # type: ignore[no-untyped-def,type-arg]
    """The op types of the graph ONNX Runtime actually runs (after its QDQ fusions)."""
    path = tmp_path / "optimized.onnx"
    artifact.session(optimized_model_path=str(path))
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


MLP_SHAPE = (8, 64)
MODELS = {
    "conv": (ConvNet, CONV_SHAPE),
    "mlp": (MLP, MLP_SHAPE),
    "decoder": (AttentionBlock, ATTN_SHAPE),
}


@functools.cache
def lower_model(name: str):  # type: ignore[no-untyped-def]
    """(name, float model, Q/DQ program, artifact) of one of MODELS (built once per session)."""
    ctor, shape = MODELS[name]
    torch.manual_seed(0)
    model = ctor().eval()
    _, converted, artifact = quantize(model, shape)
    return name, model, converted, artifact


@pytest.fixture(scope="module", params=list(MODELS))
def lowered(request):  # type: ignore[no-untyped-def]
    return lower_model(request.param)


# --- numerics -----------------------------------------------------------------------------------


def test_ort_is_within_one_step_of_the_qdq_program(lowered) -> None:  # type: ignore[no-untyped-def]
    name, _, converted, artifact = lowered
    shape = MODELS[name][1]
    step = output_scale(artifact)
    for (x,) in batches(shape, 4, seed=99):  # held out
        ref = converted(x)
        out = artifact.run(x)
        assert out.shape == ref.shape
        assert float((out - ref).abs().max()) <= step * 1.001, name


def test_ort_runs_integer_kernels(lowered, tmp_path) -> None:  # type: ignore[no-untyped-def]
    name, _, _, artifact = lowered
    kernels = ort_kernels(artifact, tmp_path)
    float_heavy = {
        k for k in ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul") if kernels[k]
    }
    assert not float_heavy, f"{name}: float kernels left: {kernels}"
    if name == "conv":
        assert kernels["QLinearConv"] == 3 and kernels["QLinearAdd"] == 1, kernels
    if name == "mlp":
        assert kernels["QGemm"] + kernels["QLinearMatMul"] + kernels["MatMulInteger"] == 3, kernels
    if name == "decoder":
        assert kernels["QLinearMatMul"] == 2, kernels  # q @ k^T and att @ v
        assert kernels["QGemm"] + kernels["QLinearMatMul"] == 2 + 6, kernels  # + the six linears


def test_artifact_files_and_encodings(lowered, tmp_path) -> None:  # type: ignore[no-untyped-def]
    name, _, converted, artifact = lowered
    written = {p.name for p in artifact.save(tmp_path / "out")}
    assert {"model.onnx", "encodings.json", "model.pt2", "artifact.json"} <= written
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert max(i.version for i in model.opset_import if i.domain in ("", "ai.onnx")) >= 21
    names = {v for n in model.graph.node for v in (*n.input, *n.output)} | {
        t.name for t in model.graph.initializer
    }
    doc = json.loads((tmp_path / "out" / "encodings.json").read_text())
    assert len(doc["encodings"]) == len(encodings(converted))
    nodes = {n.name: n for n in model.graph.node}
    for entry in doc["encodings"]:
        info = entry["onnx"]
        assert info is not None, entry["node"]
        assert {info["tensor"], info["quantized"], info["scale"], *info["dequantized"]} <= names
        node = nodes[info["node"]]
        if entry["kind"] == "activation":
            assert node.op_type == "QuantizeLinear" and node.input[0] == info["tensor"]
        else:
            assert node.op_type == "DequantizeLinear" and node.input[0] == info["quantized"]
            assert info["quantized"] in {t.name for t in model.graph.initializer}
    for tensor, index in doc["onnx_tensors"].items():
        info = doc["encodings"][index]["onnx"]
        assert tensor in {info["tensor"], info["quantized"], *info["dequantized"]}
    # the weights are stored as integers
    int8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8) >= sum(1 for e in doc["encodings"] if e["kind"] == "constant" and e["dtype"] == "int8")
    # model.pt2 is still the Q/DQ program
    loaded = torch.export.load(str(tmp_path / "out" / "model.pt2"))
    (x,) = batches(MODELS[name][1], 1, seed=5)[0]
    torch.testing.assert_close(loaded.module()(x), converted(x), rtol=0, atol=1e-6)


def test_numpy_in_numpy_out(lowered) -> None:  # type: ignore[no-untyped-def]
    name, _, converted, artifact = lowered
    (x,) = batches(MODELS[name][1], 1, seed=5)[0]
    out = artifact.run(x.numpy().astype("float64"))  # float64 is cast to the model's float32
    assert type(out).__name__ == "ndarray"
    assert abs(out - converted(x).numpy()).max() <= output_scale(artifact) * 1.001


# --- errors -------------------------------------------------------------------------------------


def test_wrong_inputs_name_the_expected_shapes() -> None:
    _, _, _, artifact = lower_model("mlp")
    from quantplug_reference.lowering import ArtifactInputError

    with pytest.raises(ArtifactInputError) as info:
        artifact.run(torch.randn(3, 64))
    message = str(info.value)
    assert "[3, 64]" in message and "[8, 64]" in message and "'x'" in message
    with pytest.raises(ArtifactInputError, match=r"takes 1 input.*x: float32\[8, 64\].*got 2"):
        artifact.run(torch.randn(8, 64), torch.randn(8, 64))
    with pytest.raises(ArtifactInputError, match="dtype int64"):
        artifact.run(torch.zeros(8, 64, dtype=torch.int64))
    assert isinstance(info.value, quantplug.QuantplugError)


@torch.library.custom_op("quantplug_test::wobble", mutates_args=())
def _wobble(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_wobble.register_fake
def _(x):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


class Wobbly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantplug_test.wobble(self.fc(x))


class Histogram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.histc(self.fc(x), bins=4)


@pytest.mark.parametrize(
    ("model", "op"), [(Wobbly, "quantplug_test.wobble.default"), (Histogram, "aten.histc.default")]
)
def test_unexportable_op_is_a_lowering_error_naming_it(model, op: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(quantplug.LoweringError) as info:
        quantize(model(), (4, 8))
    assert op in str(info.value)


def test_missing_onnx_is_a_clear_lowering_error(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from _quantplug.lowering.onnx import export as onnx_export

    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(quantplug.LoweringError, match="pip install onnx onnxscript"):
        onnx_export.require_onnx()


# --- other presets through ONNX -----------------------------------------------------------------


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 48)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.emb(idx) + x)))


def _token_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (2, 6), generator=gen), torch.randn(2, 6, 64, generator=gen)


@pytest.mark.parametrize(
    ("preset", "options"),
    [
        ("weight_only_int4", {}),
        ("weight_only_int8", {"group_size": 32}),
        ("weight_only_int8", {}),
        ("dynamic_int8", {}),
    ],
)
def test_weight_only_and_dynamic_presets_match_through_onnx(preset: str, options, tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TokenMLP().eval()
    ep = torch.export.export(model, _token_inputs(0))
    quantizer = quantplug.get_quantizer("reference", preset=preset, **options)
    converted = quantplug.convert(quantplug.prepare(ep, quantizer))
    artifact = quantplug.lower(converted, quantizer)
    artifact.save(tmp_path / "out")
    # a user's own session of the saved file, with no option: the program's numbers
    plain = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    for seed in (1, 2):
        inputs = _token_inputs(seed)
        ref = converted(*inputs)
        torch.testing.assert_close(artifact.run(*inputs), ref, rtol=1e-4, atol=1e-5)
        feeds = {i.name: x.numpy() for i, x in zip(plain.get_inputs(), inputs)}
        torch.testing.assert_close(torch.from_numpy(plain.run(None, feeds)[0]), ref, rtol=1e-4, atol=1e-5)
    model_proto = onnx.load_from_string(artifact.onnx_model)
    ops = Counter(n.op_type for n in model_proto.graph.node)
    blocked = [
        n
        for n in model_proto.graph.node
        if n.op_type == "DequantizeLinear" and any(a.name == "block_size" and a.i > 0 for a in n.attribute)
    ]
    kernels = ort_kernels(artifact, tmp_path)
    if preset == "dynamic_int8":
        assert not ops["QuantizeLinear"]  # no static encodings
        assert kernels["MatMulInteger"] == 2, kernels  # integer products on the per-token int8 input
    elif preset == "weight_only_int4":
        # the file says MatMulNBits with float products (accuracy level 1), not the session
        nbits = [n for n in model_proto.graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) == 2 and all(
            onnx.helper.get_attribute_value(a) == 1
            for n in nbits
            for a in n.attribute
            if a.name == "accuracy_level"
        )
        assert not blocked, "the embedding table is int8 per row (spelled Cast * scale)"
        assert kernels["MatMulNBits"] == 2, kernels  # packed 4-bit weights read directly
    else:
        assert not ops["DequantizeLinear"], "int8 weights spelled Cast * scale"
        assert not kernels["DequantizeLinear"] and not kernels["MatMulNBits"], kernels  # folded at load


class Conv1DHead(nn.Module):
    """GPT-2's ``Conv1D``: ``addmm(bias, x, weight)`` with the weight stored ``[in, out]``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32) * 0.1)
        self.bias = nn.Parameter(torch.randn(32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, 64), self.weight).view(*x.shape[:-1], 32)


def test_int4_addmm_weights_run_float_products_in_any_session(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An ``[in, out]`` int4 weight that MatMulNBits cannot take as written is spelled Cast * scale
    (left a DequantizeLinear, ORT fused it into MatMulNBits at the session's accuracy level 4 and
    lowering refused the artifact: GPT-2 weight_only_int4)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 64)
    ep = torch.export.export(Conv1DHead().eval(), (x,))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    converted = quantplug.convert(quantplug.prepare(ep, quantizer))
    artifact = quantplug.lower(converted, quantizer)
    artifact.save(tmp_path / "out")
    plain = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    for seed in (1, 2):
        inputs = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(seed))
        ref = converted(inputs)
        torch.testing.assert_close(artifact.run(inputs), ref, rtol=1e-4, atol=1e-5)
        got = torch.from_numpy(plain.run(None, {plain.get_inputs()[0].name: inputs.numpy()})[0])
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert not ort_kernels(artifact, tmp_path)["MatMulNBits"]


def test_a16w8_uses_16_bit_qdq_in_onnx() -> None:
    torch.manual_seed(0)
    _, converted, artifact = quantize(MLP(), MLP_SHAPE, preset="a16w8")
    model = onnx.load_from_string(artifact.onnx_model)
    inits = {t.name: t for t in model.graph.initializer}
    consts = {
        n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute
    }
    q_zero_points = [n.input[2] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    types = {(inits.get(z) or consts.get(z)).data_type for z in q_zero_points}  # type: ignore[union-attr]
    assert types == {onnx.TensorProto.UINT16}
    step = output_scale(artifact)
    for (x,) in batches(MLP_SHAPE, 2, seed=99):
        assert float((artifact.run(x) - converted(x)).abs().max()) <= step * 1.001


@pytest.mark.parametrize(
    ("ctor", "shape", "options"),
    [
        # int8 activations in 3-D linears: ORT's MatMulAddFusion breaks them (the session would
        # not load); the artifact's sessions run without it
        (AttentionBlock, ATTN_SHAPE, {"activation_dtype": "int8"}),
        (MLP, MLP_SHAPE, {"preset": "int8_per_tensor"}),
    ],
    ids=["int8-activations", "per-tensor-weights"],
)
def test_signed_activations_and_per_tensor_weights_through_onnx(ctor, shape, options, tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    _, converted, artifact = quantize(ctor(), shape, **options)
    step = output_scale(artifact)
    (x,) = batches(shape, 1, seed=99)[0]
    assert float((artifact.run(x) - converted(x)).abs().max()) <= step * 1.001
    kernels = ort_kernels(artifact, tmp_path)
    integer = kernels["QGemm"] + kernels["QLinearMatMul"] + kernels["MatMulIntegerToFloat"]
    assert integer >= 3, kernels


# --- the exporter itself ------------------------------------------------------------------------


def test_export_qdq_onnx_maps_every_encoding(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from _quantplug.lowering.onnx.export import export_qdq_onnx

    torch.manual_seed(0)
    _, converted, _ = quantize(MLP(), MLP_SHAPE, lower=False)
    (x,) = batches(MLP_SHAPE, 1, seed=3)[0]
    result = export_qdq_onnx(converted, (x,), tmp_path / "m.onnx")
    assert result.path is not None and result.path.exists()
    assert result.unmapped == []
    assert result.input_names == ["x"] and result.inputs[0].shape == (8, 64)
    assert result.outputs[0].dtype == "float32"
    for name, entry in result.tensor_encodings.items():
        assert name in {entry["onnx"]["tensor"], entry["onnx"]["quantized"], *entry["onnx"]["dequantized"]}
    # the input's activation encoding sits on the graph input itself
    assert result.tensor_encodings["x"]["kind"] == "activation"
    # opset too old for 16-bit
    _, converted16, _ = quantize(MLP(), MLP_SHAPE, preset="a16w8", lower=False)
    with pytest.raises(quantplug.LoweringError, match="opset >= 21"):
        export_qdq_onnx(converted16, (x,), opset=17)


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((8, 64), (1, 16)),
        ((8, 64), (2, 16)),
        ((8, 64), (8, 16)),
        ((8, 64), (1, 64)),
        ((8, 64), (8, 64)),
        ((4, 6, 8), (1, 3, 4)),
        ((4, 6, 8), (1, 1, 8)),  # one block per row of each expert: blocks span the last axis
        ((4, 6, 8), (1, 6, 1)),
    ],
)
def test_onnx_block_form_matches_quantplug_per_block(shape, block) -> None:  # type: ignore[no-untyped-def]
    """The ONNX form of per-block qparams (one blocked axis, others spread out) is exact: a
    DequantizeLinear with it, run by ONNX's reference evaluator, gives quantplug's dequantize."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from _quantplug.lowering.onnx.export import onnx_block_form
    from _quantplug.observers.per_block import block_grid_shape, dequantize_per_block

    grid = block_grid_shape(block, shape)
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(grid, generator=gen) + 0.1
    zero_point = torch.randint(-3, 3, grid, generator=gen)
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    s, z, axis, b = onnx_block_form(scale, zero_point, block, shape)
    if b:  # what ONNX Runtime checks (the reference evaluator does not)
        assert s.dim() == len(shape)
        assert all(s.shape[i] == shape[i] for i in range(len(shape)) if i != axis)
        assert s.shape[axis] == -(-shape[axis] // b)
    attrs = {"axis": axis, "block_size": b} if b else ({"axis": axis} if s.dim() else {})
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "dq",
        [helper.make_tensor_value_info("q", TensorProto.INT8, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [
            numpy_helper.from_array(s.float().numpy(), "s"),
            numpy_helper.from_array(z.to(torch.int8).numpy(), "z"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    (got,) = ReferenceEvaluator(model).run(None, {"q": q.numpy()})
    expected = dequantize_per_block(q, scale, zero_point, block)
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=0)


def test_converted_program_is_not_modified_by_export() -> None:
    torch.manual_seed(0)
    model = TokenMLP().eval()
    ep = torch.export.export(model, _token_inputs(0))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    converted: GraphModule = quantplug.convert(quantplug.prepare(ep, quantizer))
    before = [n.format_node() for n in converted.graph.nodes]
    buffers = {k: v.clone() for k, v in converted.state_dict().items()}
    quantplug.lower(converted, quantizer)
    assert [n.format_node() for n in converted.graph.nodes] == before
    after = converted.state_dict()
    assert buffers.keys() == after.keys() and all(torch.equal(buffers[k], after[k]) for k in buffers)
