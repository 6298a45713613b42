"""Passes before annotation: scalar lifting, decompositions, assert removal, -inf masks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.graph.working_copy import working_copy
from _quantplug.meta import STATE_KEY
from _quantplug.observers.minmax import MinMaxObserver

pytest.importorskip("quantplug_qnn_htp")

from quantplug_qnn_htp import passes
from quantplug_qnn_htp.observers import MaskAwareObserver
from quantplug_qnn_htp.rules.common import MASK_ARGS_KEY

from .models import PassesNet, build

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


def _transformed(
    model: nn.Module, example: tuple[torch.Tensor, ...], **options: object
) -> torch.fx.GraphModule:
    q = quantplug.get_quantizer("qnn_htp", **options)  # type: ignore[arg-type]
    gm = working_copy(torch.export.export(model.eval(), example))
    return q.transform_for_annotation(gm)


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_scalar_operands_are_lifted_to_tensor_constants() -> None:
    model, example, _ = build("attention")
    gm = _transformed(model, example)
    mul = next(n for n in gm.graph.nodes if n.target == aten.mul.Tensor)
    const = mul.args[1]
    assert const.op == "get_attr" and const.target == "_tensor_constant_0"  # ExecuTorch's names
    assert float(gm._tensor_constant_0) == pytest.approx(1 / math.sqrt(32))
    fill = next(n for n in gm.graph.nodes if n.target == aten.masked_fill.Tensor)  # was .Scalar
    assert fill.args[2].target == "_tensor_constant_1" and float(gm._tensor_constant_1) == -math.inf
    assert aten.masked_fill.Scalar not in _targets(gm)
    # the caller's program is untouched
    assert not hasattr(model, "_tensor_constant_0")


def test_lifted_constants_are_quantized_like_executorch() -> None:
    model, example, batches = build("attention")
    q = quantplug.get_quantizer("qnn_htp", precision="8a8w")
    prepared = quantplug.prepare(torch.export.export(model, example), q)
    for b in batches:
        prepared(*b)
    gm = quantplug.convert(prepared)
    mul = next(n for n in gm.graph.nodes if n.target == aten.mul.Tensor)
    dq = mul.args[1]
    assert dq.target == torch.ops.quantized_decomposed.dequantize_per_tensor.default
    assert dq.args[1] == pytest.approx((1 / math.sqrt(32)) / 255, rel=1e-6) and dq.args[2] == 0


def test_decompositions_and_comparisons() -> None:
    gm = _transformed(PassesNet(), (torch.randn(2, 16),))
    targets = _targets(gm)
    for gone in (
        aten.silu.default,
        aten.reciprocal.default,
        aten.expm1.default,
        aten.where.ScalarOther,
        aten.gt.Scalar,
    ):
        assert gone not in targets
    assert aten.sigmoid.default in targets and aten.exp.default in targets
    add_alpha = [n for n in gm.graph.nodes if n.target == aten.add.Tensor and n.kwargs.get("alpha")]
    assert not add_alpha  # alpha became a multiplication by a lifted constant
    gt = next(n for n in gm.graph.nodes if n.target == aten.gt.Tensor)
    assert gt.args[1].op == "get_attr" and getattr(gm, gt.args[1].target).dtype == torch.float32
    div = next(n for n in gm.graph.nodes if n.target == aten.div.Tensor)
    assert float(getattr(gm, div.args[0].target)) == 1.0  # reciprocal -> 1 / x, lifted
    # the decomposed graph computes the same function
    x = torch.randn(2, 16)
    torch.manual_seed(0)
    net = PassesNet().eval()
    torch.testing.assert_close(_transformed(net, (x,))(x), net(x))
    # and every op of it is quantized
    cov = quantplug.get_quantizer("qnn_htp").coverage(torch.export.export(net, (x,)))
    assert not cov.float_nodes, cov.format()


class RoutedRows(nn.Module):
    """Mixtral's router pattern: each token's top-2 choices flattened, then ``index // top_k``
    (an integer floor division) picks the token's row; and a float ``//`` for comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.router(x).topk(2, dim=-1).indices.flatten()
        rows = torch.arange(top.numel()) // 2
        return self.fc(x[rows]) + torch.floor_divide(x[rows], 0.25)


