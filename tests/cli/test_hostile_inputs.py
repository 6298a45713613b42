"""Hostile and careless inputs (issue 12.5, 12.6): ``.pt2`` archives built to run code when
loaded are refused (each proven hostile against plain ``torch.export.load`` first), tampered
report files give a typed error, report writing never follows a planted link, a factory's
``sys.exit`` is an error, and the working folder is importable for the factory only."""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quantplug
from _quantplug.archive import check_archive
from _quantplug.errors import QuantplugError, UnsafeArchiveError
from tests.cli.conftest import run_cli
from tests.cli.test_report_render import _data


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.tensor([1.0, 2.0])  # a lifted tensor constant


@pytest.fixture(scope="module")
def clean_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("archives") / "net.pt2"
    dims = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
    torch.export.save(torch.export.export(Net(), (torch.randn(3, 4),), dynamic_shapes=dims), str(path))
    return path


class _Touch:
    """Unpickling it creates a file: proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _rewrite(
    src: Path, dst: Path, change: Callable[[str, bytes], bytes], extra: dict[str, bytes] | None = None
) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        prefix = zin.namelist()[0].split("/", 1)[0] + "/"
        for info in zin.infolist():
            zout.writestr(info, change(info.filename[len(prefix) :], zin.read(info.filename)))
        for name, data in (extra or {}).items():
            zout.writestr(prefix + name, data)
    return dst


def _json_edit(target: str, edit: Callable[[Any], Any]) -> Callable[[str, bytes], bytes]:
    def change(name: str, data: bytes) -> bytes:
        return json.dumps(edit(json.loads(data))).encode() if name == target else data

    return change


def _text_edit(target: str, old: str, new: str) -> Callable[[str, bytes], bytes]:
    def change(name: str, data: bytes) -> bytes:
        if name != target:
            return data
        text = data.decode()
        assert old in text, (old, text[:300])
        return text.replace(old, new, 1).encode()

    return change


def _pickled_weight(marker: Path) -> Callable[[str, bytes], bytes]:
    def change(name: str, data: bytes) -> bytes:
        if name == "data/weights/model_weights_config.json":
            doc = json.loads(data)
            doc["config"]["fc.bias"]["use_pickle"] = True
            return json.dumps(doc).encode()
        return pickle.dumps(_Touch(marker)) if name == "data/weights/weight_1" else data

    return change


def _pickled_constant(marker: Path) -> Callable[[str, bytes], bytes]:
    def change(name: str, data: bytes) -> bytes:
        if name == "data/constants/model_constants_config.json":
            doc = json.loads(data)
            next(iter(doc["config"].values()))["use_pickle"] = True
            return json.dumps(doc).encode()
        return pickle.dumps(_Touch(marker)) if name == "data/constants/tensor_0" else data

    return change


def _sample_inputs(marker: Path) -> Callable[[str, bytes], bytes]:
    return lambda name, data: pickle.dumps(_Touch(marker)) if name.startswith("data/sample_inputs/") else data


def _sympy(marker: Path) -> Callable[[str, bytes], bytes]:
    payload = f"Symbol(S(\\\"open('{marker}', 'w')\\\") and 's"
    return _text_edit("models/model.json", "Symbol('s", payload)


def _guard(marker: Path) -> Callable[[str, bytes], bytes]:
    return _json_edit(
        "models/model.json", lambda d: {**d, "guards_code": [f"open({str(marker)!r}, 'w') or True"]}
    )


def _argument_name(marker: Path) -> Callable[[str, bytes], bytes]:
    def edit(doc: Any) -> Any:
        doc["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"] = [
            f"x=open({str(marker)!r}, 'w')"
        ]
        return doc

    return _json_edit("models/model.json", edit)


def _node_name(marker: Path) -> Callable[[str, bytes], bytes]:
    return _text_edit(
        "models/model.json", '"linear"', json.dumps(f"linear\n    open({str(marker)!r}, 'w')\n    linear")
    )


def _attribute_path(marker: Path) -> Callable[[str, bytes], bytes]:
    bad = json.dumps(f'fc.weight"); open({str(marker)!r}, "w") #')

    def change(name: str, data: bytes) -> bytes:
        if name in ("models/model.json", "data/weights/model_weights_config.json"):
            return data.decode().replace('"fc.weight"', bad).encode()
        return data

    return change


def _operator(marker: Path) -> Callable[[str, bytes], bytes]:
    return _text_edit("models/model.json", '"torch.ops.aten.linear.default"', '"torch.os.system"')


# vector -> (how the archive is changed, whether plain torch.export.load (+ .module()) runs the
# payload: proven here, so the refusal below guards a real hole)
VECTORS: dict[str, tuple[Callable[[Path], Callable[[str, bytes], bytes]], bool]] = {
    "pickled weight": (_pickled_weight, True),
    "pickled constant": (_pickled_constant, True),
    "pickled example inputs": (_sample_inputs, True),
    "sympy expression": (_sympy, True),
    "guard code": (_guard, True),
    "argument name": (_argument_name, False),
    "node name": (_node_name, False),
    "attribute path": (_attribute_path, False),
    "operator": (_operator, False),
}


def _hostile(clean: Path, tmp_path: Path, vector: str) -> tuple[Path, Path]:
    marker = tmp_path / "RAN"
    make, _ = VECTORS[vector]
    return _rewrite(clean, tmp_path / "hostile.pt2", make(marker)), marker


@pytest.mark.parametrize("vector", list(VECTORS))
def test_torch_export_load_runs_the_payload(clean_pt2: Path, tmp_path: Path, vector: str) -> None:
    path, marker = _hostile(clean_pt2, tmp_path, vector)
    if not VECTORS[vector][1]:
        pytest.skip("refused on principle: no payload of this shape was found to run in this torch")
    try:
        torch.export.load(str(path)).module()(torch.randn(3, 4))  # guards run with each call
    except Exception:
        pass
    assert marker.exists(), "this archive is not hostile: the refusal test below proves nothing"


@pytest.mark.parametrize("vector", list(VECTORS))
def test_hostile_archive_is_refused_without_running_it(clean_pt2: Path, tmp_path: Path, vector: str) -> None:
    path, marker = _hostile(clean_pt2, tmp_path, vector)
    with pytest.raises(UnsafeArchiveError, match="refusing to load"):
        quantplug.load_program(path)
    assert not marker.exists()


def test_aoti_and_legacy_pickles_are_refused(clean_pt2: Path, tmp_path: Path) -> None:
    aoti = _rewrite(
        clean_pt2, tmp_path / "aoti.pt2", lambda n, d: d, {"data/aotinductor/model/model.so": b"\x7fELF"}
    )
    with pytest.raises(UnsafeArchiveError, match="compiled AOTInductor code"):
        check_archive(aoti)
    legacy = _rewrite(clean_pt2, tmp_path / "legacy.pt2", lambda n, d: d, {"data/weights/model.pt": b"x"})
    with pytest.raises(UnsafeArchiveError, match=r"pickled legacy weights file.*--allow-pickle"):
        check_archive(legacy)


def test_allow_pickle_is_an_explicit_choice(clean_pt2: Path, tmp_path: Path) -> None:
    path, marker = _hostile(clean_pt2, tmp_path, "pickled example inputs")
    check_archive(path, allow_pickle=True)  # the user vouches for the file: it is theirs to run
    (tmp_path / "named").mkdir()
    node_named, _ = _hostile(clean_pt2, tmp_path / "named", "node name")
    with pytest.raises(UnsafeArchiveError, match="not a plain identifier"):
        check_archive(node_named, allow_pickle=True)  # names are never code, trusted or not
    assert not marker.exists()


def test_clean_archive_loads(clean_pt2: Path) -> None:
    program = quantplug.load_program(clean_pt2)
    assert program.module()(torch.randn(5, 4)).shape == (5, 2)


def test_garbage_and_foreign_zips_say_what_is_wrong(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pt2"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(QuantplugError, match=r"not a torch\.export archive"):
        quantplug.load_program(garbage)
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(QuantplugError, match=r"zip archive but not a torch\.export program") as info:
        quantplug.load_program(other)
    assert "warnings above" not in str(info.value)


def test_the_cli_refuses_a_hostile_archive(clean_pt2: Path, tmp_path: Path) -> None:
    path, marker = _hostile(clean_pt2, tmp_path, "sympy expression")
    result = run_cli("quantize", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert result.stderr_lines[-1].startswith("quantplug: error: refusing to load")
    assert "--allow-pickle" not in result.stderr_lines[-1]  # code in names: no flag lets it through
    assert not marker.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# factories, reports, the working folder
# ------------------------------------------------------------------------------------------------


def test_factory_calling_sys_exit(tmp_path: Path) -> None:
    (tmp_path / "exiting.py").write_text("import sys\n\ndef build():\n    sys.exit(3)\n")
    for spec, words in (("exiting:build", "called sys.exit(3)"), ("sys:exit", "called sys.exit()")):
        result = run_cli("quantize", spec, "--out", str(tmp_path / "out"), cwd=tmp_path)
        assert result.returncode == 2, (spec, result.stderr)
        assert words in result.stderr_lines[-1] and result.stderr_lines[-1].startswith("quantplug: error: ")


def test_tampered_report_gives_a_typed_error(tmp_path: Path) -> None:
    data = _data()
    data["summary"]["output_sqnr_db"] = "high"
    (tmp_path / "report.json").write_text(json.dumps(data))
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2, result.stderr
    damaged = 'summary.output_sqnr_db holds "high" (str)'
    assert result.stderr_lines == [
        f"quantplug: error: {tmp_path / 'report.json'} is damaged: {damaged}; "
        "write it again with `quantplug quantize --out DIR`"
    ]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
PATHS = [
    ("summary", "output_sqnr_db"),
    ("summary", "output_max_abs_error"),
    ("summary", "size_ratio"),
    ("summary", "float_bytes"),
    ("layers",),
    ("worst",),
    ("float_nodes",),
    ("sharing_groups",),
    ("files",),
    ("timings", "total"),
    ("options",),
    ("calibration",),
    ("backend",),
    ("model",),
    ("validation",),
    ("warnings",),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(PATHS), value=JSON)
def test_any_tampering_is_a_usage_error_never_an_internal_one(
    tmp_path: Path, where: tuple[str, ...], value: Any
) -> None:
    import contextlib
    import io

    from _quantplug.cli.main import main

    data = _data()
    holder = data
    for key in where[:-1]:
        holder = holder[key]
    holder[where[-1]] = value
    (tmp_path / "report.json").write_text(json.dumps(data))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["report", str(tmp_path), "-q"])
    assert code in (0, 2), err.getvalue()
    assert "internal error" not in err.getvalue()


def test_report_never_follows_a_planted_link(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text(json.dumps(_data()))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / ".report.html.tmp").symlink_to(victim)  # the fixed name the old code wrote through
    result = run_cli("report", str(out), "-q")
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious"
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
    (out / "report.html").unlink()
    (out / "report.html").symlink_to(victim)  # a link in place of the page: replaced, not followed
    assert run_cli("report", str(out), "-q").returncode == 0
    assert victim.read_text() == "precious" and not (out / "report.html").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == [".report.html.tmp", "report.html", "report.json"]


def test_working_folder_is_importable_for_the_factory_only(tmp_path: Path) -> None:
    """A matplotlib.py next to the user is not what the report step imports."""
    marker = tmp_path / "IMPORTED"
    (tmp_path / "matplotlib.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('not me')\n"
    )
    (tmp_path / "mymodel.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 2), (torch.randn(2, 4),)\n"
    )
    out = tmp_path / "out"
    result = run_cli("quantize", "mymodel:build", "--out", str(out), "--random-batches", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    assert (out / "report.html").exists() and (out / "report.json").exists()


def test_calibration_data_factory_calling_sys_exit(tmp_path: Path) -> None:
    """A ``package.module:factory`` of calibration batches whose generator calls ``sys.exit(0)``:
    a bad input (exit 2) naming it, never a successful run with nothing written."""
    (tmp_path / "exiting_data.py").write_text("import sys\n\n\ndef batches():\n    sys.exit(0)\n    yield\n")
    out = tmp_path / "out"
    result = run_cli("quantize", "-c", "exiting_data:batches", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr_lines[-1].startswith(
        "quantplug: error: data factory 'exiting_data:batches' called sys.exit(0) producing item 0 (at "
    ), result.stderr
    assert "exiting_data.py:5 in batches" in result.stderr_lines[-1]
    assert not out.exists()
