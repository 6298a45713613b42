"""A histogram re-expressed over a wider range, exactly: observing (a wider batch) and merging
(ranks' histograms) both need it.

The histograms are piecewise uniform: each bin's mass is spread evenly over the bin, which is what
every error estimate and re-binning assumes.
"""

from __future__ import annotations

import numpy as np
import torch


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
    new_width = (new_max - new_min) / bins
    if new_width > 0.0 and old_max > old_min:
        out = torch.from_numpy(_spread(h.numpy(), old_min, old_max, new_min, new_width))
    else:
        out = torch.zeros(bins, dtype=torch.float64)
        idx = 0 if new_width <= 0.0 else min(max(int((old_min - new_min) / new_width), 0), bins - 1)
        out[idx] = h.sum()
    return out.to(device=hist.device, dtype=hist.dtype)


def _spread(h: np.ndarray, old_min: float, old_max: float, new_min: float, new_width: float) -> np.ndarray:
    """The float64 histogram ``h`` over ``[old_min, old_max]`` read at the edges of ``len(h)``
    bins of ``new_width`` from ``new_min``: the same float64 operations, one by one, as the torch
    expression ``diff(cdf((edges - old_min) / old_width)).clamp(min=0)`` (element-wise
    operations and a sequential cumulative sum round alike in NumPy and torch), in NumPy because
    each of its dozen operations costs a fraction of a torch operation's dispatch (a calibration
    batch re-bins every histogram whose range grew: 60 per batch in an 8-block decoder)."""
    bins = h.size
    old_width = (old_max - old_min) / bins
    cum = np.concatenate((np.zeros(1), np.cumsum(h)))
    edges = new_min + new_width * np.arange(bins + 1, dtype=np.float64)
    t = np.minimum(np.maximum((edges - old_min) / old_width, 0.0), float(bins))
    j = np.minimum(np.floor(t), bins - 1).astype(np.int64)
    cdf = cum[j] + h[j] * (t - j.astype(np.float64))
    out: np.ndarray = np.maximum(np.diff(cdf), 0.0)
    return out
