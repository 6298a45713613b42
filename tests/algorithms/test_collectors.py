"""The shared collectors keep bounded, data-determined summaries."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _quantplug.algorithms.bias_correction import RunningMean
from _quantplug.algorithms.collectors import Gram, InputSample


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 50))
def test_input_sample_is_bounded_made_of_seen_rows_and_repeatable(batches: list[int], cap: int) -> None:
    data = [torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 1000 * i for i, n in enumerate(batches)]
    first, second = InputSample(cap), InputSample(cap)
    for batch in data:
        first.update(batch)
        second.update(batch)
    rows = first.result()
    assert rows is not None and rows.shape[0] == min(cap, sum(batches))
    every = torch.cat(data)
    assert all(bool((every == row).all(1).any()) for row in rows)
    assert torch.equal(rows, second.result())


def test_input_sample_draws_from_late_batches_too() -> None:
    sample = InputSample(64)
    for i in range(50):
        sample.update(torch.full((16, 2), float(i)))
    rows = sample.result()
    assert rows is not None and float(rows[:, 0].max()) > 25  # not only the first batches


def test_gram_equals_the_direct_product() -> None:
    torch.manual_seed(0)
    xs = [torch.randn(4, 5, 6) for _ in range(3)]
    gram = Gram()
    for x in xs:
        gram.update(x)
    rows = torch.cat([x.reshape(-1, 6) for x in xs]).double()
    matrix, count = gram.result()
    assert count == 60 and torch.allclose(matrix, rows.t() @ rows)


def test_running_mean_of_conv_inputs_drops_to_channels_when_sizes_vary() -> None:
    mean = RunningMean(conv=True)
    mean.update(torch.ones(2, 3, 4, 4))
    assert mean.result().shape == (3, 4, 4)
    mean.update(3 * torch.ones(2, 3, 2, 2))
    result = mean.result()
    assert result.shape == (3,) and torch.allclose(result, torch.full((3,), 2.0))
