"""Training and the stored weights of the trained bench's models.

Training is seeded but its float kernels (summation order, SIMD width) differ between CPUs, so,
as with the digits models (``bench.digits_weights``), the trained weights are data committed under
``bench/data/``, together with the calibration and test windows (the stdlib they come from
differs between Python versions). ``python -m bench.trained --train`` remakes them; a file
missing is trained on first use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.trained import text
from bench.trained.models import ARCHITECTURES

DATA = Path(__file__).resolve().parent.parent / "data"
#: model -> (optimizer steps, learning rate): a few minutes on one core each
STEPS = {"char_gpt": (800, 3e-3), "lstm_lm": (800, 5e-3)}
BATCH = 16
CONTEXT = 64
#: stored windows: calibration (batches of 8 are cut from them) and test
CALIBRATION_WINDOWS = 96
TEST_WINDOWS = 128
SEED = 0


@dataclass(frozen=True)
class Trained:
    model: nn.Module
    calibration: torch.Tensor  # (windows, CONTEXT + 1) byte ids, int64
    test: torch.Tensor
    meta: dict[str, object]


def path(name: str) -> Path:
    return DATA / f"trained_{name}.pt"


def train(name: str, log: bool = True) -> Trained:
    """Train ``name`` from seed :data:`SEED` on one thread (the schedule: linear warm-up, cosine decay)."""
    data = text.splits()
    torch.manual_seed(SEED)
    model = ARCHITECTURES[name]()
    steps, lr = STEPS[name]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(SEED + 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    model.train()
    try:
        for step in range(steps):
            scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
            for group in optimizer.param_groups:
                group["lr"] = lr * max(scale, 0.02)
            starts = torch.randint(0, len(data["train"]) - CONTEXT - 1, (BATCH,), generator=g)
            batch = torch.stack([data["train"][s : s + CONTEXT + 1] for s in starts.tolist()]).long()
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if log and step % 250 == 0:
                print(f"  {name} step {step}: loss {float(loss):.3f} ({time.perf_counter() - started:.0f} s)")
    finally:
        torch.set_num_threads(threads)
    model.eval()
    meta = {
        "steps": steps,
        "seconds": round(time.perf_counter() - started, 1),
        "python": ".".join(map(str, __import__("sys").version_info[:3])),
        "train_sha": text.digest(data["train"]),
    }
    return Trained(
        model,
        text.windows(data["calibration"], CONTEXT, CALIBRATION_WINDOWS, SEED + 2),
        text.windows(data["test"], CONTEXT, TEST_WINDOWS, SEED + 3),
        meta,
    )


def store(trained: Trained, name: str) -> None:
    DATA.mkdir(exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in trained.model.state_dict().items()}
    torch.save(
        {
            "state": state,
            "calibration": trained.calibration.to(torch.uint8),
            "test": trained.test.to(torch.uint8),
            "meta": {k: str(v) for k, v in trained.meta.items()},
        },
        path(name),
    )


def load(name: str) -> Trained:
    """The stored model (``weights_only``: the file holds tensors and strings), trained and
    stored first if missing."""
    if name not in ARCHITECTURES:
        raise SystemExit(f"unknown trained model {name!r}: one of {', '.join(ARCHITECTURES)}")
    if not path(name).is_file():
        store(train(name), name)
    stored = torch.load(path(name), weights_only=True)
    model = ARCHITECTURES[name]()
    model.load_state_dict(stored["state"])
    return Trained(model.eval(), stored["calibration"].long(), stored["test"].long(), stored["meta"])
