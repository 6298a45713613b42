"""Parity with ExecuTorch 1.5.1's QnnQuantizer (issue #4, point 8).

Six models x four presets run through ExecuTorch's flow (``QnnQuantizer`` + torchao
``prepare_pt2e``/``convert_pt2e``) and through ``quantplug.get_quantizer("qnn_htp", ...)`` on the
same exported program and the same calibration batches, with the same observers (ExecuTorch's
default ``MovingAverageMinMaxObserver`` for activations; ours is numerically identical).

Both converted programs are reduced to one canonical table: for every compute node, the chain of
encodings on each input (the dequantize feeding it, and any requantization chain behind it) and
the encodings of the quantize nodes on its output. Placement must be identical (same keys) and
every scale/zero point equal (relative 1e-6), except the deliberate differences listed in
``plugins/qnn_htp/README.md``; each of those is asserted explicitly here, value by value:

* ``bias``: per-tensor conv/linear biases are derived (input scale x weight scale) where
  ExecuTorch's independent int32 observer collapses to eps;
* ``concat``: the concat group uses the absolute range of everything concatenated, where
  ExecuTorch's ConcatObserver range decays (its input observers move averages into its tensors);
* ``lpbq``: LPBQ block scales are the device's 4-bit-quantized ones;
* ``mask``: ``-inf`` masks land ``mask_margin`` below the data instead of at -255 / -65535.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx import GraphModule, Node

import quantplug

os.environ.setdefault("QNN_SDK_ROOT", "")  # or ExecuTorch tries to download an SDK
pytest.importorskip("quantplug_qnn_htp")
pytest.importorskip("torchao.quantization.pt2e")
qnn = pytest.importorskip("executorch.backends.qualcomm.quantizer.quantizer")

from _quantplug.graph.attrs import attr_value  # noqa: E402
from quantplug_qnn_htp import EXECUTORCH_DEFAULTS  # noqa: E402
from quantplug_qnn_htp.observers import lpbq_effective_scales  # noqa: E402
from quantplug_qnn_htp.plugin import set_block_size_map  # noqa: E402

from .models import CASES, ConvNet, build  # noqa: E402

pytestmark = pytest.mark.executorch

EPS_16BIT = 0.0001 / 65535
REL = 1e-6


# --- canonical form of a converted program -----------------------------------------------------

_Q = ("quantize_per_tensor", "quantize_per_channel", "quantize_affine", "quantize_per_block")
_DQ = ("dequantize_per_tensor", "dequantize_per_channel", "dequantize_affine", "dequantize_per_block")


def _kind(n: Any) -> str | None:
    if not isinstance(n, Node) or n.op != "call_function":
        return None
    text = str(n.target)
    if any(k in text for k in _DQ):
        return "dq"
    if any(k in text for k in _Q):
        return "q"
    return None


def _encoding(gm: GraphModule, n: Node) -> dict[str, Any]:
    """Scale, zero point and grid of a Q/DQ node; the container dtype is not compared
    (ExecuTorch stores 16-bit activations as int32 [0, 65535], we use uint16)."""
    text = str(n.target)
    a = [attr_value(gm, x) for x in n.args]
    if "per_tensor" in text:
        return {"g": "tensor", "scale": [float(a[1])], "zp": [int(a[2])], "range": (int(a[3]), int(a[4]))}
    if "per_channel" in text:
        return {
            "g": "channel",
            "scale": [float(s) for s in a[1].reshape(-1)],
            "zp": [int(z) for z in a[2].reshape(-1)],
            "axis": int(a[3]),
            "range": (int(a[4]), int(a[5])),
        }
    if "per_block" in text:  # ours: (x, scale, zp, block_size, qmin, qmax, dtype)
        return {
            "g": "block",
            "scale": [float(s) for s in a[1].reshape(-1)],
            "zp": [int(z) for z in a[2].reshape(-1)],
            "block": tuple(int(b) for b in a[3]),
            "range": (int(a[4]), int(a[5])),
        }
    # torchao dequantize_affine(x, block_size, scale, zero_point, input_dtype, quant_min, quant_max)
    return {
        "g": "block",
        "scale": [float(s) for s in a[2].reshape(-1)],
        "zp": [int(z) for z in a[3].reshape(-1)],
        "block": tuple(int(b) for b in a[1]),
        "range": (int(a[5]), int(a[6])),
    }


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


Key = tuple[str, str]


def canonical(gm: GraphModule) -> dict[Key, list[dict[str, Any]]]:
    """``{(node, "in<i>" | "out"): [encodings]}`` over compute nodes."""
    table: dict[Key, list[dict[str, Any]]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or _kind(n) or "choose_qparams" in str(n.target):
            continue
        for i, a in enumerate(x for x in _flat(n.args) if isinstance(x, Node)):
            chain = []
            cur = a
            while _kind(cur) == "dq":
                chain.append(_encoding(gm, cur))
                src = cur.args[0]
                if _kind(src) != "q":
                    break
                cur = src.args[0]
            if chain:
                table[(n.name, f"in{i}")] = chain
        outs = [_encoding(gm, u) for u in n.users if _kind(u) == "q"]
        if outs:
            table[(n.name, "out")] = outs
    return table


def _rel(a: list[float], b: list[float]) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if x.shape != y.shape:
        return math.inf
    return float(((x - y).abs() / y.abs().clamp_min(1e-30)).max())


def differences(ours: dict[Key, Any], theirs: dict[Key, Any]) -> dict[Key, str]:
    """Keys whose placement, grid, zero points or scales (relative 1e-6) differ, with why."""
    found: dict[Key, str] = {}
    for key in sorted(set(ours) | set(theirs)):
        if key not in theirs:
            found[key] = "only quantplug quantizes it"
            continue
        if key not in ours:
            found[key] = "only ExecuTorch quantizes it"
            continue
        a, b = ours[key], theirs[key]
        if len(a) != len(b):
            found[key] = f"requantization chain of {len(a)} vs {len(b)}"
            continue
        for x, y in zip(a, b):
            for f in ("g", "range", "axis", "block"):
                if x.get(f) != y.get(f):
                    found[key] = f"{f}: {x.get(f)} vs {y.get(f)}"
                    break
            else:
                if x["zp"] != y["zp"]:
                    found[key] = f"zero point {x['zp'][:4]} vs {y['zp'][:4]}"
                elif _rel(x["scale"], y["scale"]) > REL:
                    found[key] = f"scale (relative {_rel(x['scale'], y['scale']):.3g})"
            if key in found:
                break
    return found


# --- the two flows ---------------------------------------------------------------------------------

# preset -> (QuantDtype name, ExecuTorch per-channel flags, our options)
PRESETS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "8a8w_per_channel": (
        "use_8a8w",
        True,
        {"precision": "8a8w", "per_channel_conv": True, "per_channel_linear": True},
    ),
    "16a8w": (
        "use_16a8w",
        False,
        {"precision": "16a8w", "per_channel_conv": False, "per_channel_linear": False},
    ),
    "16a4w": (
        "use_16a4w",
        True,
        {"precision": "16a4w", "per_channel_conv": True, "per_channel_linear": True},
    ),
    # LPBQ exactly on ExecuTorch's block_size_map nodes (block_size=0: no global blocks)
    "16a4w_block": ("use_16a4w_block", True, {"precision": "16a4w_block", "block_size": 0}),
}


def _silently(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def run_executorch(name: str, preset: str, **config: Any) -> GraphModule:
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    dtype, per_channel, _ = PRESETS[preset]
    model, example, batches = build(name)
    ep = torch.export.export(model, example)
    quantizer = qnn.QnnQuantizer(soc_model=QcomChipset.SM8650)
    quantizer.set_default_quant_config(
        getattr(qnn.QuantDtype, dtype),
        is_conv_per_channel=per_channel,
        is_linear_per_channel=per_channel,
        **config,
    )
    if preset == "16a4w_block":
        quantizer.set_block_size_map(dict(CASES[name].lpbq))
    prepared = _silently(lambda: prepare_pt2e(ep.module(), quantizer))
    for batch in batches:
        prepared(*batch)
    return _silently(lambda: convert_pt2e(prepared))  # type: ignore[no-any-return]


def run_quantplug(name: str, preset: str, **options: Any) -> GraphModule:
    model, example, batches = build(name)
    ep = torch.export.export(model, example)
    quantizer = quantplug.get_quantizer(
        "qnn_htp", soc_model="SM8650", **{**EXECUTORCH_DEFAULTS, **PRESETS[preset][2], **options}
    )
    if preset == "16a4w_block":
        set_block_size_map(quantizer, CASES[name].lpbq)
    prepared = quantplug.prepare(ep, quantizer)
    for batch in batches:
        prepared(*batch)
    return quantplug.convert(prepared)


@functools.cache
def compared(name: str, preset: str) -> tuple[dict[Key, Any], dict[Key, Any], dict[Key, str]]:
    ours = canonical(run_quantplug(name, preset))
    theirs = canonical(run_executorch(name, preset))
    return ours, theirs, differences(ours, theirs)


# --- deliberate differences, each checked by value ---------------------------------------------------

_WEIGHTED_PREFIXES = ("conv2d", "linear", "conv_transpose2d")


def _explain_bias(ours: Any, theirs: Any, key: Key) -> str | None:
    """Per-tensor bias: ours = input scale x weight scale, ExecuTorch's collapsed to eps."""
    node, port = key
    if port != "in2" or not node.startswith(_WEIGHTED_PREFIXES):
        return None
    ob, tb = ours[key][0], theirs[key][0]
    if ob["g"] != "tensor" or tb["g"] != "tensor":
        return None
    expected = ours[(node, "in0")][0]["scale"][0] * ours[(node, "in1")][0]["scale"][0]
    assert _rel(ob["scale"], [expected]) < REL, key
    assert _rel(tb["scale"], [EPS_16BIT]) < REL, key
    return "bias"


