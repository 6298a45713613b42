"""End-to-end checks of the qnn_htp backend: real exported models through prepare/calibrate/convert."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.errors import AnnotationError, ConstraintViolationError, OptionError
from quantplug.backend import rules_from_index

pytest.importorskip("quantplug_qnn_htp")

from quantplug_qnn_htp import soc
from tests.qnn_htp.models import ConvNet

Q_OPS = (torch.ops.quantized_decomposed.quantize_per_tensor.default,)
DQ_OPS = (
    torch.ops.quantized_decomposed.dequantize_per_tensor.default,
    torch.ops.quantized_decomposed.dequantize_per_channel.default,
)


class AttnBlock(nn.Module):
    """layer_norm -> q/k/v linear -> softmax(q k^T / sqrt(d)) v -> o linear -> + x (no mask)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(32)), dim=-1)
        return self.o(torch.matmul(att, v)) + x


def _calibrated(model: nn.Module, shape: tuple[int, ...], **options):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = model.eval()
    x = torch.randn(shape)
    ep = torch.export.export(model, (x,))
    quantizer = quantplug.get_quantizer("qnn_htp", **options)
    prepared = quantplug.prepare(ep, quantizer)
    for _ in range(8):
        prepared(torch.randn(shape))
    prepared(x)
    return model, x, prepared


def _run(model: nn.Module, shape: tuple[int, ...], **options):  # type: ignore[no-untyped-def]
    model, x, prepared = _calibrated(model, shape, **options)
    quantized = quantplug.convert(prepared)
    with torch.no_grad():
        err = float((quantized(x) - model(x)).abs().max())
    return quantized, err


def _calls(gm: torch.fx.GraphModule, targets) -> list[torch.fx.Node]:  # type: ignore[no-untyped-def]
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _act_q_dtypes(gm: torch.fx.GraphModule) -> set[torch.dtype]:
    return {n.args[5] for n in _calls(gm, Q_OPS)}


def _weight_dq(gm: torch.fx.GraphModule, consumer: str) -> torch.fx.Node:
    node = next(n for n in gm.graph.nodes if n.name == consumer)
    return node.args[1]  # type: ignore[return-value]


# --- plugin surface -----------------------------------------------------------------------------


def test_backend_is_discovered_and_describes_itself() -> None:
    names = {b.name for b in quantplug.list_backends()}
    assert "qnn_htp" in names
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a8w")
    assert q.arch == 75
    assert {p.name for p in q.info.presets} == {
        "8a8w",
        "16a8w",
        "16a4w",
        "16a16w",
        "8a4w",
        "16a2w",
        "16a4w_block",
    }


def test_the_rules_cover_executorchs_ops() -> None:
    """What the rules modules register (their index: tests/test_generated.py keeps it current)."""
    total: set[str] = set()
    for rm in rules_from_index("quantplug_qnn_htp.rules"):
        assert not (total & rm.ops), f"ops declared twice: {total & rm.ops}"
        total |= rm.ops
    aten_ops = {o for o in total if o.startswith("aten.")}
    # every ATen overload of ExecuTorch 1.5.1's HTP rules, plus addmm with constant weights (a
    # FullyConnected; ExecuTorch decomposes it) and relu6 (ReluMinMax; ExecuTorch sees hardtanh)
    assert len(aten_ops) == 175 + 2
    assert {"aten.addmm.default", "aten.relu6.default"} <= aten_ops


def test_soc_table_matches_anchor() -> None:
    assert len(soc.SOC_TABLE) == 21
    assert soc.lookup("SM8650").htp_arch == 75 and soc.lookup("sm8650").vtcm_mb == 8
    assert soc.lookup("SA8797").vtcm_mb == 16 and soc.lookup("SM8350").htp_arch == 68
    assert soc.lookup("SM8850").lpai_version == 6
    with pytest.raises(OptionError, match=r"SM8650.*SM8845|SM8845.*SM8650"):
        soc.lookup("UNKNOWN_SM")


