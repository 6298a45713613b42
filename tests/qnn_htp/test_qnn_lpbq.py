"""LPBQ (16a4w_block) numerics: the simulated program uses the device's 4-bit block scales."""

from __future__ import annotations

import copy

import pytest
import torch

import quantplug
from _quantplug.observers.parked import unparked

pytest.importorskip("quantplug_qnn_htp")

from _quantplug.meta import STATE_KEY
from quantplug_qnn_htp.encodings import lpbq_parts
from quantplug_qnn_htp.observers import LpbqObserver, lpbq_effective_scales, lpbq_quantize_scales

from .models import build


def test_block_scales_are_4bit_multiples_of_a_per_channel_scale() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.linspace(0.1, 2.0, 64)  # very different block ranges
    obs = LpbqObserver(block_size=(1, 16), dtype=torch.int4, quant_min=-7, quant_max=7, eps=1e-9)
    obs(w)
    eff, zp = obs.calculate_qparams()
    per_channel, ints = obs.lpbq_parts()
    assert eff.shape == (8, 4) and bool((zp == 0).all())
    assert ints.min() >= 1 and ints.max() <= 16 and bool((ints.amax(-1) == 16).all())
    torch.testing.assert_close(eff, ints.float() * per_channel[:, None], rtol=0, atol=0)
    # fp32 block scales (ExecuTorch's simulation) vs the device's: within half a 4-bit step of
    # the per-channel scale (blocks below 1/16 of the channel maximum are raised to 1/16)
    fp32 = w.reshape(8, 4, 16).abs().amax(-1) / 7
    gap = (eff - fp32).abs()
    assert float(gap.max()) > 0  # they do differ: ExecuTorch's simulation is not what runs
    small = fp32 < per_channel[:, None]
    assert bool((gap[~small] <= per_channel[:, None].expand_as(gap)[~small] / 2 * (1 + 1e-6)).all())
    # the per-channel scale is max(block) / 16, exactly
    torch.testing.assert_close(per_channel, fp32.amax(-1) / 16, rtol=0, atol=0)
    again = lpbq_quantize_scales(eff)
    assert torch.equal(again[1], ints) and torch.equal(again[0], per_channel)
    assert torch.equal(lpbq_effective_scales(fp32), eff)


def test_converted_program_dequantizes_with_device_scales() -> None:
    model, example, batches = build("convnet")
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w_block", block_size=16)
    prepared = quantplug.prepare(torch.export.export(model, example), q)
    for b in batches:
        prepared(*b)
    state = prepared.meta[STATE_KEY]
    # a weight's observer is parked in the prepared module (convert measures the weight, once):
    # an unparked copy measures it here as convert does
    obs = unparked(copy.deepcopy(state.observer(prepared, state.group_of[("conv3_weight", "conv2d_2")])))
    assert isinstance(obs, LpbqObserver)
    gm = quantplug.convert(prepared)  # weights are observed there, once
    obs(model.conv3.weight)
    per_channel, ints = obs.lpbq_parts()
    conv = next(n for n in gm.graph.nodes if n.name == "conv2d_2")
    w_dq = conv.args[1]
    assert "dequantize_per_block" in str(w_dq.target)
    codes = getattr(gm, w_dq.args[0].target)
    scale = getattr(gm, w_dq.args[1].target)
    # what the device computes: code x 4-bit block scale x per-channel scale
    device = codes.float() * (ints.float() * per_channel[:, None]).reshape(32, 2, 1, 1).repeat_interleave(
        16, 1
    )
    with torch.no_grad():
        zero_point = getattr(gm, w_dq.args[2].target)
        simulated = torch.ops.quantplug.dequantize_per_block(
            codes, scale, zero_point, [1, 16, 1, 1], -7, 7, torch.int8
        )
    torch.testing.assert_close(simulated, device, rtol=0, atol=0)
    # codes were rounded on those same scales: at most half a step from the float weight
    err = (simulated - model.conv3.weight).abs()
    step = (ints.float() * per_channel[:, None]).reshape(32, 2, 1, 1).repeat_interleave(16, 1)
    assert bool((err <= step / 2 + 1e-7).all())
    # the LPBQ parts can be recovered exactly from the program (what the encodings writer does)
    parts = lpbq_parts(scale, [1, 16, 1, 1], codes.shape)
    assert parts.int_scales == tuple(tuple(int(i) for i in row) for row in ints)
    assert parts.per_channel_scale == tuple(float(s) for s in per_channel)
    # bias scale = input scale x per-channel scale (QNN's BLOCKWISE_EXPANSION base scale)
    x_scale = conv.args[0].args[1]
    bias_scale = getattr(gm, conv.args[2].args[1].target)
    torch.testing.assert_close(bias_scale, (x_scale * per_channel).float(), rtol=1e-6, atol=0)


def test_kxk_conv_blocks_span_the_kernel_window() -> None:
    from torch import nn

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(32, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    torch.manual_seed(0)
    net = Wide().eval()
    x = torch.randn(1, 32, 6, 6)
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w_block", block_size=16)
    prepared = quantplug.prepare(torch.export.export(net, (x,)), q)
    prepared(x)
    gm = quantplug.convert(prepared)
    w_dq = next(n for n in gm.graph.nodes if n.name == "conv2d").args[1]
    assert list(w_dq.args[3]) == [1, 16, 3, 3]  # one integer scale per (channel, block of 16 inputs)
    assert tuple(getattr(gm, w_dq.args[1].target).shape) == (8, 2, 1, 1)
