"""convert's native kernels compute what the torch steps compute, bit for bit.

``kernels.row_extremes`` stands for ``amin``/``amax`` along rows (the per-channel weight
observer's forward) and ``kernels.quantize_rows`` for ``clamp(round(x * inverse) + zero_point)``
(convert's weight integers); both decline what they cannot reproduce, and an older build of the
extension without them is not called. Compared here with the torch path of the same function
(``kernels.disabled()``), under the AVX2 and the scalar code, and end to end on an exported model.
``kernels.search_norms`` (torchao's histogram clipping search) is compared with torchao itself in
test_perf_structure.py; here, what it declines.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantplug
from _quantplug.flow.convert import QParams, _native_codes, _quantize_tensor
from _quantplug.observers import kernels
from tests.core.kernel_code import simd as simd_code

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built (no C compiler)")

FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=True, allow_subnormal=True)


SIMD = pytest.mark.parametrize("simd", ["avx2", "scalar"])


def _both_paths(x: torch.Tensor, qp: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    native = _quantize_tensor(x, qp)
    with kernels.disabled():
        reference = _quantize_tensor(x, qp)
    return native, reference


@st.composite
def _cases(draw: Any) -> tuple[torch.Tensor, QParams]:
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 70))
    values = draw(
        st.lists(
            FLOAT32 | st.integers(-600, 600).map(lambda k: k / 2), min_size=rows * cols, max_size=rows * cols
        )
    )
    x = torch.tensor(values, dtype=torch.float32).reshape(rows, cols)
    dtype, lo, hi = draw(
        st.sampled_from([(torch.int8, -128, 127), (torch.uint8, 0, 255), (torch.int8, -100, 90)])
    )
    per_channel = draw(st.booleans())
    n = rows if per_channel else 1
    scale_values = st.floats(2**-20, 1024.0, width=32) | st.sampled_from([0.5, 1.0, 0.1])
    scales = draw(st.lists(scale_values, min_size=n, max_size=n))
    points = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    scale, zero_point = torch.tensor(scales, dtype=torch.float32), torch.tensor(points)
    if per_channel:
        return x, QParams(scale, zero_point, lo, hi, dtype, "channel", axis=0)
    return x, QParams(scale, zero_point, lo, hi, dtype, "tensor")


@SIMD
@settings(max_examples=150, deadline=None)
@given(case=_cases())
def test_native_weight_integers_are_the_torch_steps(simd: str, case: tuple[torch.Tensor, QParams]) -> None:
    """Ties (k / 2), infinities, values far beyond the range and tiny scales included."""
    x, qp = case
    with simd_code(simd == "avx2"):
        assert _native_codes(x, qp) is not None  # no NaN product can arise: the kernel answers
        native, reference = _both_paths(x, qp)
    assert native.dtype == reference.dtype and native.stride() == reference.stride()
    assert torch.equal(native, reference)


def test_native_path_is_taken_and_declines_what_it_cannot_reproduce() -> None:
    x = torch.randn(6, 40)
    qp = QParams(
        torch.full((6,), 0.02), torch.zeros(6, dtype=torch.int64), -128, 127, torch.int8, "channel", axis=0
    )
    inverse, zero = 1.0 / qp.scale, qp.zero_point.float()
    assert kernels.quantize_rows(x, inverse, zero, -128, 127, torch.int8) is not None
    x[3, 7] = float("nan")  # torch's clamp keeps NaN: the torch path decides
    assert kernels.quantize_rows(x, inverse, zero, -128, 127, torch.int8) is None
    x = x.nan_to_num()
    assert kernels.quantize_rows(x, inverse, zero, -128, 200, torch.int8) is None  # beyond int8
    assert kernels.quantize_rows(x, inverse, zero, -128, 127, torch.int16) is None
    assert kernels.quantize_rows(x.t(), inverse, zero, -128, 127, torch.int8) is None  # not contiguous
    assert kernels.quantize_rows(x, inverse.double(), zero, -128, 127, torch.int8) is None


@SIMD
def test_row_extremes_are_amin_and_amax_and_decline_zero_and_nonfinite_extremes(simd: str) -> None:
    g = torch.Generator().manual_seed(0)
    with simd_code(simd == "avx2"):
        for cols in (1, 7, 16, 33, 300):
            x = torch.randn(9, cols, generator=g) * 100
            found = kernels.row_extremes(x)
            assert found is not None
            assert torch.equal(found[0], x.amin(1)) and torch.equal(found[1], x.amax(1))
        for bad in (0.0, -0.0, float("nan"), float("inf")):
            y = x.abs() + 1 if bad == 0.0 else x.clone()
            y[4, 5] = bad  # a zero minimum (either sign), a NaN, an infinity
            assert kernels.row_extremes(y) is None


def test_an_older_build_without_the_constant_kernels_is_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place build from an older source lacks the entry points: the torch steps run."""
    from _quantplug.observers import _histogram_kernels as raw

    older = types.SimpleNamespace(
        **{k: getattr(raw, k) for k in ("minmax", "bin_counts", "observe", "rebin")}
    )
    monkeypatch.setattr(kernels, "_native", older)
    x = torch.randn(4, 10)
    assert kernels.row_extremes(x) is None
    assert kernels.quantize_rows(x, torch.ones(1), torch.zeros(1), -128, 127, torch.int8) is None
    qp = QParams(torch.tensor([0.01]), torch.tensor([3]), -128, 127, torch.int8, "tensor")
    native, reference = _both_paths(x, qp)
    assert torch.equal(native, reference)