def _concat_range_scale(batches: list[tuple[torch.Tensor, ...]], qmax: int) -> float:
    """The absolute range of ConvNet's cat output over the calibration batches."""
    torch.manual_seed(0)
    net = ConvNet().eval()
    lo, hi = math.inf, -math.inf
    with torch.no_grad():
        for (x,) in batches:
            a = torch.nn.functional.max_pool2d(torch.relu(net.conv1(x)), 2)
            c = torch.cat([a, torch.sigmoid(net.conv2(x))], dim=1)
            lo, hi = min(lo, float(c.min())), max(hi, float(c.max()))
    return (max(hi, 0.0) - min(lo, 0.0)) / qmax


def _explain_concat(ours: Any, theirs: Any, key: Key, name: str) -> str | None:
    """ConvNet's concat group: ours = absolute range of the concatenated data; ExecuTorch's is smaller."""
    if name != "convnet":
        return None
    cat_ours, cat_theirs = ours[("cat", "out")][0], theirs[("cat", "out")][0]
    qmax = cat_ours["range"][1]
    _, _, batches = build(name)
    expected = _concat_range_scale(batches, qmax)
    assert _rel(cat_ours["scale"], [expected]) < 1e-5
    assert cat_theirs["scale"][0] < cat_ours["scale"][0]  # decayed, not the full range
    a, b = ours[key][0]["scale"], theirs[key][0]["scale"]
    if _rel(a, cat_ours["scale"] * len(a)) < REL and _rel(b, cat_theirs["scale"] * len(b)) < REL:
        return "concat"
    ratio = cat_ours["scale"][0] / cat_theirs["scale"][0]  # a bias derived from the concat scale
    if key == ("conv2d_2", "in2") and _rel([x / ratio for x in a], b) < 1e-5:
        return "concat"
    return None


