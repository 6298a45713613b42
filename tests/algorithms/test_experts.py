"""Mixture-of-experts weights are layers of the weight algorithms (``_quantplug.algorithms.experts``).

transformers' batched experts export as ``bmm(W[ids], x)`` with ``W [experts, out, in]``: no
algorithm took them (Mixtral at reference weight_only_int4: 85 % of its weights kept
round-to-nearest whatever was asked). Each expert is now a linear over the rows routed to it,
with a Hessian of its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.algorithms.experts import packed_rows, routed_rows
from _quantplug.algorithms.registry import create_algorithm
from _quantplug.algorithms.spec import Algorithm, WeightGrid, WeightSite
from _quantplug.algorithms.weight_layers import LayerHessian, layer_kind

EXPERTS, IN, OUT, TOP_K = 4, 16, 24, 2


@settings(max_examples=60, deadline=None)
@given(
    experts=st.integers(1, 5),
    ids=st.lists(st.integers(0, 4), min_size=0, max_size=30),
    k=st.integers(1, 3),
)
def test_packed_rows_hold_each_experts_rows_in_order_and_zeros_after(
    experts: int, ids: list[int], k: int
) -> None:
    ids = [i % experts for i in ids]
    g = torch.Generator().manual_seed(len(ids) * 7 + k)
    x = torch.randn(len(ids), 3, k, generator=g)
    rows, owner = routed_rows(x, torch.tensor(ids, dtype=torch.int64))
    packed = packed_rows(rows, owner, experts)
    assert packed.shape[0] == experts
    for e in range(experts):
        mine = rows[owner == e]
        assert torch.equal(packed[e, : len(mine)], mine)
        assert not packed[e, len(mine) :].any()
        # what a Hessian sums: the expert's own rows, nothing of the others'
        torch.testing.assert_close(packed[e].T @ packed[e], mine.T @ mine)


class Experts(nn.Module):
    """transformers' ``batched_mm`` experts: each token row is multiplied by the ``[out, in]``
    slices of one stacked parameter that its ``TOP_K`` experts own; ``in_out``: the slices are
    stored ``[in, out]`` and the product is ``bmm(x, W[ids])`` (GPT-OSS). The route is read off
    the input (no router weights), so every weight the algorithms can choose is the experts'."""

    def __init__(self, in_out: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(EXPERTS, OUT, IN, generator=g) / IN**0.5
        self.in_out = in_out
        self.weight = nn.Parameter(weight.transpose(1, 2).contiguous() if in_out else weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, IN)
        gates, ids = tokens[:, :EXPERTS].softmax(-1).topk(TOP_K, dim=-1)
        rows = tokens.repeat_interleave(TOP_K, dim=0)
        chosen = self.weight[ids.reshape(-1)]
        if self.in_out:
            out = torch.bmm(rows.unsqueeze(1), chosen).squeeze(1)
        else:
            out = torch.bmm(chosen, rows.unsqueeze(-1)).squeeze(-1)
        mixed = (out * gates.reshape(-1, 1)).reshape(-1, TOP_K, OUT).sum(1)
        return mixed.reshape(*x.shape[:-1], OUT)


def _batches(count: int) -> list[torch.Tensor]:
    # correlated features, as a model's hidden states are: GPTQ's error feedback has room to work
    mixing = torch.randn(IN, IN, generator=torch.Generator().manual_seed(9)) * torch.logspace(0, -2, IN)
    return [torch.randn(4, 12, IN, generator=torch.Generator().manual_seed(i)) @ mixing for i in range(count)]


class Hessians(Algorithm):
    """Records each site and the Hessian its collector summed."""

    name = "hessians"

    def __init__(self) -> None:
        self.sites: dict[str, WeightSite] = {}
        self.collected: dict[str, Any] = {}

    def collector(self, site: WeightSite) -> LayerHessian:
        self.sites[site.name] = site
        return LayerHessian(site, grouped=True)

    def choose_weight(self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any) -> None:
        self.collected[site.name] = collected


def _hessians(
    model: nn.Module, batches: list[torch.Tensor], nonfinite: str = "error"
) -> tuple[WeightSite, torch.Tensor]:
    """The experts' site and the Hessians its collector summed, at reference weight_only_int4."""
    program = torch.export.export(model, (batches[0],))
    algorithm = Hessians()
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(program, quantizer, algorithms=[algorithm], nonfinite=nonfinite)
    for batch in batches:
        prepared(batch)
    quantplug.convert(prepared)
    return algorithm.sites["weight"], algorithm.collected["weight"]


def _routed_sums(batches: list[torch.Tensor]) -> torch.Tensor:
    """``sum x x^T`` of each expert's finite rows, computed from the route :class:`Experts` takes."""
    expected = torch.zeros(EXPERTS, IN, IN, dtype=torch.float64)
    for batch in batches:
        tokens = batch.reshape(-1, IN)
        ids = tokens[:, :EXPERTS].topk(TOP_K, dim=-1)[1].reshape(-1)
        routed = tokens.repeat_interleave(TOP_K, dim=0).double()
        finite = torch.isfinite(routed).all(dim=1)
        for e in range(EXPERTS):
            rows = routed[(ids == e) & finite]
            expected[e] += rows.T @ rows
    return expected


def _same_up_to_scale(collected: torch.Tensor, expected: torch.Tensor) -> None:
    # the mean over the packed rows: each expert's sum over one row count (a scale per layer)
    assert collected.shape == (EXPERTS, IN, IN)
    torch.testing.assert_close(
        collected / collected[0, 0, 0], expected / expected[0, 0, 0], rtol=1e-6, atol=1e-9
    )


@pytest.mark.parametrize("in_out", [False, True])
def test_each_expert_sums_the_hessian_of_the_rows_routed_to_it(in_out: bool) -> None:
    torch.manual_seed(0)
    batches = _batches(2)
    site, collected = _hessians(Experts(in_out).eval(), batches)
    assert layer_kind(site) == "experts" and site.has_layer and site.in_out == in_out
    assert LayerHessian(site, grouped=True).stack == EXPERTS  # what the memory warning counts
    _same_up_to_scale(collected, _routed_sums(batches))


#: (backend, algorithm) -> floor on its gain (dB, held out). Measured with the experts as layers:
#: reference +2.83, +6.55, +0.51; qnn_htp +2.97, +2.01, +0.76. Without: +0.00 each, but SeqMSE's
#: search without data, +1.21 and +1.28
GAINS = {
    ("reference", "gptq"): 1.5,
    ("reference", "seq_mse"): 3.0,
    ("reference", "adaround"): 0.3,
    ("qnn_htp", "gptq"): 1.5,
    ("qnn_htp", "seq_mse"): 1.6,
    ("qnn_htp", "adaround"): 0.3,
}
QUANTIZERS = {
    "reference": {"preset": "weight_only_int4"},
    # the experts on the weight grid (by default qnn_htp gives gathered weights the activation one)
    "qnn_htp": {"precision": "16a4w", "per_channel_embedding": True},
}


@pytest.mark.parametrize(
    ("sequential", "in_out"), [(False, False), (True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize(("backend", "algorithm"), list(GAINS))
def test_weight_algorithms_take_the_experts_and_gain_on_them(
    backend: str, algorithm: str, sequential: bool, in_out: bool
) -> None:
    """Sequential inputs are fed through the gather (its expert ids) and the product (its rows).
    A weight stored ``[experts, in, out]`` is the same layer: the same gains."""
    torch.manual_seed(0)
    model = Experts(in_out).eval()
    batches = _batches(6)
    program = torch.export.export(model, (batches[0],))
    quantizer = quantplug.get_quantizer(backend, **QUANTIZERS[backend])

    def held_out_sqnr(algorithms: list[Any]) -> tuple[float, Any]:
        prepared = quantplug.prepare(
            program, quantizer, algorithms=quantplug.Algorithms(algorithms, calibration=batches[:4])
        )
        for batch in batches[:4]:
            prepared(batch)
        converted = quantplug.convert(prepared)
        with torch.no_grad():
            want, got = model(batches[4]), converted(batches[4])
        return float(10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())), converted

    default, _ = held_out_sqnr([])
    chosen = create_algorithm(algorithm, {"sequential": sequential})
    gained, converted = held_out_sqnr([chosen])
    assert gained > default + GAINS[backend, algorithm], (default, gained)
    # the experts' codes stay on the backend's int4 grid
    dq = next(n for n in converted.graph.nodes if n.target == torch.ops.aten.index.Tensor).args[0]
    codes = getattr(converted, dq.args[0].target)
    assert codes.shape == model.weight.shape and int(codes.min()) >= -8 and int(codes.max()) <= 7


def test_nan_rows_reaching_the_experts_follow_the_nonfinite_policy() -> None:
    """A weight-only preset has no activation observer: the experts' tap is what sees NaN. Under
    "error" it names the weight; under "ignore" only the token's rows are left out, so each
    expert's Hessian sums the others."""
    from _quantplug.errors import NonFiniteError

    torch.manual_seed(0)
    model = Experts().eval()
    clean = _batches(2)
    bad = [b.clone() for b in clean]
    bad[1][0, 3, 7] = float("nan")  # one token of the second batch (its route stays finite)
    program = torch.export.export(model, (clean[0],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(program, quantizer, algorithms=["gptq"])
    prepared(bad[0])
    with pytest.raises(NonFiniteError) as raised:
        prepared(bad[1])
    assert raised.value.where == "weight" and "gptq" in str(raised.value)

    _, ignored = _hessians(model, bad, "ignore")
    _same_up_to_scale(ignored, _routed_sums(bad))  # every expert's rows but the token's
