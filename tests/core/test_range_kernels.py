"""The range observers' native update (``record_range``) writes what their Python paths write, bit
for bit, and batches requiring grad under autograd are observed as under ``torch.no_grad()``.

``MinMaxObserver._record`` takes a batch's extremes into ``min_val``, ``max_val`` and
``num_batches`` in one native call (the running extremes, or the moving average's float32
steps); the same update runs through ctypes views of the buffers with the kernels off, and
through torch's ``fill_``/``add_`` where the buffers are not plain. Compared here on drawn states
and batches (zeros of both signs, subnormals, infinities, overflowing steps), under the AVX2 and
the scalar code; an extension built without ``record_range`` is not called.

With autograd on, activations require grad and :mod:`_quantplug.observers.seen` does not match
them; their extremes still come from the native kernel (a strided head through a contiguous
copy), the same values ``torch.aminmax`` gives.
"""

from __future__ import annotations

import math
import struct
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.meta import observer_children
from _quantplug.observers import kernels, minmax, seen
from _quantplug.observers.minmax import MinMaxObserver, MovingAverageMinMaxObserver
from tests.core.kernel_code import simd as simd_code

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built (no C compiler)")

FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=True, allow_subnormal=True)
#: extremes of a batch: float32 values, signed zeros and the largest ones often
EXTREME = FLOAT32 | st.sampled_from([0.0, -0.0, 3.4028234663852886e38, -3.4028234663852886e38, 1e-45])
KINDS = {"minmax": MinMaxObserver, "moving_average": MovingAverageMinMaxObserver}


def _bits(obs: nn.Module) -> tuple[int, int, int]:
    as_int = struct.Struct("I")
    low, high = (as_int.unpack(struct.pack("f", float(t)))[0] for t in (obs.min_val, obs.max_val))
    return low, high, int(obs.num_batches)


def _observer(kind: str, c: float, state: tuple[float, float, int]) -> nn.Module:
    obs = KINDS[kind](averaging_constant=c) if kind == "moving_average" else KINDS[kind]()
    obs.min_val.fill_(state[0])
    obs.max_val.fill_(state[1])
    obs.num_batches.fill_(state[2])
    return obs


def _without_views(observer: Any) -> minmax.ScalarRecord:
    return (observer.min_val, observer.max_val, observer.num_batches, (0, 0, 0), False, None)


