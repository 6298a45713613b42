"""The ``--nproc`` launcher ends as a one-process run does (issue 42.5): a signal to it gives
130 / 143 with every rank stopped and nothing left behind; a rank killed (the out-of-memory
killer's SIGKILL) is named in quantplug's own last line; ``WORLD_SIZE``/``RANK`` left in a shell
make a plain run neither a rank nor a wait, but one line naming them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.cli.conftest import CLI, REPO, clean_env, run_cli
from tests.cli.test_fast_cli import _heavy, _imported


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from _quantplug.demo.model import demo_model

    path = tmp_path_factory.mktemp("launcher") / "demo.pt2"
    net, example = demo_model()
    torch.export.save(torch.export.export(net, example), str(path))
    return path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_and_act(model: Path, tmp_path: Path, act: str) -> tuple[int, list[str], list[int]]:
    """``--nproc 2`` on a slow factory; once both ranks calibrate, ``act`` ("TERM", "INT": to the
    launcher; "KILL1": SIGKILL to rank 1). Returns the exit code, stderr lines and the rank pids."""
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = [
        "quantize",
        str(model),
        "-c",
        "tests.distributed.data:slow",
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.Popen(
        [*CLI, *argv],
        cwd=REPO,
        env={**clean_env(), "QUANTPLUG_TEST_PIDS": str(pids)},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len(list(pids.iterdir())) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started calibrating"
            time.sleep(0.2)
        time.sleep(1.0)
        ranks = [int((pids / f"rank{r}").read_text()) for r in range(2)]
        if act == "KILL1":
            os.kill(ranks[1], signal.SIGKILL)
        else:
            os.kill(proc.pid, getattr(signal, f"SIG{act}"))
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    end = time.monotonic() + 30
    while any(_alive(p) for p in ranks) and time.monotonic() < end:
        time.sleep(0.2)
    return proc.returncode, [line for line in err.splitlines() if line.strip()], ranks


@pytest.mark.parametrize(
    ("act", "code", "line"), [("TERM", 143, "terminated by signal 15"), ("INT", 130, "interrupted")]
)
def test_a_signal_to_the_launcher(model: Path, tmp_path: Path, act: str, code: int, line: str) -> None:
    returncode, lines, ranks = _run_and_act(model, tmp_path, act)
    assert returncode == code, lines[-5:]
    assert lines[-1] == f"quantplug: error: {line}"
    assert not any("internal error" in x or "Traceback" in x for x in lines)
    assert not any(_alive(p) for p in ranks)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pids"]  # no --out, no staging folder


def test_a_killed_rank_is_named(model: Path, tmp_path: Path) -> None:
    returncode, lines, ranks = _run_and_act(model, tmp_path, "KILL1")
    assert returncode == 128 + signal.SIGKILL, lines[-5:]
    assert lines[-1].startswith(f"quantplug: error: rank 1 (pid {ranks[1]}) was killed by SIGKILL (signal 9)")
    assert not any(_alive(p) for p in ranks)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pids"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_stale_world_size_is_refused_at_once(model: Path, tmp_path: Path, rank: str) -> None:
    stale = {"WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    result = run_cli("quantize", str(model), "--out", str(tmp_path / "out"), env=stale, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr_lines == [
        f"quantplug: error: WORLD_SIZE=2 and RANK={rank} are set, but no torch launcher started this process "
        "(TORCHELASTIC_RUN_ID is not set): unset WORLD_SIZE and RANK for a one-process run, pass --nproc N, "
        "or start the command under torchrun"
    ]
    assert not (tmp_path / "out").exists()


def test_the_stale_world_size_answer_imports_no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    done, modules = _imported("quantize", "--random-batches", "1")
    assert done.returncode == 2 and "WORLD_SIZE=2 and RANK=1 are set" in done.stderr
    assert _heavy(modules) == []