def _explain_lpbq(ours: Any, theirs: Any, key: Key) -> str | None:
    """LPBQ weights: ours = ExecuTorch's fp32 block scales quantized to 4 bits, as on the device."""
    o, t = ours[key][0], theirs[key][0]
    if key[1] != "in1" or o["g"] != "block" or t["g"] != "block":
        return None
    channels = len(theirs[(key[0], "in2")][0]["scale"])  # the per-channel bias: one per output channel
    fp32 = torch.tensor(t["scale"]).reshape(channels, -1)
    device = lpbq_effective_scales(fp32).reshape(-1).tolist()
    assert _rel(o["scale"], device) < REL, key
    return "lpbq"


def _explain_mask(ours: Any, theirs: Any, key: Key) -> str | None:
    """-inf mask: ExecuTorch's grid starts at -255/-65535 (scale ~1); ours mask_margin below the data."""
    if key not in {("masked_fill", "in2"), ("masked_fill", "out"), ("softmax", "in0")}:
        return None
    o, t = ours[key][0], theirs[key][0]
    qmin, qmax = t["range"]
    their_min = (qmin - t["zp"][0]) * t["scale"][0]
    our_min = (qmin - o["zp"][0]) * o["scale"][0]
    assert their_min <= -0.99 * (qmax - qmin), key  # _replace_inf wrote -(qmax - qmin) into the mask
    assert t["scale"][0] > 0.9  # ... so the masked scores lost all resolution
    assert o["scale"][0] < t["scale"][0] / 10, key
    assert -16.0 - 10.0 < our_min < -16.0, key  # mask_margin 16 below the smallest real score
    return "mask"


