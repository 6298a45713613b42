"""The reference backend's presets beyond static int8, and its op coverage against torchao's
X86/XNNPACK quantizers. Real exported models, public API only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

import quantplug
from _quantplug.flow.inspect import encodings
from _quantplug.graph.op_names import op_name

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
qp = torch.ops.quantplug

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().float(), out.detach().float()
    noise = (ref - out).pow(2).mean()
    return float(10 * torch.log10(ref.pow(2).mean() / noise.clamp_min(1e-20)))


def quantizer(**options) -> quantplug.Quantizer:  # type: ignore[no-untyped-def]
    options.setdefault("activation_observer", "minmax")
    return quantplug.get_quantizer("reference", **options)


def convert(ep, q, batches=()) -> GraphModule:  # type: ignore[no-untyped-def]
    prepared = quantplug.prepare(ep, q)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return quantplug.convert(prepared)


def targets(gm: GraphModule) -> list:  # type: ignore[type-arg]
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


class TokenModel(nn.Module):
    """Embedding, linears with relu, a conv and a layer norm: what weight-only/dynamic presets touch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.odd = nn.Linear(64, 40)  # 64 inputs: divisible by every group size
        self.tail = nn.Linear(40, 8)  # 40 inputs: not divisible by 32 -> per-channel fallback
        self.conv = nn.Conv1d(64, 64, 3, padding=1)
        self.norm = nn.LayerNorm(64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # [B, T, 64]
        h = self.norm(h + self.conv(h.transpose(1, 2)).transpose(1, 2))
        h = self.fc2(F.relu(self.fc1(h)))
        return self.tail(F.gelu(self.odd(h)))


IDX_SHAPE = (2, 12)


def token_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50, IDX_SHAPE, generator=gen),) for _ in range(n)]


@pytest.fixture(scope="module")
def token_model():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TokenModel().eval()
    return model, torch.export.export(model, token_batches(1)[0])


def _weight_dq(gm: GraphModule, name: str) -> Node:
    """The dequantize feeding the weight of the node named ``name``."""
    node = next(n for n in gm.graph.nodes if n.name == name)
    index = 0 if node.target == aten.embedding.default else 1
    dq = node.args[index]
    assert isinstance(dq, Node), f"{name}: weight is {dq}"
    return dq


# --- presets by name --------------------------------------------------------------------------


def test_presets_are_listed_and_unknown_names_list_them() -> None:
    from quantplug_reference import configs

    assert set(configs.PRESETS) >= {
        "int8",
        "int8_per_tensor",
        "a16w8",
        "weight_only_int8",
        "weight_only_int4",
        "dynamic_int8",
    }
    backend = next(b for b in quantplug.list_backends() if b.name == "reference")
    assert backend is not None
    with pytest.raises(quantplug.OptionError) as info:
        quantplug.get_quantizer("reference", preset="int3")
    for name in configs.PRESETS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("preset", "group_size", "dtype", "qrange", "block"),
    [
        ("weight_only_int8", 0, "int8", (-127, 127), None),
        ("weight_only_int8", 32, "int8", (-127, 127), [1, 32]),
        ("weight_only_int4", 0, "int8", (-8, 7), [1, 32]),  # int4 lives in an int8 container
        ("weight_only_int4", 16, "int8", (-8, 7), [1, 16]),
    ],
)
def test_weight_only_presets(token_model, preset: str, group_size: int, dtype: str, qrange, block) -> None:  # type: ignore[no-untyped-def]
    model, ep = token_model
    q = quantizer(preset=preset, group_size=group_size)
    converted = convert(ep, q)  # no calibration: weight-only needs none
    table = encodings(converted)
    assert table and all(e["kind"] == "constant" for e in table), "activations stay float"
    # linears with a dividing group are per-block; fc 'tail' (40 inputs) falls back to per-channel
    by_tensor = {e["tensor"]: e for e in table}
    weights = ("fc1_weight_q0", "fc2_weight_q0", "odd_weight_q0")
    if preset == "weight_only_int4":  # its embedding table: int8 per row (configs.embedding_table_spec)
        emb = by_tensor["emb_weight_q0"]
        found = (emb["granularity"], emb["axis"], emb["quant_min"], emb["quant_max"])
        assert found == ("channel", 0, -127, 127)
    else:
        weights += ("emb_weight_q0",)
    for weight in weights:
        entry = by_tensor[weight]
        assert (entry["quant_min"], entry["quant_max"]) == qrange
        assert entry["dtype"] == dtype
        if block is None:
            assert entry["granularity"] == "channel" and entry["axis"] == 0
        else:
            assert entry["granularity"] == "block" and entry["block_size"] == block
    tail = by_tensor["tail_weight_q0"]
    assert tail["granularity"] == "channel", "40 inputs are not a multiple of the group: per channel"
    # convs, biases and activations are untouched
    assert _weight_dq(converted, "conv1d").op == "get_attr"
    assert not any(
        t in targets(converted) for t in (qd.quantize_per_tensor.default, qd.quantize_per_channel.default)
    )
    report = q.coverage(ep)
    assert {n.node for n in report.nodes if n.quantized} == {
        "embedding",
        "linear",
        "linear_1",
        "linear_2",
        "linear_3",
    }
    (idx,) = token_batches(1, seed=7)[0]
    expected_sqnr = 30 if "int8" in preset else 14
    assert sqnr(model(idx), converted(idx)) > expected_sqnr


