"""A histogram re-expressed over a wider range, exactly: observing (a wider batch) and merging
(ranks' histograms) both need it.

The histograms are piecewise uniform: each bin's mass is spread evenly over the bin, which is what
every error estimate and re-binning assumes.
"""

from __future__ import annotations

import torch


def _cdf_at(positions: torch.Tensor, hist: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """Mass left of ``positions`` (in bin units) under the piecewise-uniform histogram."""
    bins = hist.numel()
    t = positions.clamp(0.0, float(bins))
    j = t.floor().clamp(max=bins - 1).long()
    return cum[j] + hist[j] * (t - j.to(t.dtype))


def rebin_histogram(
    hist: torch.Tensor, old_min: float, old_max: float, new_min: float, new_max: float
) -> torch.Tensor:
    """Re-express ``hist`` over ``[old_min, old_max]`` on the same number of bins over a wider range.

    Reading the old cumulative histogram at the new bin edges is exact for piecewise-uniform bins
    and conserves mass, so no upsampling approximation is needed. A zero-width old range is a
    point mass and lands wholly in the new bin that contains it.
    """
    bins = hist.numel()
    h = hist.detach().to(device="cpu", dtype=torch.float64)
    out = torch.zeros(bins, dtype=torch.float64)
    new_width = (new_max - new_min) / bins
    if new_width <= 0.0:
        out[0] = h.sum()
    elif old_max <= old_min:
        idx = min(max(int((old_min - new_min) / new_width), 0), bins - 1)
        out[idx] = h.sum()
    else:
        old_width = (old_max - old_min) / bins
        cum = torch.cat([h.new_zeros(1), h.cumsum(0)])
        edges = new_min + new_width * torch.arange(bins + 1, dtype=torch.float64)
        out = torch.diff(_cdf_at((edges - old_min) / old_width, h, cum)).clamp_(min=0.0)
    return out.to(device=hist.device, dtype=hist.dtype)
