"""convert's shortcuts against the paths they stand for (issue 43): each gives what torch's or the
observer's own path gives, bit for bit, on random and edge-case inputs.

* ``kernels.search_walk_native``: the histogram search's bin walk in C, against ``_Walk.peek``'s
  Python loop (itself checked against torchao's walk in ``test_perf_structure.py``);
* ``torchao_observer_classes.observe_constant``: a weight's statistics written directly, against
  the observer's own call on the weight;
* ``graph.attrs.module_getattr``: against ``getattr``;
* ``flow.convert._populate``'s direct registration, against torch's register methods (their
  global hooks see every value when any is registered).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import struct
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from _quantplug.graph.attrs import module_getattr
from _quantplug.observers import kernels
from _quantplug.observers.copies import fresh_copy
from _quantplug.observers.nonfinite import configure
from _quantplug.peers.torchao_observers import accelerate, observe_constant

qd = torch.ops.quantized_decomposed


def _bits(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes())


# ---------------------------------------------------------------- the histogram search's walk


@st.composite
def _histograms(draw: st.DrawFn) -> torch.Tensor:
    """float32 histograms: dense, sparse (runs of empty bins), mass at one end, tiny counts."""
    bins = draw(st.sampled_from([1, 2, 3, 8, 64, 257, 2048]))
    kind = draw(st.sampled_from(["dense", "sparse", "ends", "tiny", "single", "rounding"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    hist = torch.rand(bins, generator=g) * 100
    if kind == "rounding" and bins >= 4:
        # cumulative counts on the float32 roundings of the walk's first thresholds (k * 1e-5 *
        # total): which side of a threshold a count lies on is decided by that rounding
        total = draw(st.sampled_from([1000001.0, 12345679.0, 98765431.0, 3.0e9 + 1]))
        steps = draw(st.lists(st.integers(1, 4), min_size=1, max_size=bins - 2))
        edges = [
            float(torch.tensor(sum(steps[: i + 1]) * 1e-5 * total, dtype=torch.float32))
            for i in range(len(steps))
        ]
        counts = [edges[0]] + [b - a for a, b in itertools.pairwise(edges)]
        hist = torch.zeros(bins, dtype=torch.float64)
        hist[: len(counts)] = torch.tensor(counts, dtype=torch.float64)
        hist[-1] = total - sum(counts)
    if kind == "sparse":
        hist = hist * (torch.rand(bins, generator=g) < 0.05)
    elif kind == "ends":
        hist[bins // 2 :] = 0.0
        hist[0] = 1e6
    elif kind == "tiny":
        hist = hist * 1e-30
    elif kind == "single":
        hist = torch.zeros(bins)
        hist[draw(st.integers(0, bins - 1))] = draw(st.sampled_from([1.0, 3.0, 1e7]))
    return hist.to(torch.float32)


def _torchao_fast() -> Any:
    """The accelerated torchao observer classes (their module loads once torchao's has)."""
    pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.peers import torchao_observer_classes

    return torchao_observer_classes


def _walk_all(hist: torch.Tensor, native: bool, looks: list[int]) -> list[tuple[int, int]]:
    """Every candidate the walk proposes when each is accepted, ``looks`` candidates at a time."""
    torchao_fast = _torchao_fast()
    context = contextlib.nullcontext() if native else kernels.disabled()
    with context:
        walk = torchao_fast._Searches(hist[None], [0.5], 32).walks[0]
        assert (walk.native is not None) == native
        seen: list[tuple[int, int]] = []
        for n in looks:
            candidates = walk.peek(n)
            if not candidates:
                break
            for candidate in candidates[: max(1, n // 2)]:  # accept some, peek again from there
                seen.append(candidate)
                walk.accept()
        seen.append((walk.start_bin, walk.end_bin))
        return seen


@settings(max_examples=150, deadline=None)
@given(_histograms(), st.lists(st.integers(0, 6), min_size=1, max_size=12))
def test_native_search_walk_is_the_python_walk(hist: torch.Tensor, looks: list[int]) -> None:
    if kernels.search_walk_native() is None:
        pytest.skip("native kernels not built")
    assert _walk_all(hist, True, looks) == _walk_all(hist, False, looks)


def test_an_old_build_without_the_walk_walks_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernels module built before the walk existed: the Python walk runs, with its candidates."""

    class OldBuild:  # the entry points of an older build, without search_walk
        pass

    monkeypatch.setattr(kernels, "_native", OldBuild())
    assert kernels.search_walk_native() is None
    hist = torch.rand(64, generator=torch.Generator().manual_seed(0))
    walk = _torchao_fast()._Searches(hist[None], [0.5], 16).walks[0]
    assert walk.native is None and walk.peek(3)


# ---------------------------------------------------------------- a weight's statistics

_SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38, math.inf, -math.inf, math.nan, 1.0, -1.0]


@st.composite
def _weights(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(
        st.sampled_from([(1, 1), (3, 1), (1, 5), (7, 9), (16, 3, 3), (4, 2, 3, 3), (5,), (0, 4), (2, 0)])
    )
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * draw(st.sampled_from([1.0, 1e-20, 1e20]))
    kind = draw(st.sampled_from(["plain", "negative", "zeros", "special", "transposed", "float64"]))
    if kind == "negative":
        w = -w.abs() - 1e-3
    elif kind == "zeros" and w.numel():
        w.view(-1)[:: max(1, w.numel() // 3)] = 0.0
    elif kind == "special" and w.numel():
        w.view(-1)[draw(st.integers(0, w.numel() - 1))] = draw(st.sampled_from(_SPECIAL))
    elif kind == "transposed" and w.dim() == 2:
        w = w.t()  # not contiguous
    elif kind == "float64":
        w = w.double()
    return w


def _observer_state(obs: Any) -> tuple[Any, ...]:
    return _bits(obs.min_val), _bits(obs.max_val)


def _feed(obs: Any, w: torch.Tensor, fast: bool) -> tuple[str, Any]:
    """The observer's state after it is fed ``w`` (or the error it raises), and its qparams."""
    try:
        with torch.no_grad():
            if not (fast and observe_constant(obs, w)):
                obs(w)
    except Exception as exc:  # the same error either way
        return "error", type(exc).__name__
    state = _observer_state(obs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scale, zero_point = obs.calculate_qparams()
    except Exception as exc:
        return "state", (state, type(exc).__name__)
    return "state", (state, _bits(scale), _bits(zero_point))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _weights(),
    st.sampled_from([0, 1, -1]),
    st.sampled_from(
        [
            {"dtype": torch.qint8, "qscheme": torch.per_channel_symmetric},
            {"dtype": torch.quint8, "qscheme": torch.per_channel_affine},
            {"dtype": torch.quint8, "qscheme": torch.per_channel_affine, "reduce_range": True},
            {"dtype": torch.qint8, "qscheme": torch.per_channel_symmetric, "eps": 1e-3},
        ]
    ),
    st.sampled_from(["error", "ignore", None]),
    st.booleans(),
)
def test_observe_constant_is_the_observers_own_call(
    w: torch.Tensor, ch_axis: int, config: dict[str, Any], policy: str | None, fed_before: bool
) -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    prototype = accelerate(ao.PerChannelMinMaxObserver(ch_axis=ch_axis, **config))
    if policy is not None:  # convert's: the weight's name, the policy for NaN weights
        configure(prototype, policy, "w")
    if fed_before:  # a state already there: the shortcut declines
        with torch.no_grad():
            prototype(torch.ones(w.shape[ch_axis] if w.dim() > abs(ch_axis) else 1, 2))
    expected = _feed(fresh_copy(prototype), w, fast=False)
    assert _feed(fresh_copy(prototype), w, fast=True) == expected


def test_observe_constant_declines_what_the_call_would_do_otherwise() -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    if not kernels.enabled():
        pytest.skip("native kernels not built")
    w = torch.randn(8, 4)
    plain = accelerate(ao.PerChannelMinMaxObserver(ch_axis=0))
    assert observe_constant(fresh_copy(plain), w)  # the common path takes the shortcut
    hooked = fresh_copy(plain)
    calls: list[int] = []
    hooked.register_forward_hook(lambda *a: calls.append(1))
    assert not observe_constant(hooked, w) and not calls  # a hook: the call must run it
    subclass = type("Mine", (ao.PerChannelMinMaxObserver,), {})(ch_axis=0)
    assert not observe_constant(subclass, w)
    assert not observe_constant(ao.PerChannelMinMaxObserver(ch_axis=0), w)  # torchao's own class


# ---------------------------------------------------------------- getattr on modules


class _Custom(nn.Module):
    def __getattr__(self, name: str) -> Any:
        if name == "virtual":
            return "made up"
        return super().__getattr__(name)


class _WithClassAttrs(nn.Module):
    kind = "class attribute"

    @property
    def broken(self) -> Any:
        raise AttributeError("inside the property")


_NAMES = ["weight", "bias", "sub", "plain", "kind", "broken", "missing", "training", "virtual", "forward"]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([nn.Module, _Custom, _WithClassAttrs]),
    st.dictionaries(
        st.sampled_from([*_NAMES[:4], "missing", "broken"]),
        st.sampled_from(["parameter", "buffer", "module", "attribute", "none_buffer"]),
    ),
    st.sampled_from(_NAMES),
    st.sampled_from([(), (None,), ("default",)]),
)
def test_module_getattr_is_getattr(
    cls: type, placed: dict[str, str], name: str, default: tuple[Any, ...]
) -> None:
    m = cls()
    for where, how in placed.items():
        with contextlib.suppress(KeyError, AttributeError, TypeError):  # a name its class holds
            if how == "parameter":
                m.register_parameter(where, nn.Parameter(torch.ones(1)))
            elif how == "buffer":
                m.register_buffer(where, torch.zeros(1))
            elif how == "none_buffer":
                m.register_buffer(where, None)
            elif how == "module":
                m.add_module(where, nn.Identity())
            else:
                setattr(m, where, 7)

    def outcome(fn: Any) -> tuple[str, Any]:
        try:
            return "value", fn(m, name, *default)
        except AttributeError:
            return "error", None

    expected, got = outcome(getattr), outcome(module_getattr)
    assert got[0] == expected[0]
    if expected[0] == "value" and name != "forward":  # (a bound method is made at each lookup)
        assert got[1] is expected[1]
    assert module_getattr(3, "real", None) == 3 and module_getattr(None, "x", 5) == 5


# ---------------------------------------------------------------- registering the converted state


@contextlib.contextmanager
def _registration_hooks(seen: list[str]) -> Iterator[None]:
    from torch.nn.modules import module as torch_module

    handles = [
        torch_module.register_module_buffer_registration_hook(lambda m, n, b: seen.append(f"buffer {n}")),
        torch_module.register_module_parameter_registration_hook(
            lambda m, n, p: seen.append(f"parameter {n}")
        ),
        torch_module.register_module_module_registration_hook(lambda m, n, s: seen.append(f"module {n}")),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def test_converted_state_is_the_same_and_registration_hooks_see_it() -> None:
    import quantplug

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.fc = nn.Linear(4, 2)
            self.block = nn.Sequential(nn.LayerNorm(2))  # float weights below a nested path

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(self.fc(self.conv(x).mean((2, 3))))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    prepared = quantplug.prepare(
        torch.export.export(Net().eval(), (x,)), quantplug.get_quantizer("reference")
    )
    prepared(x)
    direct = quantplug.convert(prepared)
    seen: list[str] = []
    with _registration_hooks(seen):
        hooked = quantplug.convert(prepared)
    assert {s.split()[0] for s in seen} == {"buffer", "parameter", "module"}

    def state(gm: nn.Module) -> list[Any]:
        return [
            (name, type(t).__name__, _bits(t.detach()))
            for name, t in [*gm.named_parameters(), *gm.named_buffers()]
        ] + [(name, type(m).__name__) for name, m in gm.named_modules()]

    assert state(direct) == state(hooked) and direct.code == hooked.code


def test_bits_helper_reads_float_bits() -> None:  # (the comparisons above compare bytes)
    assert _bits(torch.tensor([-0.0]))[2] == struct.pack("f", -0.0)