def test_weight_only_int4_groups_confine_outliers() -> None:
    """An outlier weight only coarsens its own group's grid: smaller groups, smaller error."""
    lin = nn.Linear(64, 8).eval()
    with torch.no_grad():
        lin.weight[:, 0] = 2.0  # one outlier per output row
    ep = torch.export.export(lin, (torch.randn(4, 64),))
    x = torch.randn(16, 64)
    errors = {}
    for group in (0, 64, 16):  # 0: the preset's default (32)
        converted = convert(ep, quantizer(preset="weight_only_int4", group_size=group))
        errors[group] = sqnr(lin(x), converted(x))
    assert errors[16] > errors[0] > errors[64]
    assert errors[16] > errors[64] + 3


def test_dynamic_int8_quantizes_linear_inputs_per_token(token_model) -> None:  # type: ignore[no-untyped-def]
    model, ep = token_model
    q = quantizer(preset="dynamic_int8")
    converted = convert(ep, q)  # dynamic: no calibration
    ts = targets(converted)
    linears = [n for n in converted.graph.nodes if n.target == aten.linear.default]
    assert len(linears) == 4
    for linear in linears:
        x, w = linear.args[0], linear.args[1]
        assert x.target == qd.dequantize_per_token.default, linear.name  # type: ignore[union-attr]
        assert w.target == qd.dequantize_per_channel.default  # type: ignore[union-attr]
        assert len(linear.args) < 3 or linear.args[2].op == "get_attr"  # float bias  # type: ignore[union-attr]
        assert not any(u.target in (qd.quantize_per_tensor.default,) for u in linear.users)  # float output
    assert ts.count(qd.choose_qparams_per_token_asymmetric.default) == 4
    assert qd.quantize_per_tensor.default not in ts  # nothing static
    assert _weight_dq(converted, "conv1d").op == "get_attr"  # convs and embeddings stay float
    assert _weight_dq(converted, "embedding").op == "get_attr"
    weights = [e for e in encodings(converted) if e["kind"] == "constant"]
    assert len(weights) == 4 and {e["granularity"] for e in weights} == {"channel"}
    assert {(e["quant_min"], e["quant_max"]) for e in weights} == {(-64, 64)}  # weight_bits=7
    for (idx,) in token_batches(3, seed=11):
        assert sqnr(model(idx), converted(idx)) > 30


def test_dynamic_scales_follow_each_token() -> None:
    """A token 100x larger than the others does not crush their resolution (per-token scales)."""
    lin = nn.Linear(32, 16).eval()
    ep = torch.export.export(lin, (torch.randn(4, 32),))
    converted = convert(ep, quantizer(preset="dynamic_int8"))
    x = torch.randn(4, 32)
    x[0] *= 100
    ref, out = lin(x), converted(x)
    for row in range(1, 4):
        assert sqnr(ref[row], out[row]) > 30, row


def test_int8_is_the_default_preset() -> None:
    q = quantplug.get_quantizer("reference")
    assert q.options["preset"] == "int8"


