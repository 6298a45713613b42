"""End-to-end tests of the ``reference`` backend on real exported models (no mocks).

Every model here is captured with ``torch.export.export`` and goes through the public API:
``get_quantizer`` -> ``prepare`` -> calibration -> ``convert`` (-> ``lower``).
"""

from __future__ import annotations

import json
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

import quantplug
from _quantplug.flow.inspect import encodings
from _quantplug.graph.op_names import op_name
from quantplug.backend import rules_from_index

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

QUANTIZE = (qd.quantize_per_tensor.default, qd.quantize_per_channel.default)
DEQUANTIZE = (qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --- helpers --------------------------------------------------------------------------------------


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref, out = ref.detach().float(), out.detach().float()
    noise = (ref - out).pow(2).mean()
    return float(10 * torch.log10(ref.pow(2).mean() / noise.clamp_min(1e-20)))


def export(model: nn.Module, *args: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model.eval(), tuple(args))


def calibrate(prepared: GraphModule, batches) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)


def quantize(ep, quantizer, batches) -> GraphModule:  # type: ignore[no-untyped-def]
    prepared = quantplug.prepare(ep, quantizer)
    calibrate(prepared, batches)
    return quantplug.convert(prepared)


def fast_quantizer(**options) -> quantplug.Quantizer:  # type: ignore[no-untyped-def]
    """A reference quantizer with min-max activation observers (quick; accuracy is not the point)."""
    options.setdefault("activation_observer", "minmax")
    return quantplug.get_quantizer("reference", **options)


def call_nodes(gm: GraphModule, target) -> list[Node]:  # type: ignore[no-untyped-def]
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def qparams_of(node: Node) -> tuple[float, int]:
    """(scale, zero point) of a per-tensor quantize/dequantize node."""
    assert node.target in (qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default), (
        node.format_node()
    )
    return float(node.args[1]), int(node.args[2])  # type: ignore[arg-type]


def output_quantize(node: Node) -> Node:
    """The single quantize that consumes ``node``'s output."""
    qs = [u for u in node.users if u.target in QUANTIZE]
    assert len(qs) == 1, f"{node.name} users: {[u.format_node() for u in node.users]}"
    return qs[0]


def input_dequantize(node: Node, index: int = 0) -> Node:
    arg = node.args[index]
    assert isinstance(arg, Node) and arg.target in DEQUANTIZE, f"{node.name} arg {index}: {arg}"
    return arg


def first_named(gm: GraphModule, name: str) -> Node:
    return next(n for n in gm.graph.nodes if n.name == name)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test builds its models from the same random stream (results do not depend on order)."""
    torch.manual_seed(0)


# --- models ---------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """conv-bn-relu, max pool, a residual block with add + relu, adaptive average pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)
        with torch.no_grad():  # non-trivial batch-norm statistics, so folding matters
            for bn in (self.bn1, self.bn2):
                bn.running_mean.uniform_(-0.2, 0.2)  # type: ignore[union-attr]
                bn.running_var.uniform_(0.5, 1.5)  # type: ignore[union-attr]
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        y = F.relu(self.bn2(self.conv2(x)))
        y = self.conv3(y)
        x = F.relu(x + y)
        x = self.avg(x).flatten(1)
        return self.fc(x)


