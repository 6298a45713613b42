"""The text the language models learn: the Python standard library's own source, as bytes.

The stdlib differs between Python versions, so only training reads it: the calibration and test
bytes are stored with the weights (:mod:`bench.trained.weights`), and every host measures the same
text. Files are split, not positions: the test text comes from modules the model never trained
on, the calibration text from others (calibration data is the training distribution, unlabelled).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

#: top-level stdlib modules in sorted order; every ``EVERY``-th file (from the 1st) is test text,
#: every ``EVERY``-th from the 2nd is calibration text, the rest train
EVERY = 10
#: at most this many bytes of each split (training: a few passes of a short training run)
LIMITS = {"train": 3_000_000, "calibration": 200_000, "test": 200_000}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def splits() -> dict[str, torch.Tensor]:
    """``{"train", "calibration", "test"}`` -> uint8 tensors of the concatenated files' bytes."""
    parts: dict[str, list[bytes]] = {"train": [], "calibration": [], "test": []}
    for index, file in enumerate(stdlib_files()):
        which = "test" if index % EVERY == 0 else "calibration" if index % EVERY == 1 else "train"
        parts[which].append(file.read_bytes())
    out = {}
    for name, chunks in parts.items():
        data = b"".join(chunks)[: LIMITS[name]]
        out[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    return out


def digest(data: torch.Tensor) -> str:
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def windows(data: torch.Tensor, length: int, count: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``length + 1`` bytes at seeded positions (input = [:-1], target = [1:])."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length - 1, (count,), generator=g)
    return torch.stack([data[s : s + length + 1] for s in starts.tolist()]).long()