class LayerScale(nn.Module):
    """A residual branch scaled by a small learned factor (ConvNeXt's and CaiT's layer scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gamma = nn.Parameter(torch.full((16,), 1e-3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * self.gamma  # type: ignore[no-any-return]


@pytest.mark.parametrize("preset", ["int8", "int8_per_tensor", "a16w8"])
@pytest.mark.parametrize("observer", ["minmax", "histogram"])
def test_narrow_activations_keep_their_resolution(preset: str, observer: str) -> None:
    """An activation spanning about 0.002 gets all its steps: the scale floor is float32's eps.
    At 2**-12 (XNNPACK's) it got 8 at either width, and Gemma 2's soft-capped logits (scores / 50)
    landed on 0 or 1 step: its int8 program kept 4 dB."""
    torch.manual_seed(0)
    model = LayerScale().eval()
    batches = [(torch.randn(8, 16),) for _ in range(4)]
    ep = torch.export.export(model, batches[0])
    converted = convert(ep, quantizer(preset=preset, activation_observer=observer), batches[:2])
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in batches[2:]])
        got = sqnr(ref, torch.cat([converted(*b) for b in batches[2:]]))
    assert float(ref.amax()) < 255 * 2**-12 and got > 30, got


@pytest.mark.parametrize("observer", ["minmax", "histogram"])
def test_16bit_activations_keep_held_out_values_beyond_the_calibrated_range(observer: str) -> None:
    """a16w8's grid covers 4 times the calibrated range: held-out inputs 3 times as wide as the
    calibration's keep 16-bit accuracy (the 8-bit weights' error dominates) instead of clipping."""
    torch.manual_seed(0)
    model = LayerScale().eval()
    with torch.no_grad():
        model.gamma.fill_(1.0)
    calibration = [(torch.randn(8, 16),) for _ in range(2)]
    wide = [(3 * torch.randn(8, 16),) for _ in range(2)]
    ep = torch.export.export(model, calibration[0])
    converted = convert(ep, quantizer(preset="a16w8", activation_observer=observer), calibration)
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in wide])
        got = sqnr(ref, torch.cat([converted(*b) for b in wide]))
    assert got > 40, got  # clipped at the calibrated range (no margin): 5.5 dB


# --- op coverage: everything torchao's X86 and XNNPACK quantizers annotate ----------------------


def _reference_ops() -> set[str]:
    from quantplug.backend import rules_from_index

    return set().union(*(m.ops for m in rules_from_index("quantplug_reference.rules")))


def test_every_op_the_x86_quantizer_annotates_has_a_rule() -> None:
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    wanted = {op_name(op) for op in x86.quantizable_ops}
    # the X86 fusions: conv/linear + unary/binary post ops
    wanted |= {"aten.relu.default", "aten.relu_.default", "aten.add.Tensor", "aten.add_.Tensor"}
    wanted |= {"aten.hardtanh.default", "aten.hardswish.default", "aten.silu.default", "aten.relu6.default"}
    assert wanted - _reference_ops() == set()


def test_every_op_the_xnnpack_quantizer_annotates_has_a_rule() -> None:
    xnn = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer_utils")
    candidates = [
        getattr(getattr(aten, name), overload)
        for name, overload in (
            ("relu", "default"),
            ("hardtanh", "default"),
            ("hardtanh_", "default"),
            ("max_pool2d", "default"),
            ("mean", "default"),
            ("mean", "dim"),
            ("permute", "default"),
            ("permute_copy", "default"),
            ("squeeze", "dim"),
            ("squeeze_copy", "dim"),
            ("adaptive_avg_pool2d", "default"),
            ("view_copy", "default"),
            ("view", "default"),
            ("slice_copy", "Tensor"),
            ("flatten", "using_ints"),
        )
    ]
    shared = {op_name(op) for op in candidates if xnn._is_share_obs_or_fq_op(op)}
    assert len(shared) == len(candidates)  # the list above is torchao's list
    annotated = {
        # OP_TO_ANNOTATOR: linear(_relu), conv(_relu, _bn, _bn_relu), conv_transpose(...), gru_io_only,
        # add(_relu), mul(_relu), cat, adaptive_avg_pool2d
        "aten.linear.default",
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv_transpose1d.default",
        "aten.conv_transpose2d.input",
        "aten.relu.default",
        "aten.relu_.default",
        "aten.gru.input",
        "aten.add.Tensor",
        "aten.add_.Tensor",
        "aten.mul.Tensor",
        "aten.mul_.Tensor",
        "aten.cat.default",
        "aten.adaptive_avg_pool2d.default",
    }
    assert set(xnn.OP_TO_ANNOTATOR) >= {
        "linear",
        "conv",
        "conv_transpose_relu",
        "gru_io_only",
        "add_relu",
        "mul_relu",
        "cat",
    }
    assert (shared | annotated) - _reference_ops() == set()


class AllOps(nn.Module):
    """Every pattern of the X86/XNNPACK quantizers in one exported graph."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm1d(8)
        self.c2 = nn.Conv2d(4, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.ct1 = nn.ConvTranspose1d(8, 8, 3, padding=1)
        self.ct2 = nn.ConvTranspose2d(8, 8, 3, padding=1)
        self.bnt = nn.BatchNorm2d(8)
        self.ctg = nn.ConvTranspose2d(8, 8, 3, padding=1, groups=2)
        self.fc = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.rms = nn.RMSNorm(8)
        with torch.no_grad():
            for bn in (self.bn1, self.bn2, self.bnt):
                bn.running_mean.uniform_(-0.2, 0.2)  # type: ignore[union-attr]
                bn.running_var.uniform_(0.5, 1.5)  # type: ignore[union-attr]

    def forward(self, x2: torch.Tensor, x1: torch.Tensor):  # type: ignore[no-untyped-def]
        a = F.relu(self.bn1(self.c1(x1)))  # conv1d-bn-relu
        b = F.relu(self.bn2(self.c2(x2)), inplace=True)  # conv2d-bn-relu_
        t = F.relu(self.bnt(self.ct2(b)))  # conv_transpose2d-bn-relu
        t = t + self.ctg(b)  # grouped transposed conv
        u = self.ct1(a)
        y = b + t
        y.add_(b)
        y = F.relu(y)  # add_-relu
        z = y * b
        z.mul_(0.5)
        z = F.relu(z)  # mul_-relu
        z = F.hardtanh(F.max_pool2d(z, 2), -1, 1)
        z = F.avg_pool2d(z, 2) + F.adaptive_avg_pool2d(z, 2)
        f = torch.flatten(z.mean(dim=(2, 3), keepdim=True), 1)
        h = torch.cat([F.relu(self.fc(f)), f], dim=-1)  # linear-relu, cat
        seq = u.permute(0, 2, 1)[:, 1:]
        o, hn = self.gru(seq)
        q = o.unsqueeze(1)
        att = F.scaled_dot_product_attention(q, q, q).squeeze(1)
        r = self.rms(att)
        m = torch.matmul(r, r.transpose(1, 2))
        return h, m, F.leaky_relu(self.fc2(r)).mean(), torch.stack([hn.squeeze(0), f], 0)


ALL_SHAPES = ((2, 4, 8, 8), (2, 4, 10))


def all_ops_batches(n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(s, generator=gen) for s in ALL_SHAPES) for _ in range(n)]