@pytest.mark.parametrize("simd", ["avx2", "scalar"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=400, deadline=None)
@given(
    state=st.tuples(EXTREME, EXTREME, st.integers(0, 3)),
    batches=st.lists(st.tuples(EXTREME, EXTREME), min_size=1, max_size=4),
    c=st.floats(0.0, 1.0, width=32) | st.floats(allow_nan=False) | st.sampled_from([0.01, 1.0, 1e39, -2.0]),
)
def test_native_update_writes_what_the_views_and_torch_write(
    simd: str,
    kind: str,
    state: tuple[float, float, int],
    batches: list[tuple[float, float]],
    c: float,
) -> None:
    assert hasattr(kernels._native, "record_range")
    native, views, plain = (_observer(kind, c, state) for _ in range(3))
    with simd_code(simd == "avx2"):
        for lo, hi in batches:
            native._record(lo, hi)
    with kernels.disabled():  # ctypes views of the buffers
        for lo, hi in batches:
            views._record(lo, hi)
    with pytest.MonkeyPatch.context() as m:  # torch's fill_ and add_
        m.setattr(minmax, "_scalar_record", _without_views)
        for lo, hi in batches:
            plain._record(lo, hi)
    assert _bits(native) == _bits(views) == _bits(plain)


def test_a_subclass_with_its_own_update_is_not_updated_natively() -> None:
    class Halving(MinMaxObserver):
        def _update_views(self, views: minmax.ScalarViews, lo: float, hi: float) -> None:
            super()._update_views(views, lo / 2, hi / 2)

    obs = Halving()
    obs(torch.tensor([-4.0, 8.0]))
    assert (float(obs.min_val), float(obs.max_val), int(obs.num_batches)) == (-2.0, 4.0, 1)


def test_an_extension_without_record_range_is_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place build of an older source: the views write the state, the same one."""
    built = kernels._native
    older = types.SimpleNamespace(minmax=built.minmax)  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 40, generator=g) * s for s in (1.0, 4.0, 0.25)]
    for kind in sorted(KINDS):
        new, old = KINDS[kind](), KINDS[kind]()
        for x in xs:
            new(x)
        with monkeypatch.context() as m:
            m.setattr(kernels, "_native", older)
            assert not hasattr(kernels._native, "record_range")
            for x in xs:
                old(x)
        assert _bits(new) == _bits(old)


@st.composite
def _slices(draw: Any) -> torch.Tensor:
    """A slice of a wider float32 tensor (rows of contiguous values, some apart), or a view of it."""
    rows, width = draw(st.integers(1, 9)), draw(st.integers(1, 40))
    extra = draw(st.integers(0 if rows == 1 else 1, 12))
    values = draw(
        st.lists(
            FLOAT32 | st.sampled_from([float("nan"), 0.0, -0.0]), min_size=1, max_size=rows * (width + extra)
        )
    )
    base = torch.tensor(values, dtype=torch.float32).repeat(rows * (width + extra) // len(values) + 1)
    start = draw(st.integers(0, extra))
    head = base[: rows * (width + extra)].reshape(rows, width + extra)[:, start : start + width]
    return head.t() if draw(st.booleans()) else head


@pytest.mark.parametrize("simd", ["avx2", "scalar"])
@settings(max_examples=400, deadline=None)
@given(x=_slices())
def test_slices_are_read_in_place_with_the_extremes_torch_finds(simd: str, x: torch.Tensor) -> None:
    native = kernels._native
    assert native is not None and hasattr(native, "minmax_rows")
    layout = seen.layout(x)
    with simd_code(simd == "avx2"):
        lo, hi = minmax._slice_extremes(native, x, x.numel(), layout)
        values = x.contiguous()  # held while the kernel reads it
        copied = native.minmax(values.data_ptr(), x.numel())
    low, high = torch.aminmax(x)
    if torch.isnan(x).any():
        assert math.isnan(lo) and math.isnan(hi) and math.isnan(copied[0])
    else:  # the values torch finds (a zero's sign aside: the callers leave zeros to torch)
        assert (lo, hi) == copied == (float(low), float(high))


def test_strided_batches_read_without_the_rows_kernel_are_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension built before ``minmax_rows``: the contiguous copy, the same extremes."""
    built = kernels._native
    older = types.SimpleNamespace(minmax=built.minmax)  # type: ignore[union-attr]
    x = torch.randn(16, 40)[:, 3:30]
    found = minmax._slice_extremes(built, x, x.numel(), seen.layout(x))
    assert minmax._slice_extremes(older, x, x.numel(), seen.layout(x)) == found
    assert found == (float(x.min()), float(x.max()))


class _Heads(nn.Module):
    """A q/k/v projection split into heads and transposed (strided views), then attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(32, dim=-1)
        q, k, v = (t.reshape(1, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
        scores = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return self.out((scores @ v).transpose(1, 2).reshape(1, 16, 32))


def _calibrated(grad: bool, **quantizer: Any) -> dict[str, tuple[int, int, int]]:
    torch.manual_seed(0)
    model = _Heads().eval()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(1, 16, 32, generator=g) * s for s in (1.0, 3.0, 0.5)]
    prepared = quantplug.prepare(
        torch.export.export(model, (batches[0],)), quantplug.get_quantizer(**quantizer)
    )
    with torch.enable_grad() if grad else torch.no_grad():
        for x in batches:
            prepared(x)
    return {
        name: _bits(obs)
        for name, obs in observer_children(prepared)
        if isinstance(obs, MinMaxObserver) and obs.min_val.dim() == 0
    }


QUANTIZERS = {
    "minmax": dict(name="qnn_htp", precision="16a8w"),
    "moving_average": dict(name="qnn_htp", precision="16a8w", act_observer="moving_average"),
}


@pytest.mark.parametrize("quantizer", sorted(QUANTIZERS))
def test_calibration_with_autograd_on_gives_the_no_grad_state(quantizer: str) -> None:
    with torch.enable_grad():
        probe = _Heads()(torch.randn(1, 16, 32))
    assert probe.requires_grad  # the activations require grad: seen does not match them
    reference = _calibrated(False, **QUANTIZERS[quantizer])
    assert len(reference) > 5
    assert _calibrated(True, **QUANTIZERS[quantizer]) == reference
    with kernels.disabled():  # torch's reductions
        assert _calibrated(True, **QUANTIZERS[quantizer]) == reference


def test_strided_batches_requiring_grad_are_read_by_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not left to ``torch.aminmax`` of the strided tensor (4x the copy and the kernel)."""
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: calls.append(a) or aminmax(*a, **k))
    weight = nn.Parameter(torch.randn(64, 32))
    with torch.enable_grad():
        head = (torch.randn(8, 64) @ weight).reshape(8, 4, 8).transpose(0, 1)
        assert head.requires_grad and not head.is_contiguous() and not seen.matchable(head)
        found = minmax.plain_extremes(head)
        obs = MovingAverageMinMaxObserver()
        obs(head)
    detached = head.detach()
    assert found == (float(detached.min()), float(detached.max()))
    assert (float(obs.min_val), float(obs.max_val)) == found
    assert not calls
