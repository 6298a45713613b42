"""The mask-aware observer's fast path (float32: one reduction, then the real values' extremes for
an inner observer of extremes, ``masked_select`` for any other) ends in the state its general
path (any dtype: boolean masks and indexing) reaches on the same values."""

from __future__ import annotations

import pytest
import torch

from quantplug.backend import HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver
from quantplug_qnn_htp.observers import MaskAwareObserver


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    causal = torch.full((16, 16), torch.finfo(torch.float32).min).triu(1)
    return [
        torch.randn(2, 16, 16, generator=g) + causal,  # transformers' additive mask
        torch.randn(2, 16, 16, generator=g).masked_fill(causal < 0, float("-inf")),
        torch.randn(2, 16, 16, generator=g) * 3,  # no mask
        torch.randn(4, 4, generator=g).masked_fill(torch.eye(4, dtype=torch.bool), float("inf")),
        torch.full((3, 3), -1e9),  # masks only
        torch.tensor(float("-inf")),  # the fill value of a masked_fill, observed as a constant
        torch.tensor([[-1e9, 0.5, 2.0], [float("inf"), -3.0, 1e9]]),  # masks of both signs
        torch.tensor([float("-inf"), 1e9]),  # masks of both signs, nothing else
        torch.randn(2, 16, 16, generator=g).relu() + causal,  # a zero extreme among the real values
    ]


@pytest.mark.parametrize("inner", [MinMaxObserver, MovingAverageMinMaxObserver, HistogramObserver])
def test_float32_path_ends_where_the_general_path_does(inner: type) -> None:
    fast = MaskAwareObserver(inner=inner.with_args(), dtype=torch.uint16)
    general = MaskAwareObserver(inner=inner.with_args(), dtype=torch.uint16)
    for x in _batches():
        assert fast(x) is x
        general(x.double())  # float64 takes the general path; the values are float32's
    for name in ("saw_negative_mask", "saw_positive_mask", "num_batches"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert bool(fast.saw_negative_mask) and bool(fast.saw_positive_mask)
    for name in ("min_val", "max_val", "num_batches"):
        a, b = getattr(fast.inner, name), getattr(general.inner, name)
        assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b)), name
    assert torch.equal(fast.calculate_qparams()[0], general.calculate_qparams()[0])