def test_integer_floor_divide_stays_whole_and_float_one_is_decomposed() -> None:
    """An integer ``//`` rewritten as ``floor(a / b)`` became a float index, which ``index``
    refused at the first calibration batch (IndexError in Mixtral and Qwen2-MoE)."""
    torch.manual_seed(0)
    model, x = RoutedRows().eval(), torch.randn(6, 16)
    gm = _transformed(model, (x,))
    whole = [n for n in gm.graph.nodes if n.target == aten.floor_divide.default]
    assert len(whole) == 1 and whole[0].meta["val"].dtype == torch.int64
    assert aten.floor.default in _targets(gm)  # the float one
    torch.testing.assert_close(gm(x), model(x))
    quantizer = quantplug.get_quantizer("qnn_htp", precision="16a8w")
    reasons = {n.node: n.reason for n in quantizer.coverage(torch.export.export(model, (x,))).float_nodes}
    assert set(reasons) == {"arange", "floor_divide"}, reasons  # the index arithmetic, said why
    assert all("no floating-point tensor" in r for r in reasons.values()), reasons
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    prepared(x)
    converted = quantplug.convert(prepared)
    assert quantplug.lower(converted, quantizer).files["model.onnx"]
    ref = model(x)
    assert float((converted(x) - ref).pow(2).mean() / ref.pow(2).mean()) < 1e-3


class InPlaceSilu(nn.Module):
    """``silu_`` (torchvision's ``inplace=True``), then a read of the tensor it overwrote."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        z = nn.functional.silu(y, inplace=True)
        return z * 2 + y  # y holds silu(fc(x)) by now


def test_in_place_silu_is_replaced_not_left_running() -> None:
    model, x = InPlaceSilu().eval(), torch.randn(4, 8)
    gm = _transformed(model, (x,))
    assert aten.silu_.default not in _targets(gm)  # erased, not left as dead code that runs
    assert _targets(gm).count(aten.sigmoid.default) == 1
    torch.testing.assert_close(gm(x), model(x))  # the later read of y sees silu(y)


def test_assert_tensor_metadata_is_removed() -> None:
    class Cast(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x.to(torch.float32))

    ep = torch.export.export(Cast(), (torch.randn(4),))
    assert aten._assert_tensor_metadata.default in _targets(ep.graph_module)
    gm = _transformed(Cast(), (torch.randn(4),))
    assert aten._assert_tensor_metadata.default not in _targets(gm)


# --- -inf masks --------------------------------------------------------------------------------------


class MaskVariants(nn.Module):
    """The same causal mask written four ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("mask", torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1))
        additive = torch.zeros(8, 8).masked_fill(self.mask, float("-inf"))
        self.register_buffer("additive", additive)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.proj(x)
        if self.how == "masked_fill":
            s = s.masked_fill(self.mask, float("-inf"))
        elif self.how == "finfo_min":
            s = s.masked_fill(self.mask, torch.finfo(torch.float32).min)
        elif self.how == "where":
            s = torch.where(self.mask, -1e9, s)
        else:
            s = s + self.additive
        return torch.softmax(s, dim=-1)


@pytest.mark.parametrize("how", ["masked_fill", "finfo_min", "where", "additive"])
def test_masks_keep_the_masked_tensor_resolution(how: str) -> None:
    torch.manual_seed(0)
    model = MaskVariants(how).eval()
    x = torch.randn(1, 8, 8)
    ep = torch.export.export(model, (x,))
    q = quantplug.get_quantizer("qnn_htp", precision="16a8w", act_observer="minmax", per_channel_linear=True)
    prepared = quantplug.prepare(ep, q)
    masked = [n for n in prepared.graph.nodes if n.meta.get(MASK_ARGS_KEY)]
    assert len(masked) == 1, how
    state = prepared.meta[STATE_KEY]
    obs = state.observer(prepared, state.group_of[masked[0].name])
    assert isinstance(obs, MaskAwareObserver)
    for _ in range(8):
        prepared(torch.randn(1, 8, 8))
    prepared(x)
    gm = quantplug.convert(prepared)
    q_out = next(u for u in next(n for n in gm.graph.nodes if n.name == masked[0].name).users)
    scale, zp = q_out.args[1], q_out.args[2]
    with torch.no_grad():
        real = model.proj(x)
    # ExecuTorch: -65535 in the mask -> scale ~1.0; ours keeps the data's resolution
    assert scale < 10 * (float(real.max() - real.min()) + 16) / 65535
    grid_min = (0 - zp) * scale
    assert grid_min < float(real.min()) - 15  # masked entries land 16 below the data
    with torch.no_grad():
        out, ref = gm(x), model(x)
    assert float((out - ref).abs().max()) < 2e-3  # masked weights ~0, rows still sum to 1
    assert float(out[0, 0, 1:].abs().max()) < 1e-4  # row 0 sees only position 0


