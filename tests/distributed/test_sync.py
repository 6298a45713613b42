"""sync_observers across real processes (gloo on 127.0.0.1): 2 ranks against 1 process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _ok(results: list) -> None:  # type: ignore[type-arg]
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.output[-4000:]}"


def _assert_same_qparams(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), f"observer {name}: {x.tolist()} != {y.tolist()}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list:  # type: ignore[type-arg]
    """One 2-rank group running the calibrate, qat and mismatch scenarios of worker.py."""
    results = run_ranks("all", 2, tmp_path_factory.mktemp("ranks"))
    _ok(results)
    return [r.result for r in results]


def test_two_ranks_give_one_process_qparams(two_ranks: list) -> None:  # type: ignore[type-arg]
    r0, r1 = (r["calibrate"] for r in two_ranks)
    for option in ("minmax", "moving_average", "histogram", "qnn_htp_minmax"):
        assert r0[option]["merged"] == r1[option]["merged"] > 0
        # the identical converted program (graph and every tensor, bit for bit) on every rank
        assert r0[option]["digest"] == r1[option]["digest"]
        _assert_same_qparams(r0[option]["qparams"], r1[option]["qparams"])
    # min-max kinds (qnn_htp: its concat observer too): exactly one process's qparams, and the
    # same converted program
    for option in ("minmax", "qnn_htp_minmax"):
        _assert_same_qparams(r0[option]["qparams"], r0[option]["single"])
        assert r0[option]["digest"] == r0[option]["single_digest"]
    # histograms: within a hundredth of a step of one process's (see test_merge for the SQNR)
    for name, (scale, _) in r0["histogram"]["qparams"].items():
        single = r0["histogram"]["single"][name][0]
        torch.testing.assert_close(scale, single, rtol=1e-2, atol=0.0)


def test_ranks_that_prepared_different_programs_get_the_same_clear_error(two_ranks: list) -> None:  # type: ignore[type-arg]
    errors = [r["mismatch"]["error"] for r in two_ranks]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "prepared different programs" in errors[0]
    assert "float32[32, 16]" in errors[0] and "float32[48, 16]" in errors[0]  # names what differs


def test_a_rank_that_never_arrives_is_named_after_the_timeout(tmp_path: Path) -> None:
    results = run_ranks("missing", 2, tmp_path, deadline=120)
    error = results[0].result["error"]
    assert error is not None and "within 0:00:03" in error
    assert "Ranks 1" in error or "rank 1" in error.lower()


def test_qat_under_ddp_keeps_every_ranks_statistics(two_ranks: list) -> None:  # type: ignore[type-arg]
    r0, r1 = (r["qat"] for r in two_ranks)
    # the model input's observer: data only, no weights
    single = r0["single_input"]["activation_post_process_0"]
    # DDP's default buffer broadcast overwrites rank 1's statistics: its widest batch is lost
    assert not torch.equal(r0["plain"]["qparams"]["activation_post_process_0"][0], single[0])
    # quantplug's wrapper + sync_observers: every rank's data counts, the same program on both ranks
    assert torch.equal(r0["quantplug"]["qparams"]["activation_post_process_0"][0], single[0])
    assert r0["quantplug"]["digest"] == r1["quantplug"]["digest"]
    _assert_same_qparams(r0["quantplug"]["qparams"], r1["quantplug"]["qparams"])