def test_unknown_soc_and_precision_list_valid_values() -> None:
    with pytest.raises(OptionError) as err:
        quantplug.get_quantizer("qnn_htp", soc_model="SM9999")
    assert "SM8650" in str(err.value) and "QCM6490" in str(err.value)
    with pytest.raises(OptionError) as err:
        quantplug.get_quantizer("qnn_htp", precision="4a4w")
    for p in ("8a8w", "16a8w", "16a4w_block"):
        assert p in str(err.value)


# --- conv net ------------------------------------------------------------------------------------

CONV_TOLERANCE = {"8a8w": 0.3, "16a8w": 0.1, "16a16w": 0.1, "16a4w": 0.5, "8a4w": 0.5, "16a2w": 1.5}


@pytest.mark.parametrize("precision", sorted(CONV_TOLERANCE))
def test_convnet_end_to_end(precision: str) -> None:
    # MinMax: ExecuTorch's default moving average clips held-out extremes (anchor 8.3)
    quantized, err = _run(
        ConvNet(), (1, 3, 16, 16), soc_model="SM8650", precision=precision, act_observer="minmax"
    )
    assert err < CONV_TOLERANCE[precision], err
    act = torch.uint16 if precision.startswith("16a") else torch.uint8
    assert _act_q_dtypes(quantized) == {act}
    w = _weight_dq(quantized, "conv2d")  # per_channel_conv defaults to True
    assert w.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
    bits = precision.split("a")[1].rstrip("w")
    expected = {"8": (-127, 127), "4": (-7, 7), "16": (-32767, 32767), "2": (-2, 1)}[bits]
    assert tuple(w.args[4:6]) == expected
    # sigmoid output has the fixed QNN encoding 1/(qmax-qmin+1), zero point 0
    sig_q = next(n for n in _calls(quantized, Q_OPS) if n.args[0].name == "sigmoid")
    assert sig_q.args[1] == pytest.approx(1 / 65536 if act == torch.uint16 else 1 / 256)
    assert sig_q.args[2] == 0


def test_cat_shares_one_encoding_except_fixed_inputs() -> None:
    quantized, _ = _run(ConvNet(), (1, 3, 16, 16), precision="8a8w")
    cat = next(n for n in quantized.graph.nodes if n.name == "cat")
    scales = [dq.args[1] for dq in cat.args[0]]
    out_q = next(iter(cat.users))
    assert scales[0] == pytest.approx(out_q.args[1])  # max_pool2d branch == cat output
    assert scales[1] == pytest.approx(1 / 256)  # sigmoid keeps its fixed grid


def test_per_tensor_16a8w_weights_are_uint8_symmetric_with_derived_bias() -> None:
    quantized, err = _run(
        ConvNet(), (1, 3, 16, 16), precision="16a8w", per_channel_conv=False, act_observer="minmax"
    )
    assert err < 0.1
    conv = next(n for n in quantized.graph.nodes if n.name == "conv2d")
    x_dq, w_dq, b_dq = conv.args[:3]
    assert w_dq.args[2] == 128 and w_dq.args[5] == torch.uint8  # zero point 128 on [0, 255]
    qparams = quantized.meta["quantplug_qparams"]
    bias_scale = (
        float(getattr(quantized, b_dq.args[1].target))
        if isinstance(b_dq.args[1], torch.fx.Node)
        else b_dq.args[1]
    )
    assert bias_scale == pytest.approx(x_dq.args[1] * w_dq.args[1], rel=1e-5)  # not collapsed to eps
    assert qparams


def test_lpbq_end_to_end_uses_blocks_and_lpbq_bias() -> None:
    quantized, err = _run(
        ConvNet(),
        (1, 3, 16, 16),
        soc_model="SM8650",
        precision="16a4w_block",
        block_size=16,
        act_observer="minmax",
    )
    assert err < 0.5
    w = _weight_dq(quantized, "conv2d_2")  # 32 input channels: 2 blocks of 16
    assert "dequantize_per_block" in str(w.target)
    assert list(w.args[3]) == [1, 16, 1, 1] and tuple(w.args[4:6]) == (-7, 7)
    block_scale = getattr(quantized, w.args[1].target)
    conv = next(n for n in quantized.graph.nodes if n.name == "conv2d_2")
    x_scale = conv.args[0].args[1]
    bias_scale = getattr(quantized, conv.args[2].args[1].target)
    expected = x_scale * block_scale.reshape(32, -1).amax(-1) / 16
    torch.testing.assert_close(bias_scale.reshape(-1), expected.reshape(-1).float(), rtol=1e-5, atol=0)
    # conv2d (3 input channels <= block size) stays 4-bit per channel
    assert (
        _weight_dq(quantized, "conv2d").target
        == torch.ops.quantized_decomposed.dequantize_per_channel.default
    )