class AttentionBlock(nn.Module):
    """Pre-norm transformer block: layer norm, q/k/v, matmul, softmax, matmul, out proj, GELU MLP."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        h = self.ln1(x)
        q = self.q(h).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.heads, hd).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


CONV_SHAPE = (2, 3, 16, 16)
ATTN_SHAPE = (2, 8, 32)


def batches(shape: tuple[int, ...], n: int = 8, seed: int = 0) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen),) for _ in range(n)]


@pytest.fixture(scope="module")
def conv_model() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet().eval()


@pytest.fixture(scope="module")
def conv_ep(conv_model: ConvNet) -> torch.export.ExportedProgram:
    return export(conv_model, torch.randn(CONV_SHAPE))


@pytest.fixture(scope="module")
def conv_quantized(conv_ep):  # type: ignore[no-untyped-def]
    """The conv net through the default reference quantizer (histogram observers), 8 batches."""
    quantizer = quantplug.get_quantizer("reference")
    return quantizer, quantize(conv_ep, quantizer, batches(CONV_SHAPE, 8, seed=1))


# --- (a), (b): accuracy ---------------------------------------------------------------------------


def test_conv_net_stays_close_to_float(conv_model, conv_quantized) -> None:  # type: ignore[no-untyped-def]
    _, converted = conv_quantized
    for (x,) in batches(CONV_SHAPE, 4, seed=99):  # held out: never seen in calibration
        assert sqnr(conv_model(x), converted(x)) > 25


def test_attention_block_stays_close_to_float() -> None:
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    ep = export(model, torch.randn(ATTN_SHAPE))
    converted = quantize(ep, quantplug.get_quantizer("reference"), batches(ATTN_SHAPE, 8, seed=1))
    for (x,) in batches(ATTN_SHAPE, 4, seed=99):
        assert sqnr(model(x), converted(x)) > 25
    # everything a transformer block needs is covered (the scalar multiply included)
    ops = {op_name(n.target) for n in converted.graph.nodes if n.op == "call_function"}
    assert {"aten.layer_norm.default", "aten.softmax.int", "aten.matmul.default", "aten.gelu.default"} <= ops
    softmax = call_nodes(converted, aten.softmax.int)[0]
    input_dequantize(softmax)
    output_quantize(softmax)


# --- (c): presets ---------------------------------------------------------------------------------


def _static_presets() -> list[str]:
    from quantplug_reference import configs

    return list(configs.STATIC_PRESETS)


@pytest.mark.parametrize("preset", _static_presets())
def test_each_preset_end_to_end(preset: str, conv_model, conv_ep, tmp_path) -> None:  # type: ignore[no-untyped-def]
    quantizer = fast_quantizer(preset=preset)
    converted = quantize(conv_ep, quantizer, batches(CONV_SHAPE, 8, seed=1))
    (x,) = batches(CONV_SHAPE, 1, seed=99)[0]
    assert sqnr(conv_model(x), converted(x)) > 25

    table = encodings(converted)
    activations = [e for e in table if e["kind"] == "activation"]
    weights = [e for e in table if e["kind"] == "constant" and e["dtype"] == "int8"]
    biases = [e for e in table if e["kind"] == "constant" and e["dtype"] == "int32"]
    assert activations and weights and len(biases) == len(weights)
    expected_act = "uint16" if preset == "a16w8" else "uint8"
    assert {e["dtype"] for e in activations} == {expected_act}
    expected_granularity = "tensor" if preset == "int8_per_tensor" else "channel"
    assert {e["granularity"] for e in weights} == {expected_granularity}
    # 16-bit activations feed no integer product; 8-bit ones get the saturation-free grid
    bound = 127 if preset == "a16w8" else 64
    assert all(e["quant_min"] == -bound and e["quant_max"] == bound for e in weights)

    files = quantplug.lower(converted, quantizer).save(tmp_path)
    assert {p.name for p in files} >= {"model.pt2", "encodings.json"}


def test_signed_activation_option(conv_model, conv_ep) -> None:  # type: ignore[no-untyped-def]
    converted = quantize(conv_ep, fast_quantizer(activation_dtype="int8"), batches(CONV_SHAPE, 8, seed=1))
    (x,) = batches(CONV_SHAPE, 1, seed=99)[0]
    assert sqnr(conv_model(x), converted(x)) > 25
    assert {e["dtype"] for e in encodings(converted) if e["kind"] == "activation"} == {"int8"}


# --- (d): fixed qparams ---------------------------------------------------------------------------


class Squash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        h = self.fc(x)
        s = torch.sigmoid(h)
        t = torch.tanh(h)
        g = F.hardsigmoid(h)
        return s, t, self.out(s * t), g.sum(dim=-1)


@pytest.mark.parametrize(("preset", "levels", "dtype"), [("int8", 256, "uint8"), ("a16w8", 65536, "uint16")])
def test_sigmoid_tanh_get_fixed_qparams(preset: str, levels: int, dtype: str) -> None:
    torch.manual_seed(0)
    model = Squash().eval()
    ep = export(model, torch.randn(4, 8))
    converted = quantize(ep, fast_quantizer(preset=preset), batches((4, 8), 16, seed=1))
    by_tensor = {e["tensor"]: e for e in encodings(converted) if e["kind"] == "activation"}
    expected = {"sigmoid": (1 / levels, 0), "hardsigmoid": (1 / levels, 0), "tanh": (2 / levels, levels // 2)}
    for name, (scale, zero_point) in expected.items():
        entry = by_tensor[name]
        assert entry["scale"] == pytest.approx(scale, rel=1e-6), name
        assert entry["zero_point"] == zero_point, name
        assert entry["dtype"] == dtype
    (x,) = batches((4, 8), 1, seed=5)[0]
    ref, out = model(x), converted(x)
    for r, o in zip(ref[:2], out[:2]):  # sigmoid and tanh on their fixed grids
        assert sqnr(r, o) > 30


def test_consumers_of_fixed_outputs_reuse_the_fixed_encoding() -> None:
    """mul(sigmoid, tanh) and sum(hardsigmoid) read the fixed grids directly: no requantization."""
    torch.manual_seed(0)
    ep = export(Squash().eval(), torch.randn(4, 8))
    converted = quantize(ep, fast_quantizer(), batches((4, 8), 8))
    for q in converted.graph.nodes:
        if q.target in QUANTIZE:
            src = q.args[0]
            assert not (isinstance(src, Node) and src.target in DEQUANTIZE), f"requantized: {q.format_node()}"
    mul = call_nodes(converted, aten.mul.Tensor)[0]
    assert qparams_of(input_dequantize(mul, 0)) == pytest.approx((1 / 256, 0))
    assert qparams_of(input_dequantize(mul, 1)) == pytest.approx((2 / 256, 128))


# --- (e): fusion ----------------------------------------------------------------------------------


def test_conv_relu_linear_relu_and_add_relu_are_fused(conv_quantized) -> None:  # type: ignore[no-untyped-def]
    _, converted = conv_quantized
    fused = 0
    for relu in call_nodes(converted, aten.relu.default):
        producer = relu.args[0]
        assert isinstance(producer, Node)
        assert producer.target in (aten.conv2d.default, aten.add.Tensor), producer.format_node()
        assert list(producer.users) == [relu]  # no quantize between producer and relu
        output_quantize(relu)  # the fused output is quantized once, after the relu
        fused += 1
    assert fused == 3  # conv1+relu, conv2+relu, add+relu

    ep = export(MLP(), torch.randn(4, 16))
    mlp = quantize(ep, fast_quantizer(), batches((4, 16), 8))
    (relu,) = call_nodes(mlp, aten.relu.default)
    assert relu.args[0].target == aten.linear.default  # type: ignore[union-attr]
    assert list(relu.args[0].users) == [relu]  # type: ignore[union-attr]
    output_quantize(relu)


# --- (f): cat -------------------------------------------------------------------------------------


class CatSame(nn.Module):
    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.on_input = on_input
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.on_input else self.fc(x)
        return self.fc(torch.cat([h, h], dim=0))


class CatBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # branch b has a much wider range than branch a
        return torch.cat([self.a(x), 10 * self.b(x).relu()], dim=-1)


def _check_one_encoding_around_cat(converted: GraphModule) -> None:
    (cat,) = call_nodes(converted, aten.cat.default)
    seen = set()
    groups = set()
    for dq in cat.args[0]:  # type: ignore[union-attr]
        assert isinstance(dq, Node) and dq.target in DEQUANTIZE, dq
        seen.add(qparams_of(dq))
        groups.add(dq.meta.get("quantplug_group"))
        q = dq.args[0]
        seen.add(qparams_of(q))  # type: ignore[arg-type]
    out_q = output_quantize(cat)
    seen.add(qparams_of(out_q))
    groups.add(out_q.meta.get("quantplug_group"))
    assert len(seen) == 1, seen
    assert len(groups) == 1, groups
    cat_entries = [e for e in encodings(converted) if e["tensor"] == "cat"]
    assert len(cat_entries) == 1


@pytest.mark.parametrize("on_input", [True, False], ids=["model-input", "linear-output"])
def test_cat_of_the_same_tensor_twice_has_one_encoding(on_input: bool) -> None:
    ep = export(CatSame(on_input), torch.randn(4, 8))
    converted = quantize(ep, fast_quantizer(), batches((4, 8), 8))
    _check_one_encoding_around_cat(converted)
    (x,) = batches((4, 8), 1, seed=3)[0]
    assert sqnr(ep.module()(x), converted(x)) > 25


def test_cat_of_two_branches_has_one_encoding() -> None:
    torch.manual_seed(0)
    model = CatBranches().eval()
    ep = export(model, torch.randn(4, 8))
    converted = quantize(ep, fast_quantizer(), batches((4, 8), 8))
    _check_one_encoding_around_cat(converted)
    (x,) = batches((4, 8), 1, seed=3)[0]
    assert sqnr(model(x), converted(x)) > 25


# --- (g): coverage --------------------------------------------------------------------------------


class PartlyCovered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(self.fc(x), dim=-1)


def test_coverage_lists_float_nodes_with_a_reason_naming_the_op() -> None:
    ep = export(PartlyCovered(), torch.randn(4, 8))
    quantizer = fast_quantizer()
    report = quantizer.coverage(ep)
    by_node = {n.node: n for n in report.nodes}
    assert by_node["linear"].quantized
    cumsum = by_node["cumsum"]
    assert not cumsum.quantized
    assert cumsum.op == "aten.cumsum.default"
    assert "aten.cumsum.default" in cumsum.reason and "reference" in cumsum.reason
    assert report.float_ops() == {"aten.cumsum.default": 1}
    assert "cumsum" in report.format()
    # coverage leaves no trace on the program
    assert all("quantization_annotation" not in n.meta for n in ep.graph.nodes)

    discarded = fast_quantizer().discard(nodes=["linear"]).coverage(ep)
    entry = {n.node: n for n in discarded.nodes}["linear"]
    assert not entry.quantized and "discarded" in entry.reason and "linear" in entry.reason


def test_attention_coverage_is_complete() -> None:
    ep = export(AttentionBlock(), torch.randn(ATTN_SHAPE))
    assert fast_quantizer().coverage(ep).float_nodes == []


# --- (h), (i): re-export, save, load; lowering ----------------------------------------------------


def test_converted_program_reexports_saves_and_loads(conv_quantized, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, converted = conv_quantized
    (x,) = batches(CONV_SHAPE, 1, seed=7)[0]
    expected = converted(x)
    exported = torch.export.export(converted, (x,))
    path = tmp_path / "quantized.pt2"
    torch.export.save(exported, str(path))
    loaded = torch.export.load(str(path))
    torch.testing.assert_close(loaded.module()(x), expected, rtol=0, atol=1e-6)
    ops = {n.target for n in loaded.graph.nodes if n.op == "call_function"}
    assert qd.quantize_per_tensor.default in ops and qd.dequantize_per_channel.default in ops


def test_lower_saves_model_and_encodings(conv_quantized, tmp_path) -> None:  # type: ignore[no-untyped-def]
    quantizer, converted = conv_quantized
    artifact = quantplug.lower(converted, quantizer)
    assert artifact.backend == "reference"
    written = artifact.save(tmp_path / "out")
    names = {p.name for p in written}
    assert {"model.pt2", "model.onnx", "encodings.json"} <= names
    doc = json.loads((tmp_path / "out" / "encodings.json").read_text())
    # the core's encodings, each with the names of its tensors in model.onnx added
    assert [{k: v for k, v in e.items() if k != "onnx"} for e in doc["encodings"]] == json.loads(
        json.dumps(encodings(converted))
    )
    assert all(e["onnx"] is not None for e in doc["encodings"])
    kinds = {e["kind"] for e in doc["encodings"]}
    assert kinds == {"activation", "constant"}
    loaded = torch.export.load(str(tmp_path / "out" / "model.pt2"))
    (x,) = batches(CONV_SHAPE, 1, seed=7)[0]
    torch.testing.assert_close(loaded.module()(x), converted(x), rtol=0, atol=1e-6)


# --- (j): the caller's objects are left alone -----------------------------------------------------


def _snapshot(model: nn.Module, ep: torch.export.ExportedProgram):  # type: ignore[no-untyped-def]
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {k: v.detach().clone() for k, v in ep.state_dict.items()},
        [n.format_node() for n in ep.graph.nodes],
        {n.name: sorted(n.meta) for n in ep.graph.nodes},
        sorted(k for k, _ in ep.graph_module.named_modules()),
    )


def _assert_same(before, after) -> None:  # type: ignore[no-untyped-def]
    for b, a in zip(before[:2], after[:2]):
        assert b.keys() == a.keys()
        for k in b:
            assert torch.equal(b[k], a[k]), k
    assert before[2] == after[2]  # same nodes (count and content)
    assert before[3] == after[3]  # no annotation or observer meta leaked
    assert before[4] == after[4]


def test_caller_model_and_program_are_not_mutated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = ConvNet().eval()
    ep = export(model, torch.randn(CONV_SHAPE))
    before = _snapshot(model, ep)
    quantizer = fast_quantizer()
    quantizer.coverage(ep)
    prepared = quantplug.prepare(ep, quantizer)
    calibrate(prepared, batches(CONV_SHAPE, 8))
    converted = quantplug.convert(prepared)
    quantplug.lower(converted, quantizer).save(tmp_path)
    converted(torch.randn(CONV_SHAPE))
    _assert_same(before, _snapshot(model, ep))
    # the caller's program still runs as the float model
    (x,) = batches(CONV_SHAPE, 1, seed=4)[0]
    torch.testing.assert_close(ep.module()(x), model(x))

    # a GraphModule is accepted too, and left alone
    gm = ep.module()
    count = len(gm.graph.nodes)
    quantplug.prepare(gm, fast_quantizer())
    assert len(gm.graph.nodes) == count
    assert not any("quantization_annotation" in n.meta for n in gm.graph.nodes)


# --- (k): overrides -------------------------------------------------------------------------------


def _linear_weight_is_float(converted: GraphModule, linear_name: str) -> bool:
    node = first_named(converted, linear_name)
    weight = node.args[1]
    return isinstance(weight, Node) and weight.op == "get_attr"


def test_set_module_name_none_keeps_that_module_float(conv_model, conv_ep) -> None:  # type: ignore[no-untyped-def]
    quantizer = fast_quantizer().set_module_name("fc", None)
    converted = quantize(conv_ep, quantizer, batches(CONV_SHAPE, 8))
    (linear,) = call_nodes(converted, aten.linear.default)
    assert _linear_weight_is_float(converted, linear.name)
    assert not any(u.target in QUANTIZE for u in linear.users)  # its output stays float
    # the convs are still quantized
    assert all(input_dequantize(c, 1) for c in call_nodes(converted, aten.conv2d.default))
    entry = {n.node: n for n in quantizer.coverage(conv_ep).nodes}["linear"]
    assert not entry.quantized and "discarded" in entry.reason
    (x,) = batches(CONV_SHAPE, 1, seed=99)[0]
    assert sqnr(conv_model(x), converted(x)) > 25


def test_set_op_none_keeps_that_op_float(conv_ep) -> None:  # type: ignore[no-untyped-def]
    quantizer = fast_quantizer().set_op(aten.add.Tensor, None)
    converted = quantize(conv_ep, quantizer, batches(CONV_SHAPE, 8))
    (add,) = call_nodes(converted, aten.add.Tensor)
    # its inputs are dequantized (their producers are quantized), its output stays float
    assert not any(u.target in QUANTIZE for u in add.users)
    # the relu after the float add keeps its own output encoding
    (relu_after_add,) = [r for r in call_nodes(converted, aten.relu.default) if r.args[0] is add]
    output_quantize(relu_after_add)


def test_discard_nodes_keeps_them_float(conv_ep) -> None:  # type: ignore[no-untyped-def]
    quantizer = fast_quantizer().discard(nodes=["conv2d_2", "linear"])
    converted = quantize(conv_ep, quantizer, batches(CONV_SHAPE, 8))
    conv3 = first_named(converted, "conv2d_2")
    assert conv3.args[1].op == "get_attr" and conv3.args[2].op == "get_attr"  # type: ignore[union-attr]
    assert _linear_weight_is_float(converted, "linear")
    input_dequantize(first_named(converted, "conv2d"), 1)  # others untouched
    floats = {n.node for n in quantizer.coverage(conv_ep).float_nodes}
    assert floats == {"conv2d_2", "linear"}


def test_set_module_type(conv_ep) -> None:  # type: ignore[no-untyped-def]
    # None: every nn.Linear stays float
    converted = quantize(conv_ep, fast_quantizer().set_module_type(nn.Linear, None), batches(CONV_SHAPE, 8))
    assert _linear_weight_is_float(converted, "linear")
    input_dequantize(first_named(converted, "conv2d"), 1)

    # a config: nn.Linear gets per-tensor weights while the convs keep per-channel ones
    per_tensor = fast_quantizer(preset="int8_per_tensor").global_config
    by_type_name = "torch.nn.modules.linear.Linear"
    for key in (nn.Linear, by_type_name):
        converted = quantize(
            conv_ep, fast_quantizer().set_module_type(key, per_tensor), batches(CONV_SHAPE, 8)
        )
        linear = first_named(converted, "linear")
        assert input_dequantize(linear, 1).target == qd.dequantize_per_tensor.default
        assert (
            input_dequantize(first_named(converted, "conv2d"), 1).target == qd.dequantize_per_channel.default
        )


# --- (l): lazy rules ------------------------------------------------------------------------------


def test_only_the_needed_rules_modules_are_imported() -> None:
    mlp_ep = export(MLP(), torch.randn(4, 16))
    quantizer = fast_quantizer()
    assert quantizer.rules.imported == []
    quantplug.prepare(mlp_ep, quantizer)
    imported = {m.rsplit(".", 1)[-1] for m in quantizer.rules.imported}
    assert imported == {"linear_rules", "activation_rules"}

    conv_ep = export(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.randn(1, 3, 8, 8))
    fresh = fast_quantizer()
    fresh.coverage(conv_ep)
    imported = {m.rsplit(".", 1)[-1] for m in fresh.rules.imported}
    assert "conv_rules" in imported and "linear_rules" not in imported


def test_each_op_has_one_rules_module() -> None:
    """The rules index lists what the modules register (tests/test_generated.py), each op once."""
    seen: set[str] = set()
    for spec in rules_from_index("quantplug_reference.rules"):
        assert not (seen & spec.ops), f"ops declared twice: {seen & spec.ops}"
        seen |= spec.ops
    assert op_name(operator.getitem) in seen


# --- (m): QAT -------------------------------------------------------------------------------------


class QatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(x.mean(dim=(2, 3)))


def test_qat_trains_and_converts() -> None:
    torch.manual_seed(0)
    model = QatNet().train()
    ep = torch.export.export(model, (torch.randn(4, 3, 8, 8),))
    quantizer = fast_quantizer(activation_observer="moving_average")
    prepared = quantplug.prepare(ep, quantizer, qat=True)
    params = [p for p in prepared.parameters() if p.requires_grad]
    assert params
    optimizer = torch.optim.SGD(params, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    x_fixed = torch.randn(4, 3, 8, 8, generator=gen)
    y_fixed = torch.randint(0, 4, (4,), generator=gen)
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(prepared(x_fixed), y_fixed)
        optimizer.zero_grad()
        loss.backward()
        assert all(
            p.grad is not None for p in params if p.dim() > 1
        )  # weights get gradients through fake-quant
        optimizer.step()
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]

    converted = quantplug.convert(prepared)
    with torch.no_grad():
        out = converted(x_fixed)
        fake = prepared(x_fixed)
    assert out.shape == (4, 4)
    assert sqnr(fake, out) > 20  # the Q/DQ program computes what QAT simulated
    assert any(n.target == qd.dequantize_per_channel.default for n in converted.graph.nodes)


def test_qat_training_leaves_the_callers_program_alone() -> None:
    torch.manual_seed(0)
    ep = torch.export.export(QatNet().train(), (torch.randn(4, 3, 8, 8),))
    before = {k: v.detach().clone() for k, v in ep.state_dict.items()}
    prepared = quantplug.prepare(ep, fast_quantizer(), qat=True)
    optimizer = torch.optim.SGD([p for p in prepared.parameters() if p.requires_grad], lr=0.1)
    loss = prepared(torch.randn(4, 3, 8, 8)).square().mean()
    loss.backward()
    optimizer.step()
    for k, v in ep.state_dict.items():
        assert torch.equal(before[k], v), k


# --- (n), (o): errors -----------------------------------------------------------------------------


def test_convert_without_calibration_names_a_node(conv_ep) -> None:  # type: ignore[no-untyped-def]
    prepared = quantplug.prepare(conv_ep, fast_quantizer())
    with pytest.raises(quantplug.CalibrationError) as info:
        quantplug.convert(prepared)
    message = str(info.value)
    names = {n.name for n in conv_ep.graph.nodes}
    assert any(f"'{name}'" in message for name in names), message
    assert "calibrat" in message


def test_no_constraint_violation_for_a_normal_model(conv_ep) -> None:  # type: ignore[no-untyped-def]
    quantizer = quantplug.get_quantizer("reference", strict=True, activation_observer="minmax")
    assert quantizer.strict
    prepared = quantplug.prepare(conv_ep, quantizer)  # would raise ConstraintViolationError
    from _quantplug.meta import STATE_KEY

    report = prepared.meta[STATE_KEY].validation
    if report is not None:
        assert report.ok and not report.violations


# --- ops added to the reference rules -------------------------------------------------------------


class DataMovement(nn.Module):
    """split/chunk/getitem, slice, select, expand, pad, pixel shuffle, upsampling, group norm, sum..."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.gn = nn.GroupNorm(2, 8)
        self.conv1d = nn.Conv1d(8, 8, 3, padding=1)
        self.emb = nn.Embedding(10, 16)

    def forward(self, x: torch.Tensor, idx: torch.Tensor):  # type: ignore[no-untyped-def]
        x = self.conv(x)
        a, b = torch.split(x, 4, dim=1)
        c, d = torch.chunk(x, 2, dim=1)
        e, f = torch.split(x, [3, 5], dim=1)
        y = (a + b) * c - d
        y = torch.cat([y, e[:, :1], f[:, 1:2]], dim=1)[:, :, 1:3]  # slice
        z = x.select(1, 0).unsqueeze(1).expand(-1, 4, -1, -1)
        y = F.pad(y, (1, 1, 1, 1))
        z = F.pad(z, (1, 1, 1, 1))
        w = F.pixel_shuffle(x, 2)
        up = F.interpolate(x, scale_factor=2, mode="nearest")
        bl = F.interpolate(x, scale_factor=2, mode="bilinear")
        g = F.hardtanh(self.gn(x))
        h = F.hardsigmoid(x).sum(dim=1)
        r = (
            F.relu6(x).mean(dim=1)
            + F.avg_pool2d(x, 2).mean()
            + F.max_pool2d(x, 2).mean(dim=(2, 3), keepdim=True)
        )
        s = self.conv1d(x.flatten(2)).squeeze(0)
        em = self.emb(idx)
        mm = torch.bmm(em, em.transpose(1, 2))
        return y, z, w, up, bl, g, h, r, s, em, mm


