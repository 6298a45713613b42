"""Accuracy algorithms under distributed calibration (gloo on 127.0.0.1): 2 ranks against 1 process.

Collectors (layer Hessians, input means, samples) and the store of batches for sequential layer
inputs merge across ranks with the observers, so every rank converts the same program, and
where the merge is a sum it is the program one process calibrating on every batch converts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.launch import run_ranks
from tests.distributed.worker import ALGORITHM_RUNS, algo_batches

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = run_ranks("algorithms", 2, tmp_path_factory.mktemp("ranks"), deadline=400.0)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.output[-4000:]}"
    return [r.result for r in results]


@pytest.mark.parametrize("label", list(ALGORITHM_RUNS))
def test_each_built_in_algorithm_converts_what_one_process_converts(
    two_ranks: list[dict[str, Any]], label: str
) -> None:
    r0, r1 = (r[label] for r in two_ranks)
    # what the collectors hold: the same on every rank, and (sums in rank order, float64) one
    # process's up to the order of the additions
    assert r0["collected"].keys() == r0["single_collected"].keys()
    torch.testing.assert_close(r0["collected"], r1["collected"], rtol=0, atol=0)
    torch.testing.assert_close(r0["collected"], r0["single_collected"], rtol=1e-12, atol=0)
    assert r0["digest"] == r1["digest"], f"{label}: the ranks converted different programs"
    assert r0["digest"] == r0["single_digest"], f"{label}: 2 ranks converted another program than 1 process"


def test_a_reservoir_sample_merges_into_one_sample_of_every_ranks_rows(
    two_ranks: list[dict[str, Any]],
) -> None:
    from tests.distributed.worker import AlgoNet

    r0, r1 = (r["sample_rows"] for r in two_ranks)
    (name,) = [n for n in r0 if n.endswith("fc1.weight")]
    sample = r0[name]
    assert torch.equal(sample, r1[name])  # the same merge on every rank
    assert sample.shape == (20, 16)  # the cap, filled: 288 rows were seen over the ranks
    torch.manual_seed(0)
    norm = AlgoNet().eval().norm
    with torch.no_grad():  # the layer's input rows, by rank (round robin over the batches)
        shares = [torch.cat([norm(x).reshape(-1, 16) for x in algo_batches()[r::2]]) for r in (0, 1)]
    source = []
    for row in sample:
        hits = [r for r, rows in enumerate(shares) if bool(torch.isclose(rows, row, atol=1e-5).all(1).any())]
        assert hits, "a merged row that no rank saw"
        source.append(hits[0])
    assert set(source) == {0, 1}  # drawn from both ranks' rows
    assert len({tuple(row.tolist()) for row in sample}) == 20  # no row twice


def test_a_collector_without_a_merge_hook_is_refused_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    errors = [r["unmergeable"] for r in two_ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert errors[0].startswith("CollectorMergeError")
    for word in ("'unmergeable'", "Count", "merge_", "one process"):
        assert word in errors[0], errors[0]


def test_transforms_given_other_data_on_each_rank_are_named(two_ranks: list[dict[str, Any]]) -> None:
    errors = [r["transform_data"] for r in two_ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert errors[0].startswith("DistributedError")
    assert "calibration=" in errors[0] and "weight" in errors[0], errors[0]


def test_held_out_batches_given_per_rank_are_merged_so_every_rank_judges_alike(
    two_ranks: list[dict[str, Any]],
) -> None:
    from tests.distributed.worker import algo_batches

    r0, r1 = (r["held_out"] for r in two_ranks)
    expected = algo_batches()[:4]  # rank 0's batches 0 and 2, rank 1's 1 and 3, round robin
    for found in (r0, r1):
        assert len(found["batches"]) == 4
        for got, want in zip(found["batches"], expected):
            assert torch.equal(got, want)
    assert r0["digest"] == r1["digest"] == r0["single_digest"]
    for found in (r0, r1):  # given the same batches everywhere (as quantize --nproc): kept, not doubled
        assert len(found["same_batches"]) == 3
        assert all(torch.equal(got, want) for got, want in zip(found["same_batches"], expected))


def test_held_out_batches_on_some_ranks_only_are_named(two_ranks: list[dict[str, Any]]) -> None:
    errors = [r["held_out_on_one_rank"] for r in two_ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert errors[0].startswith("DistributedError")
    for words in ("algorithm guard judging on held-out batches", "held_out=...) on every rank"):
        assert words in errors[0], errors[0]
