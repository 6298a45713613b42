"""convert's memory (issue 43.2): constants are quantized in row slices, never through whole-weight
float temporaries, and ``release_float_weights=True`` frees each float weight the prepared module
holds as its integers are written.

Memory is counted tensor by tensor (the storages alive, as tests/algorithms/test_gptq_memory.py
counts them), never read from the machine; the integers are the quantize ops' own, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_leaves

import _quantplug.flow.convert as convert_module
import quantplug
from _quantplug.errors import ConversionError
from _quantplug.flow.convert import QParams, _quantize_tensor
from _quantplug.observers.per_block import quantize_per_block
from tests.live_storage import LiveStorage

qd = torch.ops.quantized_decomposed
FAST = settings(max_examples=25, deadline=None)


class LiveBytes(LiveStorage):
    """Bytes of the storages alive: those made inside the mode, plus ``tracked`` tensors made
    before (each storage counted until its last tensor counted is collected; views of storages made
    before and not tracked are not counted); ``peak`` is their high-water mark."""

    def __init__(self, tracked: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        for tensor in tracked:
            self.count(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().nbytes() == 0:
                continue
            address = tensor.untyped_storage().data_ptr()
            if address in inputs and address not in self.views:
                continue  # a view of (or a write into) a storage made before and not tracked
            self.count(tensor)
        return out


# -- row slices: the ops' integers -------------------------------------------------------------

GRIDS = st.sampled_from([(-128, 127, torch.int8), (0, 255, torch.uint8), (0, 65535, torch.uint16)])


@FAST
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 9),
    grid=GRIDS,
    slice_elements=st.integers(1, 40),
    half=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_per_tensor_and_per_channel_slices_give_the_ops_integers(
    rows: int, cols: int, grid: Any, slice_elements: int, half: bool, seed: int
) -> None:
    qmin, qmax, dtype = grid
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 4
    x = x.half() if half else x
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert_module, "SLICE_ELEMENTS", slice_elements)
        qp = QParams(torch.tensor([0.03]), torch.tensor([qmin + 3]), qmin, qmax, dtype, "tensor")
        expected = qd.quantize_per_tensor.default(x, float(qp.scale), qmin + 3, qmin, qmax, dtype)
        assert torch.equal(_quantize_tensor(x, qp), expected)
        for axis in (0, 1, -1):
            n = x.shape[axis]
            scale = torch.rand(n, generator=g) * 0.1 + 1e-3
            zero_point = torch.randint(qmin, qmin + 8, (n,), generator=g)
            qp = QParams(scale, zero_point, qmin, qmax, dtype, "channel", axis=axis)
            expected = qd.quantize_per_channel.default(x, scale, zero_point, axis % 2, qmin, qmax, dtype)
            assert torch.equal(_quantize_tensor(x, qp), expected)


@FAST
@given(
    grid_rows=st.integers(1, 5),
    block_rows=st.sampled_from([1, 2, 3]),
    grid_cols=st.integers(1, 4),
    block_cols=st.sampled_from([1, 4, 8]),
    slice_elements=st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
def test_per_block_slices_give_the_ops_integers(
    grid_rows: int, block_rows: int, grid_cols: int, block_cols: int, slice_elements: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(grid_rows * block_rows, grid_cols * block_cols, generator=g) * 2
    scale = torch.rand(grid_rows, grid_cols, generator=g) * 0.2 + 1e-3
    zero_point = torch.zeros(grid_rows, grid_cols)
    block = (block_rows, block_cols)
    qp = QParams(scale, zero_point, -7, 7, torch.int8, "block", block_size=block, symmetric=True)
    expected = quantize_per_block(x, scale, zero_point, block, -7, 7, torch.int8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert_module, "SLICE_ELEMENTS", slice_elements)
        assert torch.equal(_quantize_tensor(x, qp), expected)
        assert torch.equal(_quantize_tensor(x.t(), _transposed(qp)), expected.t())


def _transposed(qp: QParams) -> QParams:
    block = tuple(reversed(qp.block_size or ()))
    return QParams(
        qp.scale.t(), qp.zero_point.t(), qp.quant_min, qp.quant_max, qp.dtype, "block", None, block
    )


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_quantizing_a_weight_holds_its_codes_and_one_slice(granularity: str) -> None:
    """Before the slices, LPBQ's quantize held four weight-sized float temporaries (the flow's peak
    at 110M parameters) and per-tensor/per-channel two."""
    w = torch.randn(256, 512)
    qp = {
        "tensor": QParams(torch.tensor([0.01]), torch.tensor([0]), -128, 127, torch.int8, "tensor"),
        "channel": QParams(torch.rand(256) + 0.01, torch.zeros(256, dtype=torch.int64), -128, 127, torch.int8,
                           "channel", axis=0),
        "block": QParams(torch.rand(256, 8) + 0.01, torch.zeros(256, 8), -7, 7, torch.int8, "block",
                         block_size=(1, 64)),
    }[granularity]  # fmt: skip
    slice_bytes = 4 * 4096
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert_module, "SLICE_ELEMENTS", 4096)
        with LiveBytes() as counted:
            codes = _quantize_tensor(w, qp)
    assert codes.numel() == w.numel()
    # the codes, plus one slice's few float temporaries (and the parameters' reciprocals)
    assert counted.peak <= codes.numel() + 6 * slice_bytes, counted.peak


# -- release_float_weights ---------------------------------------------------------------------


class Decoderish(nn.Module):
    """Embedding, three linears and a norm: weights quantized (per channel or LPBQ) and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(128, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


TOKENS = (torch.arange(16).reshape(1, 16) % 64,)


def _prepared(precision: str) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = Decoderish().eval()
    ep = torch.export.export(model, TOKENS)
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("qnn_htp", precision=precision))
    with torch.no_grad():
        prepared(*TOKENS)
    return model, ep, prepared


