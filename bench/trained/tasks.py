"""The trained models as tasks: a program to quantize, calibration batches, test batches and
the task metrics (perplexity, bits per byte, accuracy, prediction flips against float)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

#: windows per batch (language models) and images per batch (digits)
LM_BATCH = 8
DIGITS_BATCH = 120
MODELS = ("char_gpt", "lstm_lm", "digits_cnn")


@dataclass(frozen=True)
class Task:
    """A trained model, its exported program, the batches and the labels of the test batches.

    Calibration and test batches share one shape (the program's), so peers' programs that check
    the exported shape take them too."""

    name: str
    kind: str  # "lm" (next-byte prediction) or "classify"
    model: nn.Module
    program: torch.export.ExportedProgram
    calibration: list[tuple[torch.Tensor, ...]]
    test: list[tuple[torch.Tensor, ...]]
    labels: list[torch.Tensor]
    reference: list[torch.Tensor]  # the float model's logits on the test batches
    #: calibration text the calibration batches leave over (language models: 4 batches), for
    #: ``bench.trained --guard-on-spare`` to give the guard as held-out data
    spare: list[tuple[torch.Tensor, ...]] = field(default_factory=list)


def task(name: str, calibration_batches: int = 8, test_batches: int | None = None) -> Task:
    """``name``'s task: 8 calibration batches by default (the language models' rows per layer:
    8 x 8 x 64 = 4096, more than any layer has inputs), every stored test batch unless fewer asked."""
    if name == "digits_cnn":
        from bench.digits_weights import trained
        from tests.reference.digits_models import HELD_OUT, images

        model = trained("cnn")
        x, y = images()
        calibration = [
            (x[i : i + DIGITS_BATCH],) for i in range(0, calibration_batches * DIGITS_BATCH, DIGITS_BATCH)
        ]
        held_x, held_y = x[-HELD_OUT:], y[-HELD_OUT:]
        test = [(held_x[i : i + DIGITS_BATCH],) for i in range(0, HELD_OUT, DIGITS_BATCH)]
        labels = [held_y[i : i + DIGITS_BATCH] for i in range(0, HELD_OUT, DIGITS_BATCH)]
        kind = "classify"
        spare = []
    else:
        from bench.trained.weights import load

        stored = load(name)
        model = stored.model
        cal, tst = stored.calibration, stored.test
        calibration = [
            (cal[i : i + LM_BATCH, :-1],) for i in range(0, calibration_batches * LM_BATCH, LM_BATCH)
        ]
        spare = [
            (cal[i : i + LM_BATCH, :-1],)
            for i in range(calibration_batches * LM_BATCH, len(cal) - LM_BATCH + 1, LM_BATCH)
        ]
        test = [(tst[i : i + LM_BATCH, :-1],) for i in range(0, len(tst), LM_BATCH)]
        labels = [tst[i : i + LM_BATCH, 1:] for i in range(0, len(tst), LM_BATCH)]
        kind = "lm"
    if test_batches is not None:
        test, labels = test[:test_batches], labels[:test_batches]
    with torch.no_grad():
        reference = [model(*b) for b in test]
    program = torch.export.export(model, calibration[0])
    return Task(name, kind, model, program, calibration, test, labels, reference, spare)


def metrics(task: Task, logits: Sequence[torch.Tensor]) -> dict[str, float]:
    """Task metrics of ``logits`` (one tensor per test batch): ``nll`` (nats per prediction),
    ``ppl`` and ``bpb`` (language models), ``accuracy`` and ``flips`` (% of predictions whose
    top-1 differs from the float model's), in percent."""
    nll = correct = flips = count = 0.0
    for out, ref, label in zip(logits, task.reference, task.labels):
        out = torch.as_tensor(out).float()
        flat = out.reshape(-1, out.shape[-1])
        target = label.reshape(-1)
        nll += float(F.cross_entropy(flat, target, reduction="sum"))
        top = flat.argmax(-1)
        correct += float((top == target).sum())
        flips += float((top != ref.reshape(-1, ref.shape[-1]).argmax(-1)).sum())
        count += target.numel()
    found = {"nll": nll / count, "accuracy": 100 * correct / count, "flips": 100 * flips / count}
    if task.kind == "lm":
        found["ppl"] = math.exp(found["nll"])
        found["bpb"] = found["nll"] / math.log(2)
    return found