# --- attention block -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision,tolerance", [("8a8w", 1.0), ("8a4w", 1.0)])
def test_attention_end_to_end_8bit(precision: str, tolerance: float) -> None:
    quantized, err = _run(
        AttnBlock(), (1, 8, 32), precision=precision, act_observer="minmax", per_channel_linear=True
    )
    assert err < tolerance
    assert _act_q_dtypes(quantized) == {torch.uint8}


@pytest.mark.parametrize("precision", ["16a8w", "16a4w", "16a16w"])
def test_attention_16bit_prepares_with_int16_matmul_operand(precision: str) -> None:
    from _quantplug.graph.working_copy import working_copy

    _calibrated(AttnBlock(), (1, 8, 32), soc_model="SM8650", precision=precision)  # prepare + calibrate run
    ep = torch.export.export(AttnBlock().eval(), (torch.randn(1, 8, 32),))
    prepared = working_copy(ep)
    quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision=precision).annotate(prepared)
    # QNN MatMul: with 16-bit activations input 1 is int16 symmetric (a uint16 -> int16 requant)
    matmuls = [n for n in prepared.graph.nodes if n.op == "call_function" and "matmul" in n.name]
    assert len(matmuls) == 2
    for mm in matmuls:
        ann = mm.meta["quantization_annotation"]
        in0, in1 = (ann.input_qspec_map[a] for a in mm.args[:2])
        assert in0.dtype == torch.uint16
        assert in1.dtype == torch.int16 and (in1.quant_min, in1.quant_max) == (-32767, 32767)
        assert in1.qscheme == torch.per_tensor_symmetric


def test_attention_16bit_converts() -> None:
    _, err = _run(AttnBlock(), (1, 8, 32), soc_model="SM8650", precision="16a8w", act_observer="minmax")
    assert err < 0.1


# --- validation ----------------------------------------------------------------------------------


def _prepare(model: nn.Module, shape: tuple[int, ...], **options):  # type: ignore[no-untyped-def]
    ep = torch.export.export(model.eval(), (torch.randn(shape),))
    return quantplug.prepare(ep, quantplug.get_quantizer("qnn_htp", **options))


def test_lpbq_on_v68_strict_raises_naming_nodes_and_arch() -> None:
    with pytest.raises(ConstraintViolationError) as err:
        _prepare(ConvNet(), (1, 3, 16, 16), soc_model="SM8350", precision="16a4w_block", block_size=16)
    text = str(err.value)
    assert "conv2d_2" in text and "69" in text and "68" in text
    assert "conv2d_1" not in text  # per-channel 4-bit conv: no LPBQ gate
    # V69 is fine
    _prepare(ConvNet(), (1, 3, 16, 16), soc_model="SM8450", precision="16a4w_block", block_size=16)
    # non-strict: warns and prepares
    ep = torch.export.export(ConvNet().eval(), (torch.randn(1, 3, 16, 16),))
    q = quantplug.get_quantizer(
        "qnn_htp", soc_model="SM8350", precision="16a4w_block", block_size=16, strict=False
    )
    quantplug.prepare(ep, q)


def test_16a16w_on_v69_raises_for_conv_linear_matmul() -> None:
    with pytest.raises(ConstraintViolationError) as err:
        _prepare(ConvNet(), (1, 3, 16, 16), soc_model="SM8450", precision="16a16w")
    assert "conv2d" in str(err.value) and "73" in str(err.value)
    with pytest.raises(ConstraintViolationError) as err:
        _prepare(AttnBlock(), (1, 8, 32), soc_model="SM8450", precision="16a16w")
    text = str(err.value)
    assert "linear" in text and "matmul" in text and "73" in text
    _prepare(ConvNet(), (1, 3, 16, 16), soc_model="SM8550", precision="16a16w")  # V73