def _peak_during_convert(precision: str, release: bool) -> tuple[int, int, int]:
    """(peak live bytes while the integers are written, float weight bytes, integer code bytes) of
    a convert whose caller holds neither the float model nor the program (only the prepared module
    holds the weights). The peak is counted from the qparams on: observing a weight (before any
    integer exists) is the observers' own transient."""
    model, ep, prepared = _prepared(precision)
    weights = [p for p in model.parameters() if p.dim() == 2]
    float_bytes = sum(p.numel() * p.element_size() for p in weights)
    del model, ep
    qparams_of = convert_module.compute_qparams

    def qparams_then_count(*args: Any, **kwargs: Any) -> Any:
        found = qparams_of(*args, **kwargs)
        counted.peak = counted.live
        return found

    with pytest.MonkeyPatch.context() as patch, LiveBytes(weights) as counted:
        patch.setattr(convert_module, "SLICE_ELEMENTS", 1024)  # slices as small beside these weights
        patch.setattr(convert_module, "compute_qparams", qparams_then_count)
        del weights
        converted = quantplug.convert(prepared, release_float_weights=release)
    codes = sum(
        t.numel() * t.element_size() for t in converted.state_dict().values() if not t.is_floating_point()
    )
    return counted.peak, float_bytes, codes


@pytest.mark.parametrize("precision", ["16a8w", "16a4w_block"])
def test_release_frees_each_float_weight_as_its_integers_are_written(precision: str) -> None:
    kept, float_bytes, codes = _peak_during_convert(precision, release=False)
    freed, _, same_codes = _peak_during_convert(precision, release=True)
    assert same_codes == codes
    # without it: every float weight and every integer code at once
    assert kept >= float_bytes + codes
    # with it: the float weights and the codes of one weight (the largest, 128 x 256) at a time
    assert freed <= float_bytes + 128 * 256 + 64 * 1024, (freed, float_bytes, codes)


@pytest.fixture(scope="module", params=["16a8w", "16a4w_block"])
def released(request: pytest.FixtureRequest) -> dict[str, Any]:
    model, ep, prepared = _prepared(request.param)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = quantplug.convert(prepared)  # the prepared module stays usable without the option
    freed = quantplug.convert(prepared, release_float_weights=True)
    return dict(
        model=model, ep=ep, prepared=prepared, before=before, kept=kept, freed=freed, precision=request.param
    )


def test_release_gives_the_same_program(released: dict[str, Any]) -> None:
    kept, freed = released["kept"], released["freed"]
    assert freed.code == kept.code
    kept_state, freed_state = kept.state_dict(), freed.state_dict()
    assert kept_state.keys() == freed_state.keys()
    for name, value in kept_state.items():
        assert value.dtype == freed_state[name].dtype and torch.equal(value, freed_state[name]), name
    assert (
        sum(not v.is_floating_point() and v.dim() == 2 for v in freed_state.values()) >= 4
    )  # weights as codes
    with torch.no_grad():  # and it runs: what it reads float (qparams, float constants) is there
        assert torch.equal(freed(*TOKENS), kept(*TOKENS))


def test_release_leaves_the_callers_model_and_program(released: dict[str, Any]) -> None:
    model, ep = released["model"], released["ep"]
    state = model.state_dict()
    assert state.keys() == released["before"].keys()
    for name, value in released["before"].items():
        assert torch.equal(state[name], value), name
    with torch.no_grad():
        assert torch.equal(ep.module()(*TOKENS), model(*TOKENS))


