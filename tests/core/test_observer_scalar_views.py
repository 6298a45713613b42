"""Range observers write their 0-dim buffers through views of the same memory
(``_quantplug.observers.minmax.scalar_views``: ctypes scalars at their addresses): the state is
the one torch's own writes give, bit for bit, and it follows the buffers wherever they go
(replaced, moved, copied, pickled)."""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch

from _quantplug.observers import kernels, minmax
from _quantplug.observers.base import SCALAR_VIEWS
from _quantplug.observers.copies import fresh_copy
from _quantplug.observers.minmax import MinMaxObserver, MovingAverageMinMaxObserver

KINDS = {
    "minmax": MinMaxObserver,
    "moving_average": lambda: MovingAverageMinMaxObserver(averaging_constant=0.3),
    "moving_average_per_pass": lambda: MovingAverageMinMaxObserver(averaging_constant=0.3, calls_per_pass=3),
}


def _state(obs: torch.nn.Module) -> list[torch.Tensor]:
    return [obs.min_val.clone(), obs.max_val.clone(), obs.num_batches.clone()]


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 33, generator=g) * s for s in (1.0, 3.0, 0.5, 2.0, 5.0)]
    return [*xs, xs[1].t(), torch.zeros(3), -torch.zeros(3), torch.tensor([-0.0, 2.0])]


def _not_plain(observer: torch.nn.Module) -> minmax.ScalarRecord:
    """The record of buffers the views may not stand for: torch's ``fill_`` and ``add_`` write."""
    return (observer.min_val, observer.max_val, observer.num_batches, (0, 0, 0), False, None)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_views_write_what_torch_writes(kind: str, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the views (native kernels off) or the native update (on, where built)."""
    viewed, plain = KINDS[kind](), KINDS[kind]()
    with torch.no_grad():
        with contextlib.nullcontext() if native else kernels.disabled():
            for x in _batches():
                viewed(x)
        assert SCALAR_VIEWS in viewed.__dict__
        with monkeypatch.context() as m:
            m.setattr(minmax, "_scalar_record", _not_plain)
            for x in _batches():
                plain(x)
    for a, b in zip(_state(viewed), _state(plain)):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(torch.signbit(a), torch.signbit(b))  # a zero's sign too


def test_views_follow_replaced_and_moved_buffers() -> None:
    obs = MinMaxObserver()
    obs(torch.tensor([1.0, 2.0]))
    obs.min_val = torch.tensor(-7.0)  # a new tensor: a buffer replaced
    obs(torch.tensor([1.0, 3.0]))
    assert float(obs.min_val) == -7.0 and float(obs.max_val) == 3.0
    obs.share_memory()  # the same tensors, their memory moved
    obs(torch.tensor([-9.0, 4.0]))
    assert (float(obs.min_val), float(obs.max_val), int(obs.num_batches)) == (-9.0, 4.0, 3)
    obs.max_val.set_(torch.tensor(10.0))  # the same tensor on other memory
    obs(torch.tensor([0.5, 11.0]))
    assert float(obs.max_val) == 11.0 and int(obs.num_batches) == 4
    obs.load_state_dict({"min_val": torch.tensor(-1.0), "max_val": torch.tensor(1.0)})  # copied in
    obs(torch.tensor([-0.5, 2.5]))
    assert (float(obs.min_val), float(obs.max_val)) == (-1.0, 2.5)


def test_copies_count_into_their_own_buffers() -> None:
    obs = MinMaxObserver()
    obs(torch.tensor([-1.0, 1.0]))
    before = _state(obs)
    for copied in (fresh_copy(obs), copy.deepcopy(obs), pickle.loads(pickle.dumps(obs))):
        assert SCALAR_VIEWS not in copied.__dict__
        copied(torch.tensor([-5.0, 5.0]))
        assert (float(copied.min_val), float(copied.max_val), int(copied.num_batches)) == (-5.0, 5.0, 2)
        for a, b in zip(_state(obs), before):  # the original untouched
            assert torch.equal(a, b)