def test_mask_is_excluded_from_observation_not_clipped() -> None:
    obs = MaskAwareObserver(inner=MinMaxObserver.with_args(), margin=16.0, dtype=torch.uint8)
    obs(torch.tensor([-2.0, 3.0, float("-inf"), -1e9]))
    scale, zp = obs.calculate_qparams()
    lo = (0 - int(zp)) * float(scale)
    hi = (255 - int(zp)) * float(scale)
    assert lo == pytest.approx(-18.0, abs=float(scale)) and hi == pytest.approx(3.0, abs=float(scale))
    plain = MaskAwareObserver(inner=MinMaxObserver.with_args())
    plain(torch.tensor([-2.0, 3.0]))
    s, z = plain.calculate_qparams()
    assert (
        float(s) == pytest.approx(5.0 / 255) and int(z) == 102
    )  # no mask seen: the inner observer's qparams


def test_attention_with_mask_quantizes_accurately() -> None:
    """AttnBlock (causal -inf mask) at 16a8w with min-max observers: ExecuTorch's -65535 mask gives
    max error 0.126 (anchor P11); with the mask handled it is close to the unmasked 0.0022."""
    model, example, batches = build("attention")
    q = quantplug.get_quantizer("qnn_htp", precision="16a8w", act_observer="minmax", soc_model="SM8650")
    prepared = quantplug.prepare(torch.export.export(model, example), q)
    for b in batches:
        prepared(*b)
    prepared(*example)
    gm = quantplug.convert(prepared)
    with torch.no_grad():
        err = float((gm(*example) - model(*example)).abs().max())
    assert err < 0.02, err


def test_block_size_map_check_pass_is_registered() -> None:
    names = [n for n, _ in passes.PASSES]
    assert names == [
        "qnn_htp.remove_asserts",
        "qnn_htp.fold_constant_views",
        "qnn_htp.unroll_recurrent",
        "qnn_htp.decompose_composites",
        "qnn_htp.decompose",
        "qnn_htp.cast_bool_operands",
        "qnn_htp.lift_scalars",
        "qnn_htp.mark_masks",
        "qnn_htp.check_block_size_map",
    ]


UNFOLDS = {
    "3x3, padded": dict(kernel_size=(3, 3), padding=1),
    "ConvBERT's 9x1": dict(kernel_size=(9, 1), padding=(4, 0)),
    "dilated, strided, uneven": dict(kernel_size=(2, 3), dilation=(2, 1), padding=(1, 2), stride=(2, 3)),
    "patches": dict(kernel_size=4, stride=4),
}


@pytest.mark.parametrize("options", list(UNFOLDS.values()), ids=list(UNFOLDS))
def test_im2col_becomes_data_movement_that_keeps_the_input_grid(options: dict) -> None:
    """``nn.Unfold`` exported as one ``im2col``, which torch's ONNX translator expands into ops
    whose tensors had no encoding: strict lowering refused ConvBERT. Decomposed into a pad, a
    gather of constant positions and reshapes, it moves the same values and lowers; quantized,
    its output is exactly im2col of the quantized input (the values never leave its grid)."""
    torch.manual_seed(0)
    model, x = nn.Unfold(**options).eval(), torch.randn(2, 3, 8, 10)
    gm = _transformed(model, (x,))
    assert aten.im2col.default not in _targets(gm)
    assert torch.equal(gm(x), model(x))

    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    prepared = quantplug.prepare(program, quantizer)
    prepared(x)
    converted = quantplug.convert(prepared)
    quantplug.lower(converted, quantizer)  # strict: every tensor has an encoding
    first = next(n for n in converted.graph.nodes if n.target == qd.quantize_per_tensor.default)
    scale, zero_point, low, high, dtype = first.args[1:]
    for batch_size in (2, 5):
        y = torch.randn(batch_size, 3, 8, 10)
        on_grid = qd.dequantize_per_tensor(
            qd.quantize_per_tensor(y, scale, zero_point, low, high, dtype),
            scale,
            zero_point,
            low,
            high,
            dtype,
        )
        assert torch.equal(converted(y), model(on_grid))


