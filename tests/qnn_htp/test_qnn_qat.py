"""QAT variants of the qnn_htp precisions: fake-quant everywhere (fixed-qparam outputs included),
a few training steps, then convert."""

from __future__ import annotations

import pytest
import torch

import quantplug

pytest.importorskip("quantplug_qnn_htp")

from _quantplug.graph.attrs import attr_value
from _quantplug.meta import STATE_KEY
from _quantplug.observers.fake_quantize import FakeQuantize
from _quantplug.observers.fixed import FixedQParamsObserver
from quantplug_qnn_htp.observers import LpbqObserver

from .models import build


def _group_module(prepared: torch.fx.GraphModule, key: str) -> torch.nn.Module:
    state = prepared.meta[STATE_KEY]
    return state.observer(prepared, state.group_of[key])


def _train(prepared: torch.fx.GraphModule, batches: list, steps: int = 4) -> list[float]:
    params = [p for p in prepared.parameters() if p.requires_grad]
    assert params, "QAT prepare must own trainable parameters"
    opt = torch.optim.SGD(params, lr=1e-2)
    losses = []
    for step in range(steps):
        (x,) = batches[step % len(batches)]
        loss = prepared(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _freeze(prepared: torch.fx.GraphModule) -> None:
    for m in prepared.modules():
        if isinstance(m, FakeQuantize):
            m.disable_observer()


@pytest.mark.parametrize("precision", ["8a8w", "16a8w", "16a4w_block"])
def test_qat_trains_and_converts(precision: str) -> None:
    model, example, batches = build("convnet")
    ep = torch.export.export(model, example)
    q = quantplug.get_quantizer(
        "qnn_htp", soc_model="SM8650", precision=precision, qat=True, block_size=16, act_observer="minmax"
    )
    assert q.global_config.is_qat
    prepared = quantplug.prepare(ep, q, qat=True)
    # every quantized tensor is fake-quantized, the fixed sigmoid encoding too (ExecuTorch leaves
    # a plain FixedQParamsObserver there under QAT: anchor 1.4 / P5)
    sigmoid = _group_module(prepared, "sigmoid")
    assert isinstance(sigmoid, FakeQuantize)
    assert isinstance(sigmoid.activation_post_process, FixedQParamsObserver)
    conv3_weight = _group_module(prepared, ("conv3_weight", "conv2d_2"))  # type: ignore[arg-type]
    assert isinstance(conv3_weight, FakeQuantize)
    if precision == "16a4w_block":
        assert isinstance(conv3_weight.activation_post_process, LpbqObserver)
    before = prepared.conv3.weight.detach().clone()
    losses = _train(prepared, batches)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(prepared.conv3.weight.detach(), before)  # the weights trained
    assert torch.equal(model.conv3.weight, ep.state_dict["conv3.weight"])  # the caller's did not

    _freeze(prepared)
    quantized = quantplug.convert(prepared)
    (x,) = batches[-1]
    with torch.no_grad():
        fake = prepared(x)
        real = quantized(x)
    step = 1 / 256 if precision == "8a8w" else 1 / 2048
    # converted program == fake-quantized training graph up to rounding of the int32 bias
    assert float((fake - real).abs().max()) < 4 * step * float(fake.abs().max() + 1)
    # the trained weights are what got quantized, once, at convert: the program stores integers
    # whose dequantized values are the training graph's fake-quantized weights
    w_dq = next(n for n in quantized.graph.nodes if n.name == "conv2d_2").args[1]
    stored = attr_value(quantized, w_dq.args[0])
    assert w_dq.args[0].op == "get_attr" and not stored.dtype.is_floating_point
    with torch.no_grad():
        dequantized = w_dq.target(*[attr_value(quantized, a) for a in w_dq.args])
        torch.testing.assert_close(dequantized, conv3_weight(prepared.conv3.weight), rtol=0, atol=0)


def test_qat_weight_observers_follow_the_trained_weights() -> None:
    """QAT weight grids track the current weights (ExecuTorch's per-channel / per-block QAT
    observers calibrate once and freeze)."""
    model, example, batches = build("convnet")
    ep = torch.export.export(model, example)
    q = quantplug.get_quantizer("qnn_htp", precision="8a8w", qat=True)
    prepared = quantplug.prepare(ep, q, qat=True)
    fq = _group_module(prepared, ("conv1_weight", "conv2d"))  # type: ignore[arg-type]
    prepared(*batches[0])
    with torch.no_grad():
        prepared.conv1.weight.mul_(0.5)
    prepared(*batches[0])
    scale, _ = fq.calculate_qparams()
    expected = prepared.conv1.weight.detach().abs().amax(dim=(1, 2, 3)) / 127
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)


def test_16a8w_qat_weights_are_signed_int8_like_executorch() -> None:
    from quantplug_qnn_htp.configs import build_config

    ptq = build_config("16a8w", {"per_channel_conv": False})
    qat = build_config("16a8w", {"per_channel_conv": False, "qat": True})
    assert (ptq.weight.dtype, qat.weight.dtype) == (torch.uint8, torch.int8)
    assert qat.weight.quant_min == -127 and qat.is_qat and not ptq.is_qat