def test_converted_program_is_the_same_with_and_without_the_kernels() -> None:
    """A conv + linear model through torchao's X86 annotations (per-channel weights) end to end."""
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.fc = torch.nn.Linear(8 * 6 * 6, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.relu(self.conv(x)).flatten(1))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    program = torch.export.export(Net().eval(), (x,))
    results = []
    for off in (False, True):
        with kernels.disabled() if off else contextlib.nullcontext():
            quantizer = x86.X86InductorQuantizer().set_global(
                x86.get_default_x86_inductor_quantization_config()
            )
            prepared = quantplug.prepare(program, quantizer)
            prepared(x)
            converted = quantplug.convert(prepared)
        results.append((converted.state_dict(), converted(x)))
    (state, out), (state_torch, out_torch) = results
    assert state.keys() == state_torch.keys()
    assert all(torch.equal(state[k], state_torch[k]) for k in state)
    assert torch.equal(out, out_torch)


def test_search_norms_declines_operands_it_cannot_read() -> None:
    """torchao's clipping search falls back to its torch operations then (nothing written)."""
    density, width = torch.rand(2, 16), torch.rand(2, 1)
    columns = tuple(torch.rand(3, 1) for _ in range(5))
    out = torch.full((3, 16), 7.0)
    assert kernels.search_norms(density, width, None, columns, 7, 0, 3, out)  # type: ignore[arg-type]
    assert torch.isfinite(out).all()
    untouched = torch.full((3, 16), 7.0)
    for bad in (
        dict(density=density.double()),
        dict(out=torch.full((16, 3), 7.0).t()),
        dict(owner=torch.tensor([0, 1, 1], dtype=torch.int32)),
    ):
        args: dict[str, Any] = dict(density=density, owner=None, out=untouched) | bad
        kwargs = dict(bin_width=width, columns=columns, top=7, first=0, rows=3)
        assert not kernels.search_norms(**args, **kwargs)  # type: ignore[arg-type]
        assert (untouched == 7.0).all()


def _torch_errors(x: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The torch steps of ``GroupCandidates.error``: ``x - clamp(round(x / s), lo, hi) * s``."""
    s = scale.reshape(-1, *([1] * (x.dim() - 1)))
    codes = torch.div(x, s).round_().clamp_(lo, hi).mul_(s)
    return torch.sub(x, codes)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN, and the same sign of every zero."""
    nan = a.isnan()
    return (
        torch.equal(nan, b.isnan())
        and torch.equal(a[~nan], b[~nan])
        and torch.equal(a[~nan].signbit(), b[~nan].signbit())
    )


@st.composite
def _error_cases(draw: Any) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 70))
    values = draw(
        st.lists(
            FLOAT32
            | st.integers(-600, 600).map(lambda k: k / 2)
            | st.sampled_from([0.0, -0.0, float("nan")]),
            min_size=rows * cols,
            max_size=rows * cols,
        )
    )
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    x = torch.tensor(values, dtype=torch.float32).to(dtype).reshape(rows, cols)
    if dtype is torch.float64:  # values float32 cannot hold as well
        x = x * (1 + draw(st.floats(0, 1e-6)))
    n = rows if draw(st.booleans()) else 1
    scale_values = st.floats(2**-20, 1024.0, width=32) | st.sampled_from([0.5, 1.0, 0.1, 0.0])
    scale = torch.tensor(draw(st.lists(scale_values, min_size=n, max_size=n)), dtype=dtype)
    lo, hi = draw(st.sampled_from([(-8, 7), (-7, 7), (-128, 127), (-32768, 32767), (-1, 1)]))
    return x, scale, lo, hi


@SIMD
@settings(max_examples=150, deadline=None)
@given(case=_error_cases())
def test_native_quantization_errors_are_the_torch_steps(
    simd: str, case: tuple[torch.Tensor, torch.Tensor, int, int]
) -> None:
    """SeqMSE's candidate errors in one pass: ties (k / 2), NaN, infinities, signed zeros, a zero
    scale (infinite and NaN quotients), float32 and float64, one scale per row or one for all."""
    x, scale, lo, hi = case
    out = torch.full_like(x, 12345.0)
    with simd_code(simd == "avx2"):
        assert kernels.quantization_errors(x, scale, lo, hi, out)
    assert _same_values(out, _torch_errors(x, scale, lo, hi))


def test_quantization_errors_decline_what_they_cannot_reproduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is written where the kernel is not called: the caller's torch steps run."""
    x, scale = torch.randn(6, 40), torch.full((6,), 0.02)
    out = torch.zeros(6, 40)
    assert kernels.quantization_errors(x, scale, -8, 7, out)
    untouched = torch.zeros(6, 40)
    for args in (
        (x, scale, 0, 15, untouched),  # an unsigned grid: a clamp bound of zero
        (x, scale, -8, 0, untouched),
        (x, scale.double(), -8, 7, untouched),  # mixed dtypes
        (x.t().contiguous().t(), scale, -8, 7, untouched),  # not contiguous
        (x, torch.full((3,), 0.02), -8, 7, untouched),  # neither one scale nor one per row
        (x.half(), scale.half(), -8, 7, untouched.half()),
        (x, scale, -8, 7, x),  # in place
        (x, scale, -8, 7, torch.zeros(6, 41)),
    ):
        assert not kernels.quantization_errors(*args)  # type: ignore[arg-type]
    assert not untouched.any()
    with kernels.disabled():
        assert not kernels.quantization_errors(x, scale, -8, 7, untouched)
    from _quantplug.observers import _histogram_kernels as raw

    older = types.SimpleNamespace(**{k: getattr(raw, k) for k in ("minmax", "quantize_rows")})
    monkeypatch.setattr(kernels, "_native", older)
    assert not kernels.quantization_errors(x, scale, -8, 7, untouched)
    assert not untouched.any()
