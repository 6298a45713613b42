"""Where ``--out`` and the report are written, and what stops them (issue 42.2, 42.6).

* a symbolic link another user planted in a shared sticky folder is never followed (the rule of
  Linux's ``fs.protected_symlinks``): refused at once, exit 2, the victim's files intact;
* a folder that cannot be renamed (a bind mount of the same filesystem, another user's folder in
  a sticky parent) is found before the run and replaced entry by entry;
* a full filesystem (here: a file-size limit, the same error path) stops the run with one line
  naming ``--out``, the previous output unchanged, nothing left behind;
* a reader that closes the pipe early (``| head``) after a successful run: exit 0.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from _quantplug.cli.output import StagedOutput, _mount_points, _renamable
from _quantplug.files import UnsafePathError, planted_link
from tests.cli.conftest import CLI, REPO, clean_env, run_cli
from tests.cli.test_output import _leftovers, _run, _tags

NOBODY = 65534
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (chown, mount)"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import torch

    root = tmp_path_factory.mktemp("model")
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    torch.export.save(torch.export.export(net, (torch.randn(3, 4),)), str(root / "net.pt2"))
    torch.save([torch.randn(3, 4) for _ in range(2)], root / "calib.pt")
    return root / "net.pt2", root / "calib.pt"


def _victim(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    project = tmp_path / "victim"
    (project / "artifact").mkdir(parents=True)
    files = {"notes.txt": "notes\n", "report.html": "<p>mine</p>", "artifact/deploy.sh": "echo deploy\n"}
    for rel, text in files.items():
        (project / rel).write_text(text)
    return project, files


def _intact(project: Path, files: dict[str, str]) -> bool:
    return all((project / rel).read_text() == text for rel, text in files.items())


def _shared(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


@needs_root
@pytest.mark.parametrize("where", ["--out itself", "a folder on the way", "a link to the link", "link/.."])
def test_a_link_planted_by_another_user_is_refused(
    tmp_path: Path, model: tuple[Path, Path], where: str
) -> None:
    pt2, calib = model
    project, files = _victim(tmp_path)
    shared = _shared(tmp_path)
    link = shared / "qout"
    link.symlink_to(project if where != "a folder on the way" else project.parent)
    os.lchown(link, NOBODY, NOBODY)  # planted by another user
    out = {
        "--out itself": link,
        "a folder on the way": link / "victim",
        "a link to the link": tmp_path / "mine",
        "link/..": link / ".." / "victim",  # the link is followed before ".." applies
    }[where]
    if where == "a link to the link":
        out.symlink_to(link)  # the user's own link, leading through the planted one
    result = run_cli("quantize", str(pt2), "-c", str(calib), "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert result.stderr_lines[-1].startswith("quantplug: error: refusing to write --out")
    assert f"{str(link)!r} is a symbolic link owned by" in result.stderr_lines[-1]
    assert not any("calibrat" in line for line in result.stderr_lines)  # refused before the run
    assert _intact(project, files) and sorted(p.name for p in project.iterdir()) == [
        "artifact",
        "notes.txt",
        "report.html",
    ]
    report = run_cli("report", str(out))  # the report command writes there too
    assert report.returncode == 2 and "symbolic link owned by" in report.stderr_lines[-1]
    assert _intact(project, files)


@needs_root
def test_links_that_are_no_threat_are_followed(tmp_path: Path) -> None:
    shared = _shared(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (shared / "mine").symlink_to(target)  # this user's own link
    assert planted_link(shared / "mine") is None
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "theirs").symlink_to(target)
    os.lchown(plain / "theirs", NOBODY, NOBODY)  # another user's link, in a folder only we write
    assert planted_link(plain / "theirs") is None
    os.chown(shared, NOBODY, NOBODY)
    (shared / "owners").symlink_to(target)
    os.lchown(shared / "owners", NOBODY, NOBODY)  # the sticky folder's owner's link
    assert planted_link(shared / "owners" / "x") is None
    (shared / "planted").symlink_to(target)
    os.lchown(shared / "planted", 1234, 1234)
    assert planted_link(shared / "planted" / "x") == (shared / "planted", 1234)
    with pytest.raises(UnsafePathError, match="owned by"):
        StagedOutput(shared / "planted")


@needs_root
def test_a_bind_mount_is_found_before_the_run(tmp_path: Path) -> None:
    real, mnt = tmp_path / "real", tmp_path / "mnt"
    real.mkdir()
    mnt.mkdir()
    done = subprocess.run(["mount", "--bind", str(real), str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
    try:
        assert not os.path.ismount(mnt) or str(mnt) in _mount_points()  # same device: ismount may miss it
        assert not _renamable(mnt)
        _run(mnt, "one")
        _run(mnt, "two")
        assert _tags(real) == {"two"} and _leftovers(tmp_path, mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@needs_root
def test_another_users_folder_in_a_sticky_parent_is_replaced_entry_by_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = _shared(tmp_path)
    out = shared / "out"
    _run(out, "one")
    os.chown(out, NOBODY, NOBODY)
    monkeypatch.setattr(os, "geteuid", lambda: 4321)  # not root, not the folder's owner
    assert not _renamable(out)
    monkeypatch.undo()
    assert _renamable(out)


def test_a_full_filesystem_names_out_and_keeps_the_previous_output(
    tmp_path: Path, model: tuple[Path, Path], piped_run: tuple[subprocess.CompletedProcess[str], Path, Path]
) -> None:
    """A file-size limit makes every write past it fail with EFBIG (Python ignores SIGXFSZ): the
    error path of a full disk (ENOSPC, EDQUOT) without needing one."""
    pt2, calib = model
    out = tmp_path / "out"
    first, _, written = piped_run  # a previous output of the same model and data, copied here
    assert first.returncode == 0, first.stderr
    shutil.copytree(written, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    done = subprocess.run(
        [*CLI, "quantize", str(pt2), "-c", str(calib), "--out", str(out)],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert lines[-1].startswith(f"quantplug: error: cannot write --out {str(out)!r}: File too large")
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert _leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def piped_run(
    tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, Path]
) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """A successful run whose reader closed the pipe before the summary came (``| head``), its
    ``--out``, and a pristine copy of what it wrote (the full-filesystem test's previous output)."""
    pt2, calib = model
    root = tmp_path_factory.mktemp("piped")
    out = root / "out"
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that finished reading before the summary came
    try:
        done = subprocess.run(
            [*CLI, "quantize", str(pt2), "-c", str(calib), "--out", str(out)],
            cwd=REPO,
            env=clean_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write_end)
    if done.returncode == 0:
        shutil.copytree(out, root / "pristine")
    return done, out, root / "pristine"


def test_a_reader_closing_the_pipe_after_a_successful_run(
    piped_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    done, out, _ = piped_run
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "error" not in done.stderr
    assert json.loads((out / "report.json").read_text())["schema"]
    for args in (["backends"], ["report", str(out)]):  # every command's printing
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            done = subprocess.run(
                [*CLI, *args], cwd=REPO, env=clean_env(), stdout=write_end, stderr=subprocess.PIPE
            )
        finally:
            os.close(write_end)
        assert done.returncode == 0 and b"Traceback" not in done.stderr, (args, done.stderr)