def test_a_released_prepared_module_refuses_every_use(released: dict[str, Any]) -> None:
    prepared = released["prepared"]
    with pytest.raises(ConversionError, match=r"release_float_weights.*prepare the exported program again"):
        prepared(*TOKENS)
    with pytest.raises(ConversionError, match=r"release_float_weights.*prepare the exported program again"):
        quantplug.convert(prepared)
    with pytest.raises(ConversionError, match="release_float_weights is True or False"):
        quantplug.convert(_prepared("16a8w")[2], release_float_weights="yes")  # type: ignore[arg-type]


def test_quantize_converts_releasing_its_own_prepared_module(released: dict[str, Any]) -> None:
    """The one-call flow owns its prepared module: same program, the caller's model untouched."""
    model = released["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    program = quantplug.quantize(model, TOKENS, backend="qnn_htp", precision=released["precision"])
    assert program.code == released["kept"].code
    for name, value in released["kept"].state_dict().items():
        assert torch.equal(program.state_dict()[name], value), name
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name


# -- what the algorithms gathered ---------------------------------------------------------------
# GPTQ, SeqMSE and AdaRound sum an [I, I] float64 Hessian per input during calibration, the
# guard keeps batches, the float outputs and a simulation of the program: at 110M parameters more
# than the float weights. Convert needs them; the converted program does not, nor does a prepared
# module a releasing convert consumed.


class WideInput(nn.Module):
    """A layer whose Hessian (512 x 512 float64, 2 MiB) outweighs the whole quantized program."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(512, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.narrow(x)))


ALGORITHMS = ["gptq", "seq_mse", "adaround"]


def _calibrated_with_algorithms(algorithms: list[str]) -> tuple[Any, list[torch.Tensor]]:
    """A prepared module calibrated with ``algorithms`` (the guard on), and its Hessian sums."""
    from _quantplug.algorithms.weight_layers import LayerHessian
    from _quantplug.meta import ALGORITHMS_KEY

    torch.manual_seed(0)
    batches = [(torch.randn(64, 512),) for _ in range(6)]
    ep = torch.export.export(WideInput().eval(), batches[0])
    quantizer = quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(algorithms))
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    sums = [
        c.hessian.sum
        for by_algorithm in prepared.meta[ALGORITHMS_KEY].collectors.values()
        for c in by_algorithm.values()
        if isinstance(c, LayerHessian) and c.hessian is not None
    ]
    assert sums and max(s.numel() for s in sums) == 512 * 512
    return prepared, sums


def _alive(tensors: list[torch.Tensor]) -> Any:
    """A function telling how many of ``tensors`` are still alive (holding none of them)."""
    import gc
    import weakref

    refs = [weakref.ref(t) for t in tensors]

    def count() -> int:
        gc.collect()
        return sum(r() is not None for r in refs)

    return count


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_converted_program_holds_nothing_the_algorithms_gathered(algorithm: str) -> None:
    """A caller keeps the converted program and drops the prepared module: the Hessians, the
    stored batches and the guard's simulation go with it."""
    prepared, sums = _calibrated_with_algorithms([algorithm])
    alive = _alive(sums)
    del sums
    with LiveBytes() as counted:
        converted = quantplug.convert(prepared)
        assert alive() > 0  # the prepared module still holds them (it may convert again)
        del prepared
        assert alive() == 0
    own = sum(t.untyped_storage().nbytes() for t in converted.state_dict().values())
    assert counted.live <= own + 64 * 1024, (counted.live, own)  # its own tensors, not 2 MiB of sums


def test_a_releasing_convert_gives_up_the_algorithms_statistics() -> None:
    """``release_float_weights=True`` consumes the prepared module: a caller that still holds it
    holds none of the sums, while the guard's verdicts stay readable for the report."""
    from _quantplug.errors import AlgorithmError
    from _quantplug.meta import ALGORITHMS_KEY

    prepared, sums = _calibrated_with_algorithms(ALGORITHMS)
    alive = _alive(sums)
    del sums
    kept = quantplug.convert(prepared)  # without the option the prepared module keeps them
    assert alive() > 0
    freed = quantplug.convert(prepared, release_float_weights=True)
    assert alive() == 0
    for name, value in kept.state_dict().items():  # the same program
        assert torch.equal(freed.state_dict()[name], value), name
    run = prepared.meta[ALGORITHMS_KEY]
    assert run.collectors == {} and run.inputs is None and run.held_out is None
    assert run.guarded is not None and run.guarded.tried == 2 and run.guarded.summary()
    assert run.guarded.reference == [] and run.guarded.inputs == ()  # the verdicts, not what judged
    with pytest.raises(AlgorithmError, match="has judged"):  # its simulation is gone, not stale
        run.guarded.evaluate({})
