"""``quantplug new-backend`` with careless names and folders (issue 42.9): a name must be a short
lowercase identifier, whole (``abc\\n`` passed a ``$``); a file as ``--dir``, a read-only or full
disk give one line naming the path, and the distribution appears whole or not at all (a full disk
left 5 files that blocked the rerun); a name already installed is generated with a warning."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from _quantplug import scaffold
from _quantplug.scaffold import ScaffoldError, create_backend, names
from tests.cli.conftest import run_cli


@pytest.mark.parametrize(
    "name", ["abc\n", "a" * 65, "MyNpu", "my-npu", "a__b", "npu_", "", "1npu", "npu\x00"]
)
def test_names_that_are_no_short_lowercase_identifier(name: str, tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match="must be a lowercase identifier of at most 64 characters"):
        names(name)
    result = (
        run_cli("new-backend", name.replace("\x00", ""), "--dir", str(tmp_path))
        if "\x00" not in name
        else None
    )
    if result is not None:
        assert result.returncode == 2 and result.stderr_lines[-1].startswith("quantplug: error: backend name")
    assert list(tmp_path.iterdir()) == []


def test_the_longest_name_is_written(tmp_path: Path) -> None:
    root = create_backend("n" * 64, tmp_path)
    assert root.name == "quantplug-" + "n" * 64 and (root / "pyproject.toml").is_file()


def test_a_file_as_dir(tmp_path: Path) -> None:
    target = tmp_path / "afile"
    target.write_text("keep me\n")
    result = run_cli("new-backend", "mynpu", "--dir", str(target))
    assert result.returncode == 2
    assert result.stderr_lines == [
        f"quantplug: error: --dir {str(target)!r} is not a folder; give the folder to create "
        "quantplug-mynpu/ in"
    ]
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.ENOSPC, "No space left on device; nothing was written (free some space or choose another --dir)"),
     (errno.EROFS, "Read-only file system; nothing was written (choose another --dir)")],
    ids=["full", "read-only"],
)  # fmt: skip
def test_a_failed_write_leaves_nothing_and_the_rerun_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    written: list[Path] = []
    real = Path.write_text

    def failing(self: Path, text: str, *args: object, **kwargs: object) -> int:
        if len(written) == 5:  # the disk fills up after five files
            raise OSError(code, os.strerror(code), str(self))
        written.append(self)
        return real(self, text)

    monkeypatch.setattr(Path, "write_text", failing)
    with pytest.raises(ScaffoldError) as info:
        create_backend("mynpu", tmp_path)
    assert str(info.value) == f"cannot write {tmp_path / 'quantplug-mynpu'}: {words}"
    assert list(tmp_path.iterdir()) == [] and len(written) == 5
    monkeypatch.undo()
    root = create_backend("mynpu", tmp_path)  # nothing blocks the rerun
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantplug-mynpu"]
    assert sum(1 for p in root.rglob("*") if p.is_file()) == len(scaffold.render("mynpu"))


def test_an_empty_target_is_filled_and_a_full_one_kept(tmp_path: Path) -> None:
    (tmp_path / "quantplug-mynpu").mkdir()
    assert (create_backend("mynpu", tmp_path) / "README.md").is_file()
    with pytest.raises(ScaffoldError, match="already exists and is not empty"):
        create_backend("mynpu", tmp_path)


def test_a_name_already_installed_is_generated_with_a_warning(tmp_path: Path) -> None:
    result = run_cli("new-backend", "reference", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stderr_lines[0].startswith(
        "warning: a backend named 'reference' is already installed (distribution quantplug-reference): "
        "installing this one beside it makes every `-b reference` fail"
    )
    assert (tmp_path / "quantplug-reference" / "pyproject.toml").is_file()
    quiet = run_cli("new-backend", "brand_new", "--dir", str(tmp_path))
    assert quiet.returncode == 0 and not any(line.startswith("warning") for line in quiet.stderr_lines)