def explain(name: str, ours: Any, theirs: Any, diffs: dict[Key, str]) -> dict[Key, str]:
    """Each difference's deliberate category; an unexplained one fails the test with its reason."""
    kinds: dict[Key, str] = {}
    unexplained = []
    for key, why in diffs.items():
        kind = None
        if key in ours and key in theirs and len(ours[key]) == len(theirs[key]):
            kind = (
                _explain_mask(ours, theirs, key)
                or _explain_lpbq(ours, theirs, key)
                or _explain_bias(ours, theirs, key)
                or _explain_concat(ours, theirs, key, name)
            )
        if kind is None:
            unexplained.append(f"{key}: {why}")
        else:
            kinds[key] = kind
    assert not unexplained, f"{name}: differences from ExecuTorch that are not deliberate:\n" + "\n".join(
        unexplained
    )
    return kinds


# --- the tests ----------------------------------------------------------------------------------------


def _weighted_nodes(table: dict[Key, Any]) -> set[str]:
    return {n for (n, p) in table if p == "in1" and n.startswith(_WEIGHTED_PREFIXES)}


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("name", list(CASES))
def test_same_placement_and_qparams_as_executorch(name: str, preset: str) -> None:
    ours, theirs, diffs = compared(name, preset)
    assert set(ours) == set(theirs), "Q/DQ placement differs"
    kinds = explain(name, ours, theirs, diffs)
    present = set(kinds.values())

    # every deliberate difference shows up where (and only where) it should
    expected: set[str] = set()
    if preset == "16a8w":  # per-tensor weights: derived bias on every conv/linear
        expected.add("bias")
        biased = {k[0] for k, v in kinds.items() if v == "bias"}
        assert biased == {n for n in _weighted_nodes(ours) if (n, "in2") in ours}
    if name == "convnet":
        expected.add("concat")
        assert {k for k, v in kinds.items() if v == "concat"} >= {
            ("cat", "out"),
            ("max_pool2d", "out"),
            ("conv2d_2", "in0"),
            ("add", "in1"),
        }
    if name == "attention":
        expected.add("mask")
        assert {k for k, v in kinds.items() if v == "mask"} == {
            ("masked_fill", "in2"),
            ("masked_fill", "out"),
            ("softmax", "in0"),
        }
    if preset == "16a4w_block" and CASES[name].lpbq:
        expected.add("lpbq")
        assert {k[0] for k, v in kinds.items() if v == "lpbq"} == set(CASES[name].lpbq)
    assert present == expected, (present, expected)
    # everything else matched exactly: the bulk of the model
    assert len(ours) - len(diffs) >= len(ours) // 2


@pytest.mark.parametrize("preset", ["8a8w_per_channel", "16a4w"])
def test_per_channel_embedding_is_executorchs_is_embedding_per_channel(preset: str) -> None:
    """The table on the weight grid, one scale per row; the looked-up rows on their own
    activation encoding. (Gathered parameters such as mixture-of-experts weights follow the same
    option in quantplug; ExecuTorch leaves them on the activation grid.)"""
    ours = canonical(run_quantplug("embedding", preset, per_channel_embedding=True))
    theirs = canonical(run_executorch("embedding", preset, is_embedding_per_channel=True))
    assert set(ours) == set(theirs), "Q/DQ placement differs"
    (table,) = ours[("embedding", "in0")]
    assert table["g"] == "channel" and table["axis"] == 0 and len(table["scale"]) == 100
    assert ours[("embedding", "out")] != ours[("embedding", "in0")]
    assert not differences(ours, theirs)


def test_16bit_symmetric_activations_keep_negatives() -> None:
    """act_symmetric with 16-bit activations: ExecuTorch's zero point 0 on [0, 65535] clips every
    negative value; ours sits at 32768 (same scale)."""
    theirs = canonical(run_executorch("convnet", "16a8w", act_symmetric=True))
    ours = canonical(run_quantplug("convnet", "16a8w", act_symmetric=True))
    o, t = ours[("conv2d", "in0")][0], theirs[("conv2d", "in0")][0]
    assert t["zp"] == [0] and o["zp"] == [32768]
    assert _rel(o["scale"], t["scale"]) < REL
    assert (t["range"], o["range"]) == ((0, 65535), (0, 65535))