class RunningSoftmaxAverage(nn.Module):
    """RWKV's numerically stable recurrence: a running maximum that starts at ``zeros - 1e38``, a
    sentinel ``maximum`` and ``exp`` make vanish; the output is a softmax-weighted mean over time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def start(self, h: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(h[:, 0]) - 1e38

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        top = self.start(h)
        num, den = torch.zeros_like(h[:, 0]), torch.zeros_like(h[:, 0])
        for t in range(h.shape[1]):
            k = h[:, t]
            new_top = torch.maximum(top, k)
            old, cur = torch.exp(top - new_top), torch.exp(k - new_top)
            num, den, top = old * num + cur * k, old * den + cur, new_top
        return self.head(num / den)


class RunningSoftmaxAverageFromFirstStep(RunningSoftmaxAverage):
    """The same function with the running maximum started at the first step: no sentinel."""

    def start(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, 0]


def _held_out_sqnr(model: nn.Module, precision: str) -> float:
    torch.manual_seed(1)
    x, held_out = torch.randn(16, 6, 8), torch.randn(16, 6, 8)
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision=precision)
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    prepared(x)
    converted = quantplug.convert(prepared)
    quantplug.lower(converted, quantizer)
    with torch.no_grad():
        ref = model(held_out)
        return float(10 * torch.log10(ref.pow(2).mean() / (converted(held_out) - ref).pow(2).mean()))


@pytest.mark.parametrize("precision", ["8a8w", "16a8w"])
def test_a_sentinel_that_only_ever_holds_mask_values_is_quantized_below_zero(precision: str) -> None:
    """The sentinel's observers saw nothing but mask values: calibration ended in a
    CalibrationError ("never saw data"). Taken as real data of 0, the sentinel lands
    ``mask_margin`` below it, where ``maximum`` ignores it and ``exp`` makes it ~0: the program
    is as accurate as the same function written without the sentinel."""
    torch.manual_seed(0)
    model = RunningSoftmaxAverage().eval()
    plain = RunningSoftmaxAverageFromFirstStep().eval()
    plain.load_state_dict(model.state_dict())
    got = _held_out_sqnr(model, precision)
    assert got > 10 and abs(got - _held_out_sqnr(plain, precision)) < 0.5, got


class ResetGate(nn.Module):
    """RecurrentGemma's RG-LRU reset: ``reset + ~reset * a`` with ``reset`` a boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(self.fc(x))
        reset = (positions == 0).unsqueeze(-1)
        return self.fc(x * (reset + ~reset * a))


def test_a_boolean_operand_of_float_arithmetic_is_cast_explicitly_and_quantized() -> None:
    """torch promotes the mask inside the op; the ONNX exporter wrote a Cast whose float output
    fed the quantized Mul and Add with no encoding, and strict lowering refused RecurrentGemma."""
    torch.manual_seed(0)
    model = ResetGate().eval()
    x, positions = torch.randn(2, 6, 8), torch.arange(6).repeat(2, 1)
    gm = _transformed(model, (x, positions))
    casts = [n for n in gm.graph.nodes if n.target == aten.to.dtype]
    assert len(casts) == 2 and all(c.args[0].meta["val"].dtype == torch.bool for c in casts)
    torch.testing.assert_close(gm(x, positions), model(x, positions))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    prepared = quantplug.prepare(torch.export.export(model, (x, positions)), quantizer)
    prepared(x, positions)
    converted = quantplug.convert(prepared)
    quantplug.lower(converted, quantizer)  # strict: the cast's output has an encoding
    with torch.no_grad():
        ref = model(x, positions)
        sqnr = 10 * torch.log10(ref.pow(2).mean() / (converted(x, positions) - ref).pow(2).mean())
    assert float(sqnr) > 25, float(sqnr)


class HandWrittenLinear(nn.Module):
    """``x @ W.T (+ b)`` written out (Falcon's ``FalconLinear``), or as ``nn.Linear``."""

    def __init__(self, how: str, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 32, bias=bias)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.fc.weight, self.fc.bias
        if self.how == "linear":
            y = self.fc(x)
        else:
            wt = {"t": w.t(), "T": w.T, "transpose": w.transpose(1, 0), "permute": w.permute(1, 0)}[self.how]
            y = x @ wt if x.dim() > 2 else torch.mm(x, wt)
            y = y + b if b is not None else y
        return torch.relu(y)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["t", "T", "transpose", "permute"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("precision", ["8a8w", "16a4w_block"])
@pytest.mark.parametrize("rank", [2, 3, "3_dynamic"])
def test_a_hand_written_linear_is_quantized_as_a_linear(
    how: str, bias: bool, precision: str, rank: int | str
) -> None:
    """As a MatMul, the transposed weight took the activation grid: 16-bit per tensor at
    ``16a4w_block`` (not 4-bit per block), and no weight encoding at all at 8a8w. With a
    dynamic batch (Falcon in the zoo) the leading sizes are read by ``sym_size``."""
    shape = (6, 64) if rank == 2 else (4, 5, 64)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=8)},) if rank == "3_dynamic" else None
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(*shape, generator=g),) for _ in range(3)]
    if dynamic:
        data[1] = (torch.randn(2, 5, 64, generator=g),)
    results = []
    for written in ("linear", how):
        model = HandWrittenLinear(written, bias).eval()
        ep = torch.export.export(model, data[0], dynamic_shapes=dynamic)
        quantizer = quantplug.get_quantizer("qnn_htp", precision=precision)
        prepared = quantplug.prepare(ep, quantizer)
        for x in data:
            prepared(*x)
        converted = quantplug.convert(prepared)
        quantplug.lower(converted, quantizer)  # strict: every tensor of a quantized op encoded
        results.append([converted(*x) for x in data])
    for reference, found in zip(*results):
        torch.testing.assert_close(found, reference, rtol=0, atol=0)