@pytest.fixture(scope="module")
def all_ops():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = AllOps().eval()
    ep = torch.export.export(model, all_ops_batches(1, 0)[0])
    q = quantizer()
    return model, ep, q, convert(ep, q, all_ops_batches(8, 1))


def test_all_patterns_are_covered(all_ops) -> None:  # type: ignore[no-untyped-def]
    _, ep, q, _ = all_ops
    present = {op_name(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv_transpose1d.default",
        "aten.conv_transpose2d.input",
        "aten.batch_norm.default",
        "aten.relu_.default",
        "aten.add_.Tensor",
        "aten.mul_.Tensor",
        "aten.gru.input",
        "aten.scaled_dot_product_attention.default",
        "aten.rms_norm.default",
        "aten.leaky_relu.default",
        "aten.stack.default",
    } <= present
    report = q.coverage(ep)
    floats = {n.op for n in report.float_nodes}
    assert floats <= {"aten.zeros.default"}, report.format()  # the GRU's initial state is a constant


def test_all_patterns_stay_close_to_float_and_fold_batch_norm(all_ops) -> None:  # type: ignore[no-untyped-def]
    model, _, _, converted = all_ops
    assert aten.batch_norm.default not in targets(converted)
    for inputs in all_ops_batches(2, 99):
        for i, (r, o) in enumerate(zip(model(*inputs), converted(*inputs))):
            assert sqnr(r, o) > 25, i


def test_relu_fuses_into_conv_transpose_add_and_mul(all_ops) -> None:  # type: ignore[no-untyped-def]
    _, _, _, converted = all_ops
    producers = set()
    for relu in converted.graph.nodes:
        if relu.target not in (aten.relu.default, aten.relu_.default):
            continue
        producer = relu.args[0]
        assert list(producer.users) == [relu], f"{producer.name} is quantized before {relu.name}"
        producers.add(producer.target)
    assert {
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv_transpose2d.input,
        aten.add_.Tensor,
        aten.mul_.Tensor,
        aten.linear.default,
    } <= producers


def test_transposed_conv_weights_are_per_output_channel(all_ops) -> None:  # type: ignore[no-untyped-def]
    """ConvTranspose weights are [in, out/groups, k...]: per-channel scales run along axis 1,
    matching the int32 bias; grouped ones fall back to one scale."""
    _, _, _, converted = all_ops
    by_tensor = {e["tensor"]: e for e in encodings(converted)}
    for name in ("ct1", "ct2"):
        weight = by_tensor[f"{name}_weight_q0"] if f"{name}_weight_q0" in by_tensor else None
        if weight is None:  # folded batch norm renames the weight
            weight = next(e for t, e in by_tensor.items() if t.startswith(name) and "weight" in t)
        assert weight["granularity"] == "channel" and weight["axis"] == 1, name
        assert len(weight["scale"]) == 8
    grouped = next(e for t, e in by_tensor.items() if t.startswith("ctg") and "weight" in t)
    assert grouped["granularity"] == "tensor"


def test_gru_is_quantized_at_its_boundary_only(all_ops) -> None:  # type: ignore[no-untyped-def]
    _, _, _, converted = all_ops
    (gru,) = [n for n in converted.graph.nodes if n.target == aten.gru.input]
    assert gru.args[0].target == qd.dequantize_per_tensor.default  # type: ignore[union-attr]
    weights = gru.args[2]
    assert all(w.op == "get_attr" for w in weights)  # type: ignore[union-attr]
    outs = [u for u in gru.users if u.target.__name__ == "getitem"]
    for out in outs:
        assert any(u.target == qd.quantize_per_tensor.default for u in out.users), out.name


class SmallTable(nn.Module):
    """RWKV's embedding: a table of about +-1e-4 (its own initialisation), then a layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        nn.init.uniform_(self.emb.weight, -1e-4, 1e-4)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.emb(ids)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("preset", ["int8", "weight_only_int8", "weight_only_int4"])
def test_a_table_of_small_values_keeps_its_resolution(preset: str) -> None:
    """Weights that are only looked up or dequantized floor their scale at float32's eps: at
    2**-12 (XNNPACK's, for integer products) this table got a step or two per row."""
    torch.manual_seed(0)
    model = SmallTable().eval()
    batches = [(torch.randint(0, 50, (4, 12)),) for _ in range(4)]
    ep = torch.export.export(model, batches[0])
    converted = convert(ep, quantizer(preset=preset), batches[:2])
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in batches[2:]])
        got = sqnr(ref, torch.cat([converted(*b) for b in batches[2:]]))
    # measured 48.9 / 69.3 / 43.6 dB; 23.6 at each with the 2**-12 floor
    assert got > {"int8": 40, "weight_only_int8": 55, "weight_only_int4": 35}[preset], got


def test_a_preset_that_quantizes_nothing_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """weight_only_int4 quantizes linear layers; on a network of convolutions (BiT, PoolFormer)
    convert gives back the float model, and the report's infinite SQNR must not pass for a
    perfect quantization."""
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    program = torch.export.export(convs, (torch.randn(1, 3, 8, 8),))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    with caplog.at_level("WARNING", logger="quantplug.flow.prepare"):
        prepared = quantplug.prepare(program, quantizer)
    assert "quantizes no node of this program" in caplog.text
    assert "preset='weight_only_int4'" in caplog.text
    assert "aten.conv2d.default x2" in caplog.text, caplog.text
    x = torch.randn(2, 3, 8, 8)
    converted = quantplug.convert(prepared)
    torch.testing.assert_close(converted(x), convs(x))
    caplog.clear()
    with caplog.at_level("WARNING", logger="quantplug.flow.prepare"):  # int8 covers convolutions
        quantplug.prepare(program, quantplug.get_quantizer("reference", preset="int8"))
    assert "quantizes no node" not in caplog.text
