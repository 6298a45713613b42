"""The mask-aware observer's fast path (float32: one reduction, ``masked_select``) ends in the
state its general path (any dtype: boolean masks and indexing) reaches on the same values."""

from __future__ import annotations

import pytest
import torch

from quantplug.backend import MinMaxObserver, MovingAverageMinMaxObserver
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
    ]


@pytest.mark.parametrize("inner", [MinMaxObserver, MovingAverageMinMaxObserver])
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
        assert torch.equal(getattr(fast.inner, name), getattr(general.inner, name)), name
    assert torch.equal(fast.calculate_qparams()[0], general.calculate_qparams()[0])
