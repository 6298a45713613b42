"""JSON files quantplug reads back are untrusted input (issue 42.7): ``report.json``,
``--mixed-precision-file`` and a backend's ``*.backend.json`` are read only when they are regular
files (``/dev/zero`` would be read until memory runs out, a FIFO would block), of bounded size and
depth (100,000 nested arrays were a ``RecursionError``), with finite numbers (``Infinity`` was an
``OverflowError`` in the renderer); every refusal names the file. A mixed-precision file's
``preset_option`` must be the backend's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _quantplug.files import UnreadableFileError, parse_json, read_json
from _quantplug.plugins.metadata import MetadataError, info_from_dict, read_declared
from tests.cli.conftest import run_cli
from tests.cli.test_fast_cli import _heavy, _imported
from tests.cli.test_report_render import _data

DEEP = "[" * 100_000 + "]" * 100_000


def _special(kind: str, path: Path) -> Path:
    """``path`` made a FIFO, a link to /dev/zero, a folder, a file too deep, non-finite..."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_text(
            {"deep": DEEP, "Infinity": '{"a": Infinity}', "NaN": '{"a": NaN}', "1e999": '{"a": 1e999}'}[kind]
        )
    return path


#: what follows "PATH: " in the error
KINDS = {
    "fifo": "a named pipe (FIFO), not a regular file",
    "/dev/zero": "a character device, not a regular file",
    "folder": "a folder, not a regular file",
    "deep": "nests arrays or objects too deeply to read",
    "Infinity": "holds Infinity, which JSON does not allow",
    "NaN": "holds NaN, which JSON does not allow",
    "1e999": "holds the number 1e999, beyond a float's range",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_read_json_refuses_what_is_no_plain_json_file(tmp_path: Path, kind: str) -> None:
    path = _special(kind, tmp_path / "x.json")
    with pytest.raises(
        UnreadableFileError, match=KINDS[kind].replace("(", r"\(").replace(")", r"\)")
    ) as info:
        read_json(path)
    assert str(info.value).startswith(f"{path}: ")


def test_read_json_limits(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"a": [[[[1]]]]}))
    assert read_json(path) == {"a": [[[[1]]]]}
    with pytest.raises(UnreadableFileError, match=r"nests arrays or objects 5 levels deep \(at most 4\)"):
        read_json(path, max_depth=4)
    with pytest.raises(UnreadableFileError, match=r"holds 16 bytes, more than the 10 bytes it may"):
        read_json(path, limit=10)
    path.write_text('{"a": 18446744073709551616}')
    with pytest.raises(UnreadableFileError, match="beyond 64 bits"):
        read_json(path)
    path.write_text('{"a": Infinity, "b": NaN}')
    value = read_json(path, finite=False)  # torch writes such programs: their reader asks for them
    assert value["a"] == float("inf")
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(UnreadableFileError, match=r"x\.json: not UTF-8 text"):
        read_json(path)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.text(alphabet='[]{}":,0123456789.eE+-nulltrfasINaify ', max_size=64))
def test_any_text_parses_or_gives_the_typed_error(text: bytes | str) -> None:
    try:
        parse_json(text, "x.json")
    except UnreadableFileError as exc:
        assert str(exc).startswith("x.json: ")


