"""Quantization judged by task metrics on models trained here (issue 45.4): the small version of
``python -m bench.trained``, on the stored weights (``bench/data/trained_*.pt``,
``bench/data/digits_cnn.pt``) and a quarter of the stored test text.

Floors are task metrics: test perplexity per byte of the byte-level GPT and LSTM trained on the
standard library's source, and accuracy on the held-out digits. Where a peer is the reference
(torchao's int4 weight-only, ExecuTorch's per-tensor linears), it runs side by side on the same
program and data.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from bench.trained import flows
from bench.trained.tasks import Task, metrics, task

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: a quarter of the stored test windows (32 x 64 bytes): enough to separate the cells below
TEST_BATCHES = 4


@cache
def loaded(name: str) -> Task:
    torch.manual_seed(0)
    return task(name, test_batches=TEST_BATCHES if name != "digits_cnn" else None)


def score(
    t: Task, backend: str, algorithms: tuple[Any, ...] = (), artifact: bool = False, **options: Any
) -> dict[str, Any]:
    found = flows.quantplug_flow(t, backend, options, algorithms, artifact=artifact)
    return {where: metrics(t, outs) for where, outs in found.items()}


def delta(t: Task, found: dict[str, float], key: str = "ppl") -> float:
    return found[key] - metrics(t, t.reference)[key]


def test_the_models_learned_their_task() -> None:
    """What the floors below stand on: the stored models predict far better than chance (a byte
    uniformly at random: perplexity 256)."""
    gpt, lstm, digits = (metrics(t, t.reference) for t in map(loaded, ("char_gpt", "lstm_lm", "digits_cnn")))
    assert gpt["ppl"] < 7 and gpt["accuracy"] > 45, gpt
    assert lstm["ppl"] < 6.5 and lstm["accuracy"] > 45, lstm
    assert digits["accuracy"] > 97, digits


def test_reference_int4_is_at_least_as_good_as_torchao_int4_on_the_trained_gpt() -> None:
    t = loaded("char_gpt")
    ours = score(t, "reference", preset="weight_only_int4", artifact=True)
    torchao = metrics(t, flows.torchao_int4(t))
    assert delta(t, ours["program"]) <= delta(t, torchao), (ours["program"]["ppl"], torchao["ppl"])
    assert delta(t, ours["program"]) < 0.03
    # the shipped artifact (MatMulNBits in ONNX Runtime) computes what the program computes
    assert abs(ours["artifact"]["ppl"] - ours["program"]["ppl"]) < 1e-3


def test_qnn_htp_4_bit_linears_per_channel_by_default_beat_executorchs_per_tensor() -> None:
    from quantplug_qnn_htp import EXECUTORCH_DEFAULTS

    t = loaded("char_gpt")
    ours = score(t, "qnn_htp", precision="16a4w")["program"]
    theirs = score(t, "qnn_htp", precision="16a4w", **{**EXECUTORCH_DEFAULTS})["program"]
    assert delta(t, ours) < 0.5 * delta(t, theirs), (ours["ppl"], theirs["ppl"])


@pytest.mark.parametrize(
    ("name", "backend", "options", "ceiling"),
    [
        ("char_gpt", "reference", {"preset": "int8"}, 0.05),
        ("char_gpt", "qnn_htp", {"precision": "16a8w"}, 0.01),
        ("lstm_lm", "reference", {"preset": "int8"}, 0.05),
        ("lstm_lm", "qnn_htp", {"precision": "16a8w"}, 0.01),
    ],
    ids=["gpt-ref-int8", "gpt-htp-16a8w", "lstm-ref-int8", "lstm-htp-16a8w"],
)
def test_8_bit_weights_keep_the_perplexity(
    name: str, backend: str, options: dict[str, Any], ceiling: float
) -> None:
    t = loaded(name)
    found = score(t, backend, artifact=backend == "reference", **options)
    for where, measured in found.items():
        assert delta(t, measured) < ceiling, (where, measured)


def test_digits_accuracy_at_4_bit_weights() -> None:
    t = loaded("digits_cnn")
    base = metrics(t, t.reference)["accuracy"]
    for backend, options in (("qnn_htp", {"precision": "16a4w"}), ("reference", {"preset": "int8"})):
        found = score(t, backend, **options)["program"]
        assert found["accuracy"] >= base - 0.6, (backend, options, found)  # at most 2 of 360 images
