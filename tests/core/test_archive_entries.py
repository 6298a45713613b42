"""The archive check reads exactly what torch's reader reads (issue 42.1, 42.4).

Each archive below is first proven hostile against plain ``torch.export.load`` (the payload
creates a marker file), then refused by ``quantplug.load_program`` without running it: a second
program under another case of suffix, a first entry at the root (torch falls back to the legacy
format), a duplicated entry (torch reads the first copy, Python's zipfile the last). Beside them:
names differing only in case, a zip bomb, an entry too large to check, damaged archives (every
single-bit flip loads or raises a typed error), and readers that disagree.
"""

from __future__ import annotations

import json
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantplug
from _quantplug.archive import check_archive, entries
from _quantplug.errors import QuantplugError, UnsafeArchiveError
from tests.cli.conftest import run_cli
from tests.cli.test_hostile_inputs import _Touch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("entries") / "net.pt2"
    dims = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
    torch.export.save(torch.export.export(Net(), (torch.randn(3, 4),), dynamic_shapes=dims), str(path))
    return path


def _entries(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _write(path: Path, items: list[tuple[str, bytes]]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": deliberate
        with zipfile.ZipFile(path, "w") as z:
            for name, data in items:
                z.writestr(name, data)
    return path


def _runs_under_torch(path: Path, marker: Path) -> bool:
    try:
        torch.export.load(str(path))
    except Exception:
        pass
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def _upper_case_program(clean: Path, tmp: Path, marker: Path) -> Path:
    """``models/pwn.JSON``: torch loads every models/ entry; a shape expression runs a command."""
    items = _entries(clean)
    prefix = items[0][0].split("/", 1)[0] + "/"
    by_name = dict(items)
    program = by_name[prefix + "models/model.json"].decode()
    hostile = program.replace(
        "Symbol('s", f"Symbol('s') + Symbol(str(open({str(marker)!r}, 'w'))) + Symbol('s", 1
    )
    assert hostile != program
    extra = [
        (prefix + "models/pwn.JSON", hostile.encode()),
        (
            prefix + "data/weights/pwn_weights_config.json",
            by_name[prefix + "data/weights/model_weights_config.json"],
        ),
        (
            prefix + "data/constants/pwn_constants_config.json",
            by_name[prefix + "data/constants/model_constants_config.json"],
        ),
        (prefix + "data/sample_inputs/pwn.pt", by_name[prefix + "data/sample_inputs/model.pt"]),
    ]
    return _write(tmp / "pwn.pt2", items + extra)


def _legacy_fallback(clean: Path, tmp: Path, marker: Path) -> Path:
    """A first entry at the root: torch's reader gives up, torch.export.load falls back to the
    legacy format and unpickles its state dict; the clean archive after it is a decoy."""
    from torch._export.serde.schema import SCHEMA_VERSION

    items = _entries(clean)
    prefix = items[0][0].split("/", 1)[0] + "/"
    return _write(
        tmp / "legacy.pt2",
        [
            ("version", f"{SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}".encode()),
            *items,
            ("serialized_exported_program.json", dict(items)[prefix + "models/model.json"]),
            ("serialized_state_dict.pt", pickle.dumps(_Touch(marker))),
            ("serialized_constants.pt", b""),
            ("serialized_example_inputs.pt", b""),
        ],
    )


def _duplicate(clean: Path, tmp: Path, marker: Path) -> Path:
    """The weights config stored twice, one copy marking a weight pickled (the weight's bytes a
    pickle), the other clean: Python's zipfile reads the last copy, torch's reader the copy its
    binary search over the sorted names lands on; both placements are tried, the one torch runs
    is kept."""
    items = _entries(clean)
    prefix = items[0][0].split("/", 1)[0] + "/"
    config_name = prefix + "data/weights/model_weights_config.json"
    config = json.loads(dict(items)[config_name])
    config["config"]["fc.weight"]["use_pickle"] = True
    weight = prefix + "data/weights/" + config["config"]["fc.weight"]["path_name"]
    hostile = json.dumps(config).encode()
    for hostile_first in (True, False):
        built: list[tuple[str, bytes]] = []
        for name, data in items:
            if name == config_name:
                built += [(name, hostile), (name, data)] if hostile_first else [(name, data), (name, hostile)]
            else:
                built.append((name, pickle.dumps(_Touch(marker)) if name == weight else data))
        path = _write(tmp / "dup.pt2", built)
        if _runs_under_torch(path, marker):
            break
    return path


HOSTILE = {
    "upper-case program": _upper_case_program,
    "legacy fallback": _legacy_fallback,
    "duplicate": _duplicate,
}
#: what the refusal names
NAMED = {
    "upper-case program": "models/pwn.JSON",
    "legacy fallback": "legacy format",
    "duplicate": "stored twice",
}


@pytest.mark.parametrize("vector", list(HOSTILE))
def test_archives_torch_runs_are_refused_without_running(clean: Path, tmp_path: Path, vector: str) -> None:
    marker = tmp_path / "RAN"
    path = HOSTILE[vector](clean, tmp_path, marker)
    assert _runs_under_torch(path, marker), "plain torch.export.load does not run it: the test proves nothing"
    for allow_pickle in (False, True):  # trusting pickles does not make an ambiguous archive loadable
        with pytest.raises(UnsafeArchiveError, match="refusing to load") as info:
            quantplug.load_program(path, allow_pickle=allow_pickle)
        assert NAMED[vector] in str(info.value) and path.name in str(info.value)
        assert not marker.exists()


def test_names_differing_only_in_case_are_refused(clean: Path, tmp_path: Path) -> None:
    items = _entries(clean)
    prefix = items[0][0].split("/", 1)[0] + "/"
    twin = (
        prefix + "data/weights/MODEL_weights_config.json",
        dict(items)[prefix + "data/weights/model_weights_config.json"],
    )
    path = _write(tmp_path / "case.pt2", [*items, twin])
    with pytest.raises(UnsafeArchiveError, match="differ only in case"):
        check_archive(path)


def test_entries_outside_the_layout_are_refused_and_extra_files_accepted(clean: Path, tmp_path: Path) -> None:
    items = _entries(clean)
    prefix = items[0][0].split("/", 1)[0] + "/"
    for name in ("notes.txt", "models/model.json.bak", "data/weights/../x", "models/"):
        path = _write(tmp_path / "odd.pt2", [*items, (prefix + name, b"{}")])
        with pytest.raises(UnsafeArchiveError, match=r"not an entry torch.export.save|every models/ entry"):
            check_archive(path)
    extra = _write(tmp_path / "extra.pt2", [*items, (prefix + "extra/notes.txt", b"hello")])
    check_archive(extra)


def test_a_zip_bomb_is_refused_before_it_is_inflated(clean: Path, tmp_path: Path) -> None:
    items = _entries(clean)
    bomb = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in items:
            if name.endswith("models/model.json"):
                with z.open(name, "w", force_zip64=True) as f:
                    f.write(data[:1] + b" " * (64 * 2**20) + data[1:])  # valid JSON, 64 MiB of spaces
            else:
                z.writestr(name, data)
    assert bomb.stat().st_size < 2**20
    with pytest.raises(UnsafeArchiveError, match=r"models/model\.json' expands from .* bytes \([0-9,]+x"):
        check_archive(bomb)


def test_an_entry_too_large_to_check_is_refused(clean: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entries, "MAX_PARSED_BYTES", 1000)
    with pytest.raises(UnsafeArchiveError, match=r"models/model\.json holds .* MiB, more than"):
        check_archive(clean)


def test_readers_that_disagree_are_refused(clean: Path, tmp_path: Path) -> None:
    """Bytes before the zip: Python's zipfile shifts every offset, torch's reader does not."""
    shifted = tmp_path / "shifted.pt2"
    shifted.write_bytes(b"#" * 512 + clean.read_bytes())
    with zipfile.ZipFile(shifted) as z:
        assert z.testzip() is None  # Python's reader reads it whole
    with pytest.raises(UnsafeArchiveError, match=r"refusing to load .*damaged"):
        check_archive(shifted)


def test_a_legacy_format_archive_needs_allow_pickle(clean: Path, tmp_path: Path) -> None:
    from torch._export.serde.schema import SCHEMA_VERSION

    items = dict(_entries(clean))
    prefix = next(iter(items)).split("/", 1)[0] + "/"
    path = _write(
        tmp_path / "old.pt2",
        [
            ("serialized_exported_program.json", items[prefix + "models/model.json"]),
            ("version", f"{SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}".encode()),
            ("serialized_state_dict.pt", b""),
        ],
    )
    with pytest.raises(UnsafeArchiveError, match=r"legacy format \(torch < 2\.7\).*--allow-pickle"):
        check_archive(path)
    check_archive(path, allow_pickle=True)  # trusted: its names and expressions are still checked


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_every_bit_flip_loads_or_gives_a_typed_error(
    clean: Path, tmp_path: Path, where: float, bit: int
) -> None:
    data = bytearray(clean.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    flipped = tmp_path / "flipped.pt2"
    flipped.write_bytes(bytes(data))
    try:
        quantplug.load_program(flipped)
    except QuantplugError as exc:
        assert "flipped.pt2" in str(exc)


def test_the_cli_names_a_damaged_archive_in_one_line(clean: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(clean) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("models/model.json"))
    raw = bytearray(clean.read_bytes())
    header = info.header_offset
    start = header + 30 + int.from_bytes(raw[header + 26 : header + 28], "little")
    start += int.from_bytes(raw[header + 28 : header + 30], "little")
    raw[start + info.file_size // 2] ^= 0x01  # inside the JSON text: still JSON, the CRC no longer matches
    flipped = tmp_path / "flipped.pt2"
    flipped.write_bytes(bytes(raw))
    result = run_cli("quantize", str(flipped), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert result.stderr_lines[-1].startswith("quantplug: error: refusing to load")
    assert "flipped.pt2" in result.stderr_lines[-1] and "damaged" in result.stderr_lines[-1]
    assert not (tmp_path / "out").exists()
