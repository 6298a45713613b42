"""The CLI's input readers, in-process: every calibration layout and how mismatches are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _quantplug.cli.inputs import (
    InputError,
    InputSpec,
    check_batches,
    input_specs,
    load_calibration,
    load_model,
)
from _quantplug.cli.options import describe_option, parse_pairs
from _quantplug.graph.calls import Call
from _quantplug.plugins.contract import BackendOption

ONE = [InputSpec("x", (1, 3, 8, 8), torch.float32)]
TWO = [InputSpec("x", (2, 8), torch.float32), InputSpec("y", (2, 4), torch.float32)]


def _save(path: Path, obj: object) -> str:
    torch.save(obj, path)
    return str(path)


@pytest.mark.parametrize(
    "content, count",
    [
        (torch.randn(1, 3, 8, 8), 1),  # one tensor: one batch
        (torch.randn(5, 1, 3, 8, 8), 5),  # one more dimension: a stack of batches
        ([torch.randn(1, 3, 8, 8) for _ in range(3)], 3),  # a list of tensors
        ([(torch.randn(1, 3, 8, 8),) for _ in range(4)], 4),  # a list of 1-tuples
        ((torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)), 2),  # a tuple that is not one batch
    ],
)
def test_single_input_layouts(content: object, count: int, tmp_path: Path) -> None:
    batches, origins = load_calibration(_save(tmp_path / "c.pt", content), ONE)
    assert len(batches) == len(origins) == count
    check_batches(batches, origins, ONE)


def test_two_input_layouts(tmp_path: Path) -> None:
    one = (torch.randn(2, 8), torch.randn(2, 4))
    batches, _ = load_calibration(_save(tmp_path / "one.pt", one), TWO)
    assert len(batches) == 1 and len(batches[0].args) == 2
    batches, origins = load_calibration(_save(tmp_path / "many.pt", [one, one, one]), TWO)
    assert len(batches) == 3
    check_batches(batches, origins, TWO)


def test_folder_sorted_by_name(tmp_path: Path) -> None:
    for i in (2, 0, 1):
        _save(tmp_path / f"b{i}.pt", torch.full((1, 3, 8, 8), float(i)))
    (tmp_path / "README.txt").write_text("ignored")
    batches, origins = load_calibration(str(tmp_path), ONE)
    assert origins == ["b0.pt", "b1.pt", "b2.pt"]
    assert [float(b.args[0][0, 0, 0, 0]) for b in batches] == [0.0, 1.0, 2.0]


def test_dynamic_dimension_accepts_any_size() -> None:
    spec = [InputSpec("x", (None, 4), torch.float32)]
    check_batches([(torch.randn(7, 4),), (torch.randn(2, 4),)], ["a", "b"], spec)
    with pytest.raises(InputError, match=r"shape \(7, 5\); the model expects \(\?, 4\)"):
        check_batches([(torch.randn(7, 5),)], ["a"], spec)


@pytest.mark.parametrize(
    "batches, message",
    [
        (
            [(torch.randn(1, 3, 8, 9),)],
            r"batch 0 \(f\): input 'x' has shape \(1, 3, 8, 9\); the model expects \(1, 3, 8, 8\) float32",
        ),
        ([(torch.randn(1, 3, 8, 8).double(),)], "dtype float64"),
        ([(torch.randn(1, 3, 8, 8), torch.randn(1))], "has 2 input"),
        ([("text",)], "not a tensor"),
    ],
)
def test_mismatch_messages(batches: list, message: str) -> None:
    with pytest.raises(InputError, match=message):
        check_batches(batches, ["f"] * len(batches), ONE)


def test_keyword_layouts_and_messages(tmp_path: Path) -> None:
    from tests.cli._models import keyword_batches, keyword_inputs

    model, example = keyword_inputs()
    program = torch.export.export(model, (), example)
    specs = input_specs(program)
    assert [s.name for s in specs] == ["x", "mask"]
    one = keyword_batches(1)[0]
    for content, count in ((one, 1), (keyword_batches(3), 3), ([one, (one["x"], one["mask"])], 2)):
        batches, origins = load_calibration(_save(tmp_path / "k.pt", content), specs)
        assert len(batches) == count
        check_batches(batches, origins, specs, program)  # by name, or every input by position
    assert load_calibration(_save(tmp_path / "k.pt", one), specs)[0][0].kwargs.keys() == {"x", "mask"}
    with pytest.raises(InputError, match=r"batch 0 \(f\): keyword x input\(s\) do not match the model"):
        check_batches([Call((), {"x": one["x"]})], ["f"], specs, program)
    with pytest.raises(InputError, match=r"input 'mask' has shape \(2, 5\)"):
        check_batches([Call((), {"x": one["x"], "mask": torch.ones(2, 5)})], ["f"], specs, program)
    with pytest.raises(InputError, match="keys must be the input names"):
        load_calibration(_save(tmp_path / "bad.pt", [{1: one["x"]}]), specs)


def test_unsupported_content(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="holds a str"):
        load_calibration(_save(tmp_path / "d.pt", "text"), ONE)
    with pytest.raises(InputError, match=r"no \.pt"):
        empty = tmp_path / "empty"
        empty.mkdir()
        load_calibration(str(empty), ONE)


def test_model_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        load_model(str(tmp_path / "nope.pt2"))
    with pytest.raises(InputError, match="not found"):
        load_model("not a:valid spec")


def test_option_pairs_and_help_text() -> None:
    assert parse_pairs(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(InputError, match="key=value"):
        parse_pairs(["novalue"])
    with pytest.raises(InputError, match="twice"):
        parse_pairs(["a=1", "a=2"])
    opt = BackendOption("mode", str, "fast", "how", choices=("fast", "slow"))
    assert describe_option(opt) == "mode=str (default fast): how; one of fast, slow"
    assert describe_option(BackendOption("on", bool, True)) == "on=bool (default true)"


def test_constraint_violations_fit_on_one_line() -> None:
    from _quantplug.cli.main import _error_line
    from _quantplug.errors import ConstraintViolationError
    from _quantplug.validation.report import ValidationReport, Violation

    v = Violation("conv2d", "aten.conv2d.default", "Conv2d", "output", "uint8", "int16", "dtype")
    line = _error_line(ConstraintViolationError(ValidationReport(violations=[v, v, v], checked_nodes=3)))
    assert "\n" not in line
    assert line.startswith("3 backend constraint violation(s): node 'conv2d'")
    assert "(and 2 more)" in line and "strict=false" in line
    assert _error_line(ValueError("first\nsecond")) == "first (more with --verbose)"
