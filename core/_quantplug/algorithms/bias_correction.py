"""Empirical bias correction: remove the mean output error that weight quantization causes.

Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019
(section 4.2, the empirical variant); Finkelstein et al., "Fighting Quantization Bias With Bias",
2019. Quantized weights ``W~ = W + dW`` shift a layer's expected output by ``E[dW x] = dW E[x]``;
subtracting that from the bias makes the quantized layer unbiased on the calibration data.

The collector keeps the running mean of the layer's input over the batch (per position for
convolutions, so padding is accounted for exactly; per feature for linear layers), which is all
the expectation needs: memory does not grow with the data; its sums merge across processes. At
convert the correction is ``-(f(E[x], W~) - f(E[x], W))`` averaged over positions, per output
channel, with the codes the earlier algorithms chose (run it last:
``["seq_mse", "adaround", "bias_correction"]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from _quantplug.algorithms.collectors import like, sum_in_order
from _quantplug.algorithms.spec import (
    Algorithm,
    LayerInputs,
    WeightChoice,
    WeightGrid,
    WeightSite,
    option,
    options_as_fields,
)


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

    def state(self) -> dict[str, Any]:
        return {"total": self.total, "count": self.count}

    def merge_(self, states: Sequence[dict[str, Any]]) -> None:
        """Every rank's sums added in rank order (per channel when ranks kept different shapes,
        as one process does once it sees a second spatial size)."""
        totals = [s["total"] for s in states if s["total"] is not None]
        if self.conv and len({tuple(t.shape) for t in totals}) > 1:
            totals = [_channel_sum(t) for t in totals]
        self.total = like(sum_in_order(totals), self.total)
        self.count = sum(int(s["count"]) for s in states)


def _channel_sum(t: torch.Tensor) -> torch.Tensor:
    """A per-position sum ``[C, *spatial]`` as the per-channel sum of position means (``[C]``)."""
    return t if t.dim() == 1 else t.reshape(t.shape[0], -1).mean(-1)


@options_as_fields
class BiasCorrection(Algorithm):
    """Empirical bias correction at convert, per output channel of conv/linear layers.

    ``sequential`` (the default, Nagel et al.'s empirical variant): the correction is the
    difference between the float layer's mean output ``f(E[x], W)`` and the quantized model's
    ``f(E[x~], W~)``, with ``E[x~]`` measured in the model quantized so far (earlier layers quantized
    and corrected, activations quantized): every layer's measured mean output error is removed,
    including what arrives from upstream. Float inputs only (``sequential=False``) remove the
    weights' own part ``dW E[x]``, which can add to the error that arrives from upstream rather
    than cancel it (the random CNN at int8: -2.3 dB against the default, sequential: see
    ``bench/results/nncf_compare.md``).
    """

    name = "bias_correction"
    description = "empirical bias correction: subtract the mean output error of quantized weights"
    paper = "Nagel et al. 2019, Data-Free Quantization (sec. 4.2); Finkelstein et al. 2019"
    float_inputs = True

    sequential: bool = option(
        True, "correct the quantized model's measured mean error (false: the weights' own part only)"
    )

    def collector(self, site: WeightSite) -> RunningMean | None:
        if not site.has_layer or site.bias is None:
            return None
        return RunningMean(conv=_is_conv(site))

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        if isinstance(collected, LayerInputs):
            float_mean, quantized_mean = collected.float, collected.quantized
        else:
            float_mean, quantized_mean = collected, None
        if float_mean is None or site.bias is None:
            return None
        if quantized_mean is None:
            quantized_mean = float_mean
        elif quantized_mean.shape != float_mean.shape:  # other spatial sizes seen: per channel
            float_mean, quantized_mean = _channel_sum(float_mean), _channel_sum(quantized_mean)
        with torch.no_grad():
            error = _mean_output(site, quantized_mean, grid.dequantize(codes)) - _mean_output(
                site, float_mean, site.weight.to(torch.float32)
            )
        return WeightChoice(bias_delta=-error)


def _mean_output(site: WeightSite, mean: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The layer's mean output per output channel (bias left out) for inputs of mean ``mean``."""
    if not _is_conv(site):
        return weight @ mean
    if mean.dim() == 1 or "transpose" in site.op:
        # per-channel mean: every kernel tap sees E[x_c] (transposed convs: weight [in, out, ...])
        mean = mean if mean.dim() == 1 else _channel_sum(mean)
        taps = weight.reshape(weight.shape[0], weight.shape[1], -1).sum(-1)
        return (taps.t() @ mean) if "transpose" in site.op else taps @ mean
    out = site.forward(mean.unsqueeze(0), weight)
    bias = torch.zeros(out.shape[1]) if site.bias is None else site.bias.to(out.dtype)
    return out[0].reshape(out.shape[1], -1).mean(-1) - bias


def _is_conv(site: WeightSite) -> bool:
    return site.op.startswith("aten.conv")
