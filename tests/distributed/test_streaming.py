"""Calibration data read lazily (_quantplug.cli.inputs.CalibrationData)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from _quantplug.cli.inputs import InputError, InputSpec, load_calibration, open_calibration

ONE = [InputSpec("x", (2, 3), torch.float32)]


def test_a_folder_is_read_one_file_at_a_time(tmp_path: Path) -> None:
    for i in range(4):
        torch.save([torch.full((2, 3), float(i))] * 2, tmp_path / f"{i}.pt")
    data = open_calibration(str(tmp_path), ONE)
    batches = data.batches()
    first, origin = next(batches)
    assert origin == "0.pt[0]"
    seen = weakref.ref(first.args[0])
    del first
    values = [float(batch.args[0][0, 0]) for batch, _ in batches]
    gc.collect()
    assert seen() is None  # file 0's tensors are gone once its batches were used
    assert values == [0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert data.total == 8


def test_ranks_share_the_batches_round_robin(tmp_path: Path) -> None:
    torch.save(torch.arange(30.0).reshape(5, 2, 3), tmp_path / "stack.pt")  # 5 stacked batches
    data = open_calibration(str(tmp_path / "stack.pt"), ONE)
    shares = [[o for _, o in data.batches(rank, 2)] for rank in range(2)]
    assert shares == [["stack.pt[0]", "stack.pt[2]", "stack.pt[4]"], ["stack.pt[1]", "stack.pt[3]"]]
    assert [o for _, o in data.head(2)] == ["stack.pt[0]", "stack.pt[1]"]


def test_legacy_format_files_are_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save([torch.zeros(2, 3)], path, _use_new_zipfile_serialization=False)
    batches, origins = load_calibration(str(path), ONE)
    assert len(batches) == 1 and origins == ["legacy.pt"]


def test_a_factory_that_is_not_there_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no attribute 'nothing'"):
        open_calibration("tests.distributed.data:nothing", ONE)
    with pytest.raises(InputError, match="not found"):
        open_calibration(str(tmp_path / "absent.pt"), ONE)
