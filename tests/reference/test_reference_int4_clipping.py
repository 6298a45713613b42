"""weight_only_int4's groups clipped to their range of least squared error
(``quantplug_reference.observers``): never a larger weight error than min-max, the same ranges
when a weight is observed again, the same symmetric grid (so ``MatMulNBits`` still runs it), and
int8 embedding tables beside it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.flow.inspect import encodings
from quantplug.backend import PerBlockMinMaxObserver
from quantplug_reference.observers import ClippedPerBlockObserver

INT4: torch.dtype = torch.int4  # type: ignore[attr-defined]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _observers(group: int) -> tuple[PerBlockMinMaxObserver, PerBlockMinMaxObserver]:
    kwargs = dict(block_size=(1, group), dtype=INT4, quant_min=-8, quant_max=7, eps=2**-12)
    return PerBlockMinMaxObserver(**kwargs), ClippedPerBlockObserver(**kwargs)


def _block_errors(w: torch.Tensor, observer: PerBlockMinMaxObserver, group: int) -> torch.Tensor:
    """Squared error of ``w`` on the observer's grid, per block."""
    scale, zero = observer.calculate_qparams()
    s = scale.repeat_interleave(group, dim=1)
    q = torch.clamp(torch.round(w / s) + zero.repeat_interleave(group, dim=1), -8, 7)
    return ((q * s - w) ** 2).reshape(w.shape[0], -1, group).sum(-1)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 8),
    blocks=st.integers(1, 4),
    group=st.sampled_from([16, 32]),
    tail=st.floats(0.5, 8.0),
)
def test_clipped_groups_never_have_a_larger_error_than_min_max(
    seed: int, rows: int, blocks: int, group: int, tail: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, blocks * group, generator=g)
    w[:, ::group] *= tail  # an outlier-ish weight per group, of varying size
    min_max, clipped = _observers(group)
    min_max(w)
    clipped(w)
    assert bool((_block_errors(w, clipped, group) <= _block_errors(w, min_max, group) * (1 + 1e-6)).all())
    # the ranges only shrink, by a fraction between 0.5 and 1
    assert bool((clipped.max_val <= min_max.max_val).all())
    assert bool((clipped.min_val >= min_max.min_val).all())
    ratio = clipped.max_val.abs().maximum(clipped.min_val.abs()) / min_max.max_val.abs().maximum(
        min_max.min_val.abs()
    ).clamp_min(1e-30)
    assert float(ratio.min()) >= 0.5 - 1e-6


def test_observing_the_same_weight_again_gives_the_same_grid() -> None:
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    _, clipped = _observers(32)
    clipped(w)
    first = [t.clone() for t in clipped.calculate_qparams()]
    clipped(w)
    assert all(torch.equal(a, b) for a, b in zip(first, clipped.calculate_qparams()))


def test_heavy_tailed_groups_are_clipped_and_the_layer_gains() -> None:
    """Laplace weights (a trained layer's shape): clipping lowers the output error of the layer."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 64).eval()
    with torch.no_grad():
        lin.weight.copy_(torch.distributions.Laplace(0.0, 0.05).sample((64, 128)))
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    ep = torch.export.export(lin, (x[:8],))
    converted = quantplug.convert(
        quantplug.prepare(ep, quantplug.get_quantizer("reference", preset="weight_only_int4"))
    )
    min_max, _ = _observers(32)
    min_max(lin.weight.detach())
    scale, _ = min_max.calculate_qparams()
    s = scale.repeat_interleave(32, dim=1)
    plain = torch.clamp(torch.round(lin.weight.detach() / s), -8, 7) * s
    with torch.no_grad():
        ref = lin(x)
        err_clipped = float((converted(x) - ref).pow(2).sum())
        err_min_max = float((x @ plain.T + lin.bias - ref).pow(2).sum())
    assert err_clipped < 0.9 * err_min_max, (err_clipped, err_min_max)
    (entry,) = [e for e in encodings(converted) if e["kind"] == "constant"]
    assert (entry["quant_min"], entry["quant_max"], entry["block_size"]) == (-8, 7, [1, 32])  # same grid


class TokenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.fc = nn.Linear(64, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


def test_int4_embedding_tables_are_int8_per_row_and_the_linears_run_as_matmulnbits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("onnxruntime")
    import onnx

    torch.manual_seed(0)
    model = TokenLinear().eval()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    ep = torch.export.export(model, (idx,))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    converted = quantplug.convert(quantplug.prepare(ep, quantizer))
    table = {e["tensor"]: e for e in encodings(converted) if e["kind"] == "constant"}
    emb = next(e for name, e in table.items() if "emb" in name)
    fc = next(e for name, e in table.items() if "fc" in name)
    assert (emb["granularity"], emb["quant_min"], emb["quant_max"]) == ("channel", -127, 127)
    assert (fc["granularity"], fc["quant_min"], fc["quant_max"]) == ("block", -8, 7)
    artifact = quantplug.lower(converted, quantizer)
    artifact.save(tmp_path)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops
    with torch.no_grad():
        assert torch.allclose(artifact.run(idx), converted(idx), atol=1e-5)
