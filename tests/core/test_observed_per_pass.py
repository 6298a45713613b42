"""Groups observed per pass (``SharingGroups.observed_per_pass``): a moving average whose several
calls in one forward pass are one tensor (an unrolled recurrence's gate at every step) updates
once per pass with their joint extremes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _quantplug.observers.minmax import MovingAverageMinMaxObserver

chunks = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=6), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(st.lists(chunks, min_size=1, max_size=4))
def test_calls_of_one_pass_update_as_one_batch_of_their_union(passes: list[list[list[float]]]) -> None:
    """Each pass is several calls (as many as the observer is told): the result equals one
    call per pass with everything that pass saw, whatever the calls' order and sizes."""
    width = max(len(p) for p in passes)
    per_pass = MovingAverageMinMaxObserver(calls_per_pass=width)
    whole = MovingAverageMinMaxObserver()
    for calls in passes:
        calls = calls + [calls[-1]] * (width - len(calls))  # every pass makes `width` calls
        for values in calls:
            per_pass(torch.tensor(values))
        whole(torch.tensor([v for values in calls for v in values]))
    assert int(per_pass.num_batches) == int(whole.num_batches) == len(passes)
    assert torch.equal(per_pass.min_val, whole.min_val) and torch.equal(per_pass.max_val, whole.max_val)


def test_one_call_per_pass_is_the_moving_average_of_calls() -> None:
    """The default (torchao's behaviour, ExecuTorch parity): each call is one update, so a first
    narrow call outweighs later wide ones."""
    obs = MovingAverageMinMaxObserver()
    obs(torch.tensor([-0.1, 0.1]))
    obs(torch.tensor([-10.0, 10.0]))
    assert int(obs.num_batches) == 2 and float(obs.max_val) < 0.3
    per_pass = MovingAverageMinMaxObserver(calls_per_pass=2)
    per_pass(torch.tensor([-0.1, 0.1]))
    assert int(per_pass.num_batches) == 0  # the pass is not over
    per_pass(torch.tensor([-10.0, 10.0]))
    assert int(per_pass.num_batches) == 1 and float(per_pass.max_val) == 10.0
