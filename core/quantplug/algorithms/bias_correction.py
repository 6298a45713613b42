"""Empirical bias correction: remove the mean output error that weight quantization causes.

Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019
(section 4.2, the empirical variant); Finkelstein et al., "Fighting Quantization Bias With Bias",
2019. Quantized weights ``W~ = W + dW`` shift a layer's expected output by ``E[dW x] = dW E[x]``;
subtracting that from the bias makes the quantized layer unbiased on the calibration data.

The collector keeps the running mean of the layer's input over the batch (per position for
convolutions, so padding is accounted for exactly; per feature for linear layers), which is all
the expectation needs: memory does not grow with the data. At convert the correction is
``-(f(E[x], W~) - f(E[x], W))`` averaged over positions, per output channel, with the codes the
earlier algorithms chose (run it last: ``["seq_mse", "adaround", "bias_correction"]``).
"""

from __future__ import annotations

from typing import Any

import torch

from quantplug.algorithms.spec import Algorithm, WeightChoice, WeightGrid, WeightSite


class RunningMean:
    """The mean of a layer's inputs over every sample seen, in O(one sample) memory.

    Linear layers keep the mean per input feature. Convolutions keep the mean per position
    (``[C, *spatial]``); when batches come with other spatial sizes it drops to the mean per
    channel (``[C]``), which is exact away from the borders.
    """

    def __init__(self, conv: bool) -> None:
        self.conv = conv
        self.total: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().to(torch.float64)
        if not self.conv:
            self._add(x.reshape(-1, x.shape[-1]).sum(0), x.numel() // max(x.shape[-1], 1))
            return
        if x.dim() < 3:  # an unbatched convolution input
            x = x.unsqueeze(0)
        summed = x.sum(0)
        if self.total is not None and self.total.shape != summed.shape:
            self.total = _channel_sum(self.total)
        if self.total is not None and self.total.dim() == 1:
            summed = _channel_sum(summed)
        self._add(summed, x.shape[0])

    def _add(self, summed: torch.Tensor, count: int) -> None:
        self.total = summed if self.total is None else self.total + summed
        self.count += count

    def result(self) -> torch.Tensor | None:
        if self.total is None or self.count == 0:
            return None
        return (self.total / self.count).to(torch.float32)


def _channel_sum(t: torch.Tensor) -> torch.Tensor:
    """A per-position sum ``[C, *spatial]`` as the per-channel sum of position means (``[C]``)."""
    return t if t.dim() == 1 else t.reshape(t.shape[0], -1).mean(-1)


class BiasCorrection(Algorithm):
    name = "bias_correction"
    description = "empirical bias correction: subtract the mean output error of quantized weights"
    paper = "Nagel et al. 2019, Data-Free Quantization (sec. 4.2); Finkelstein et al. 2019"

    def collector(self, site: WeightSite) -> RunningMean | None:
        if not site.has_layer or site.bias is None:
            return None
        return RunningMean(conv=_is_conv(site))

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        if collected is None or site.bias is None:
            return None
        with torch.no_grad():
            delta_w = grid.dequantize(codes) - site.weight.to(torch.float32)
            if not _is_conv(site):
                error = delta_w @ collected
            elif collected.dim() == 1 or "transpose" in site.op:
                # per-channel mean: every kernel tap sees E[x_c] (transposed convs: weight [in, out, ...])
                mean = collected if collected.dim() == 1 else _channel_sum(collected)
                taps = delta_w.reshape(delta_w.shape[0], delta_w.shape[1], -1).sum(-1)
                error = (taps.t() @ mean) if "transpose" in site.op else taps @ mean
            else:
                diff = site.forward(collected.unsqueeze(0), grid.dequantize(codes)) - site.forward(
                    collected.unsqueeze(0)
                )
                error = diff[0].reshape(diff.shape[1], -1).mean(-1)
        return WeightChoice(bias_delta=-error)


def _is_conv(site: WeightSite) -> bool:
    return site.op.startswith("aten.conv")