def test_mask_handling_keeps_attention_accurate() -> None:
    """Same model, data and min-max observers: ExecuTorch's -65535 mask destroys the masked
    scores' resolution (anchor P11); ours stays close to the unmasked accuracy."""
    from torchao.quantization.pt2e import MinMaxObserver

    model, example, _ = build("attention")
    errors = {}
    for flow, gm in (
        ("executorch", run_executorch("attention", "16a8w", act_observer=MinMaxObserver)),
        ("quantplug", run_quantplug("attention", "16a8w", act_observer="minmax")),
    ):
        with torch.no_grad():
            errors[flow] = float((gm(*example) - model(*example)).abs().max())
    assert errors["quantplug"] < errors["executorch"] / 5, errors
    assert errors["quantplug"] < 0.02, errors


class _DeadChannels(torch.nn.Module):
    """A conv with two all-zero output channels (pruned) and a zero-initialised linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.conv.weight[2:4].zero_()
            self.conv.bias.copy_(torch.linspace(-1.0, 1.0, 8))
            self.head.weight.zero_()
            self.head.bias.copy_(torch.tensor([0.5, -0.25, 1.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("preset", ["8a8w_per_channel", "16a8w", "16a4w"])
def test_degenerate_weights_floor_only_the_clipping_bias_channels(preset: str) -> None:
    """README row 13: where input scale x weight scale cannot hold a bias channel (its weights
    are all zero), ExecuTorch's derived bias clips it to ~0; ours floors that channel's scale at
    max|bias| / 2^30. Every other key, and every other channel, is identical."""
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    model = _DeadChannels().eval()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(1, 3, 8, 8, generator=g),) for _ in range(4)]
    ep = torch.export.export(model, batches[0])
    dtype, per_channel, options = PRESETS[preset]
    quantizer = qnn.QnnQuantizer(soc_model=QcomChipset.SM8650)
    quantizer.set_default_quant_config(
        getattr(qnn.QuantDtype, dtype), is_conv_per_channel=per_channel, is_linear_per_channel=per_channel
    )
    prepared = _silently(lambda: prepare_pt2e(ep.module(), quantizer))
    for b in batches:
        prepared(*b)
    theirs = canonical(_silently(lambda: convert_pt2e(prepared)))
    ours_prepared = quantplug.prepare(
        ep, quantplug.get_quantizer("qnn_htp", soc_model="SM8650", **{**EXECUTORCH_DEFAULTS, **options})
    )
    for b in batches:
        ours_prepared(*b)
    ours = canonical(quantplug.convert(ours_prepared))
    assert set(ours) == set(theirs)
    biases = {"conv2d": model.conv.bias, "linear": model.head.bias}
    floored = 0
    for key, why in differences(ours, theirs).items():
        node, port = key
        if port == "in1" and preset == "8a8w_per_channel":  # README row 11: eps of the zero channels
            o, t = ours[key][0], theirs[key][0]
            for ours_s, theirs_s in zip(o["scale"], t["scale"]):
                assert abs(ours_s - theirs_s) <= REL * theirs_s or (
                    abs(ours_s - 0.0001 / 255) < 1e-12 and abs(theirs_s - EPS_16BIT) < 1e-15
                ), key
            continue
        if port != "in2" or node not in biases:
            pytest.fail(f"{key}: {why}")
        o, t = ours[key][0], theirs[key][0]
        if t["g"] == "tensor" and o["g"] == "tensor":  # per-tensor configs: README row 1 first
            expected = ours[(node, "in0")][0]["scale"][0] * ours[(node, "in1")][0]["scale"][0]
            floor = float(biases[node].abs().max()) / (2**31 - 1) * 2
            assert _rel(o["scale"], [max(expected, floor)]) < 1e-5, key
            floored += expected < floor
            continue
        floor = [float(v) / (2**31 - 1) * 2 for v in biases[node].abs()]
        x_scale = ours[(node, "in0")][0]["scale"][0]
        products = [x_scale * w for w in ours[(node, "in1")][0]["scale"]]
        for ours_s, theirs_s, product, f in zip(o["scale"], t["scale"], products, floor):
            assert abs(ours_s - max(product, f)) <= 1e-5 * max(product, f), key
            if product < f:
                floored += 1
                assert theirs_s < f  # ExecuTorch's scale cannot hold this channel's bias
            else:  # a channel that fits: ExecuTorch's derived scale, unless row 11's eps differs
                assert abs(ours_s - theirs_s) <= REL * theirs_s or preset == "8a8w_per_channel", key
    # 16-bit activations: the zero head and the dead channels need the floor; at 8a8w our 8-bit
    # eps (row 11) already keeps those biases representable where ExecuTorch's 16-bit eps does not
    assert floored >= (1 if preset != "8a8w_per_channel" else 0)