SHARED_OPS = (
    aten.slice.Tensor,
    aten.select.int,
    aten.expand.default,
    aten.pad.default,
    aten.pixel_shuffle.default,
    aten.upsample_nearest2d.vec,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.transpose.int,
    aten.flatten.using_ints,
)


@pytest.fixture(scope="module")
def data_movement():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = DataMovement().eval()
    idx = torch.randint(0, 10, (1, 6))
    ep = export(model, torch.randn(1, 8, 4, 4), idx)
    quantizer = fast_quantizer()
    gen = torch.Generator().manual_seed(0)
    calib = [
        (torch.randn(1, 8, 4, 4, generator=gen), torch.randint(0, 10, (1, 6), generator=gen))
        for _ in range(8)
    ]
    return model, ep, quantizer, quantize(ep, quantizer, calib)


def test_added_ops_are_covered(data_movement) -> None:  # type: ignore[no-untyped-def]
    _, ep, quantizer, _ = data_movement
    present = {op_name(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {
        "aten.split.Tensor",
        "aten.chunk.default",
        "aten.split_with_sizes.default",
        "_operator.getitem",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.expand.default",
        "aten.pad.default",
        "aten.pixel_shuffle.default",
        "aten.upsample_nearest2d.vec",
        "aten.upsample_bilinear2d.vec",
        "aten.group_norm.default",
        "aten.hardsigmoid.default",
        "aten.sum.dim_IntList",
        "aten.conv1d.default",
        "aten.embedding.default",
        "aten.bmm.default",
        "aten.hardtanh.default",
        "aten.relu6.default",
        "aten.avg_pool2d.default",
        "aten.max_pool2d.default",
        "aten.mean.dim",
        "aten.mean.default",
    } <= present
    report = quantizer.coverage(ep)
    assert report.float_nodes == [], report.format()


def test_added_ops_stay_close_to_float(data_movement) -> None:  # type: ignore[no-untyped-def]
    model, _, _, converted = data_movement
    gen = torch.Generator().manual_seed(42)
    x, idx = torch.randn(1, 8, 4, 4, generator=gen), torch.randint(0, 10, (1, 6), generator=gen)
    for i, (r, o) in enumerate(zip(model(x, idx), converted(x, idx))):
        assert sqnr(r, o) > 25, i


def test_data_movement_shares_its_input_encoding(data_movement) -> None:  # type: ignore[no-untyped-def]
    _, _, _, converted = data_movement
    checked = set()
    for node in converted.graph.nodes:
        if node.op != "call_function" or node.target not in SHARED_OPS:
            continue
        assert qparams_of(input_dequantize(node)) == qparams_of(output_quantize(node)), node.name
        checked.add(node.target)
    assert checked == set(SHARED_OPS), set(SHARED_OPS) - checked
    # bilinear interpolation and sum re-measure their outputs
    for target in (aten.upsample_bilinear2d.vec, aten.sum.dim_IntList):
        (node,) = call_nodes(converted, target)
        input_dequantize(node)
        output_quantize(node)


def test_split_pieces_share_the_split_input_encoding(data_movement) -> None:  # type: ignore[no-untyped-def]
    _, _, _, converted = data_movement
    splits = [
        n
        for n in converted.graph.nodes
        if n.target in (aten.split.Tensor, aten.chunk.default, aten.split_with_sizes.default)
    ]
    assert len(splits) == 3
    for split in splits:
        source = qparams_of(input_dequantize(split))
        pieces = [u for u in split.users if u.target is operator.getitem]
        assert len(pieces) == 2
        for piece in pieces:
            assert qparams_of(output_quantize(piece)) == source, piece.name
        assert not any(u.target in QUANTIZE for u in split.users)  # the tuple itself carries none


def test_discarded_split_keeps_its_pieces_float() -> None:
    class Halves(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = x.chunk(2, dim=-1)
            return a * b

    ep = export(Halves(), torch.randn(2, 8))
    quantizer = fast_quantizer().discard(nodes=["chunk"])
    report = {n.node: n for n in quantizer.coverage(ep).nodes}
    assert not report["chunk"].quantized
    assert not report["getitem"].quantized and not report["getitem_1"].quantized
    assert report["mul"].quantized
    converted = quantize(ep, quantizer, batches((2, 8), 8))
    x = torch.randn(2, 8)
    a, b = x.chunk(2, dim=-1)
    assert sqnr(a * b, converted(x)) > 25


class EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


@pytest.mark.parametrize("preset", ["int8", "int8_per_tensor", "a16w8"])
def test_embedding_then_linear(preset: str) -> None:
    """int8_per_tensor: the embedding output shares the int8 table encoding and the linear reads
    uint8, so the edge is requantized (an edge observer right after an output observer)."""
    torch.manual_seed(0)
    model = EmbeddingNet().eval()
    idx = torch.randint(0, 20, (2, 5))
    ep = export(model, idx)
    gen = torch.Generator().manual_seed(0)
    converted = quantize(
        ep, fast_quantizer(preset=preset), [(torch.randint(0, 20, (2, 5), generator=gen),) for _ in range(8)]
    )
    test_idx = torch.randint(0, 20, (2, 5), generator=gen)
    assert sqnr(model(test_idx), converted(test_idx)) > 25