@pytest.mark.parametrize("kind", list(KINDS))
def test_report_reads_no_special_file(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _special(kind, out / "report.json")
    result = run_cli("report", str(out), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr_lines == [
        f"quantplug: error: cannot read {out / 'report.json'}: {KINDS[kind]}" + _tail(kind)
    ]
    assert not (out / "report.html").exists()


def _tail(kind: str) -> str:
    return " (write null)" if kind in ("Infinity", "NaN") else ""


def test_report_with_an_infinite_curve_point(tmp_path: Path) -> None:
    data = _data()
    point = {"weight_bytes": 1e308, "sqnr_db": 30.0, "overrides": {}}
    data["mixed_precision"] = {
        "backend": "qnn_htp", "default": "16a4w", "source": "search", "layers": 3, "chosen": 0,
        "overrides": {}, "target": {"weight_bytes": 1e308}, "curve": [point],
    }  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(data))
    result = run_cli("report", str(tmp_path), "-q")
    assert result.returncode == 0, result.stderr  # finite, however large: rendered


@pytest.fixture()
def choice() -> dict[str, Any]:
    return {
        "format": "quantplug-mixed-precision/1",
        "backend": "reference",
        "options": {},
        "preset_option": "preset",
        "default": "int8",
        "overrides": {},
        "target": {"sqnr_db": 30.0},
    }


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            {"preset_option": "activation_dtype"},
            ["names preset_option 'activation_dtype'", "with option 'preset'"],
        ),
        ({"target": {"sqnr_db": float("inf")}}, ["holds Infinity"]),
        ({"overrides": [1, 2]}, ["'overrides' an object"]),
        ({"default": "int9"}, ["uses preset 'int9'", "did you mean 'int8'"]),
    ],
    ids=["another option", "infinite target", "overrides not an object", "unknown preset"],
)
def test_a_mixed_precision_file_is_checked_before_torch(
    tmp_path: Path, choice: dict[str, Any], edit: dict[str, Any], words: list[str]
) -> None:
    path = tmp_path / "mixed_precision.json"
    path.write_text(json.dumps({**choice, **edit}))
    done, modules = _imported("quantize", "--mixed-precision-file", str(path), "--out", str(tmp_path / "out"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("quantplug: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert str(path) in errors[0] and all(w in errors[0] for w in words), errors[0]
    assert _heavy(modules) == []  # answered without torch
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_a_special_mixed_precision_file(tmp_path: Path, kind: str) -> None:
    path = _special(kind, tmp_path / "mp.json")
    result = run_cli(
        "quantize", "--mixed-precision-file", str(path), "--out", str(tmp_path / "out"), timeout=60
    )
    line = f"quantplug: error: cannot read --mixed-precision-file {path}: {KINDS[kind]}"
    assert result.returncode == 2 and result.stderr_lines == [line], result.stderr


def test_the_choice_quantplug_writes_is_read_back(tmp_path: Path, choice: dict[str, Any]) -> None:
    from _quantplug.cli.mixed_precision import read_choice, write_choice

    written = write_choice(
        {**choice, "sensitivity": {"fc": {"int8": float("inf")}}, "source": "search"}, tmp_path
    )
    back = read_choice(str(written), "reference", "preset", ["int8", "a16w8"])
    assert back["sensitivity"] == {"fc": {"int8": None}} and "source" not in back


def test_backend_metadata_is_read_as_untrusted_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "qp_deepmeta"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for kind in ("deep", "fifo", "/dev/zero"):
        target = package / "deepmeta.backend.json"
        if os.path.lexists(target):
            target.unlink()
        _special(kind, target)
        with pytest.raises(MetadataError) as info:
            read_declared("qp_deepmeta.plugin", "deepmeta")
        assert str(info.value) == f"{target}: {KINDS[kind]}"


def test_backend_metadata_roles_name_declared_options() -> None:
    doc = {
        "format": "quantplug-backend/1",
        "name": "x",
        "presets": [{"name": "int8"}, {"name": "int16"}],
        "options": [
            {"name": "preset", "type": "str", "default": "int8", "choices": ["int8", "int16"]},
            {"name": "dtype", "type": "str", "default": "int8", "choices": ["int8", "uint8"]},
            {"name": "qat", "type": "bool", "default": False},
        ],
        "preset_option": "preset",
        "qat_option": "qat",
    }
    assert info_from_dict(doc).preset_option == "preset"
    for change, words in (
        ({"preset_option": "precision"}, "names no declared option"),
        ({"preset_option": "dtype"}, "takes ['int8', 'uint8'], not the presets"),
        ({"qat_option": "dtype"}, "names no declared bool option"),
        ({"preset_option": ["preset"]}, "must be an option name or null"),
    ):
        with pytest.raises(MetadataError, match=words.replace("[", r"\[").replace("]", r"\]")):
            info_from_dict({**doc, **change})