def test_block_size_not_dividing_channels_names_node_and_shapes() -> None:
    class Lin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(40, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    # only a block size the user fixes is an error: exact_block_size, or a block_size_map entry
    with pytest.raises(AnnotationError) as err:
        _prepare(
            Lin(), (2, 40), soc_model="SM8650", precision="16a4w_block", block_size=16, exact_block_size=True
        )
    text = str(err.value)
    assert "linear" in text and "(8, 40)" in text and "16" in text and "exact_block_size" in text
    with pytest.raises(AnnotationError) as err:
        _prepare(Lin(), (2, 40), soc_model="SM8650", precision="16a4w_block", block_size_map="linear:16")
    assert "linear" in str(err.value) and "(8, 40)" in str(err.value)


@pytest.mark.parametrize("precision", ["16a8w", "8a8w"])
def test_act_range_margin_widens_16_bit_activation_grids_only(precision: str) -> None:
    """The default ``act_range_margin`` (4) gives every 16-bit activation 4 times the scale of
    ExecuTorch's ``act_range_margin=1`` (the same calibration, the grid covering 4 times its
    range); 8-bit grids have no steps to spare and keep theirs. The concat's shared encoding is
    widened too; fixed encodings (the sigmoid's) are not observed ranges and stay."""
    torch.manual_seed(1)  # the same weights for both
    narrow, _ = _run(ConvNet(), (1, 3, 16, 16), precision=precision, act_range_margin=1.0)
    torch.manual_seed(1)
    widened, _ = _run(ConvNet(), (1, 3, 16, 16), precision=precision)
    factor = 4.0 if precision.startswith("16a") else 1.0
    pairs = list(zip(_calls(narrow, Q_OPS), _calls(widened, Q_OPS), strict=True))
    assert pairs
    for a, b in pairs:
        wanted = a.args[1] if a.args[0].name == "sigmoid" else a.args[1] * factor
        assert b.args[1] == pytest.approx(wanted, rel=1e-6), a.args[0].name
    assert {a.args[0].name for a, _ in pairs} >= {"x", "conv2d", "relu", "cat", "add", "sigmoid"}
    with pytest.raises(OptionError, match="act_range_margin"):
        quantplug.get_quantizer("qnn_htp", precision=precision, act_range_margin=0.5)


def _encodings_after(
    batches: list[torch.Tensor], order: list[int], **options: object
) -> list[tuple[object, ...]]:
    torch.manual_seed(0)  # the same weights for every order
    ep = torch.export.export(ConvNet().eval(), (batches[0],))
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("qnn_htp", precision="16a8w", **options))
    with torch.no_grad():
        for index in order:
            prepared(batches[index])
    return [(n.args[0].name, *n.args[1:]) for n in _calls(quantplug.convert(prepared), Q_OPS)]


@settings(max_examples=6, deadline=None)
@given(order=st.permutations(range(5)))
def test_default_encodings_do_not_depend_on_the_calibration_batches_order(order: list[int]) -> None:
    """The default activation observer takes the extremes over every batch: any order of the same
    batches gives the same encodings, bit for bit (ExecuTorch's moving average does not: below)."""
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(1, 3, 16, 16, generator=g) * (1 + i) for i in range(5)]
    assert _encodings_after(batches, list(order)) == _encodings_after(batches, list(range(5)))


def test_executorch_defaults_moving_average_depends_on_the_order() -> None:
    """What the default fixes: with ``EXECUTORCH_DEFAULTS`` the first batch sets the range and
    later ones move it by 1 %, so reversing the batches changes the encodings."""
    from quantplug_qnn_htp import EXECUTORCH_DEFAULTS

    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(1, 3, 16, 16, generator=g) * (1 + i) for i in range(5)]
    forward = _encodings_after(batches, list(range(5)), **EXECUTORCH_DEFAULTS)
    assert forward != _encodings_after(batches, list(reversed(range(5))), **EXECUTORCH_DEFAULTS)
