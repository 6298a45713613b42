"""Attention masks filled with ``torch.finfo(dtype).min``, as transformers fills them (small
configs, random weights, the sweep's builders and seeds).

Observers took -3.4e38 for data: the softmax input's grid spanned it, every real score rounded to
the same code, and attention became a plain average of the visible positions at every 8-bit
preset of ``reference`` (T5 22.5 dB, MPT 25.7; random weights hide most of it, a trained model
would lose its attention outright). ``_quantplug.observers.nonfinite`` now takes a value the model
computes at or below -65504 for a mask, as it takes ``-inf``.

The check is structural: no activation grid of the converted program spans a mask value, and
the observers counted the masks. Floors: measured minus 3 dB, rounded down to 0.5 dB.

Code older than ``finfo.min`` masks with -1e4 (OpenAI GPT, MarkupLM's padding): a value that is
data on a plain activation, and a mask on the way into a softmax (``_quantplug.graph.softmax_inputs``).
There the grid spanned 1e4, and at ``qnn_htp`` 16a8w the attention probabilities of both models
read 40 dB against float where they read 76-77 with the grid on the real scores.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import quantplug
from _quantplug.debug.compare import compare
from _quantplug.graph.softmax_inputs import SOFTMAX_SCORES
from _quantplug.meta import STATE_KEY
from _quantplug.observers.nonfinite import masked_counts
from tests.zoo.sweep import SWEEP, export, quantizer, run, sqnr

pytest.importorskip("transformers")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

#: model -> SQNR floor at reference int8 (measured: T5 28.3, MPT 27.3, BLOOM 35.2)
FLOORS = {"t5": 25.0, "mpt": 24.0, "bloom": 32.0}
#: the widest activation grid a real value needs here is under 40; a mask value makes it 3.4e38
WIDEST = 1e3


def _calibrated(name: str, backend: str, preset: str) -> tuple[Any, Any, Any, list[Any]]:
    """The sweep's model ``name`` exported, prepared and calibrated on 2 batches (the sweep's seed),
    and 2 held-out batches."""
    spec = SWEEP[name]
    gen = torch.Generator().manual_seed(1234)
    model = spec.build()
    program, _ = export(model, spec.draw(gen))
    calibration = [spec.draw(gen) for _ in range(2)]
    held_out = [spec.draw(gen) for _ in range(2)]
    prepared = quantplug.prepare(program, quantizer(backend, preset))
    run(prepared, calibration)
    assert masked_counts(prepared), "the observers saw no mask"
    return model, program, prepared, held_out


def _width(qp: Any) -> float:
    return float(torch.as_tensor(qp.scale).max()) * (qp.quant_max - qp.quant_min)


@pytest.mark.parametrize("name", list(FLOORS))
def test_finfo_min_masks_stay_out_of_the_grids(name: str) -> None:
    model, _, prepared, held_out = _calibrated(name, "reference", "int8")
    reference = run(copy.deepcopy(model), held_out)
    converted = quantplug.convert(prepared)
    widths = {
        key: _width(qp)
        for key, qp in converted.meta["quantplug_qparams"].items()
        if qp.quant_max - qp.quant_min < 2**16  # activations and weights, not int32 biases
    }
    widest = max(widths, key=widths.__getitem__)
    assert widths[widest] < WIDEST, f"group {widest} spans {widths[widest]:.3g}"
    assert sqnr(reference, run(converted, held_out)) > FLOORS[name]


#: (model, backend, preset) -> floor on the SQNR (dB) of every attention-probabilities node, held
#: out (measured: OpenAI GPT 43.9/38.6 and 79.6/76.0, MarkupLM 31.9/31.2 and 77.2/77.1; with a
#: grid spanning -1e4, 16a8w read 79.6/40.3 and 40.4/40.4)
SOFTMAX_FLOORS = {
    ("openai_gpt", "reference", "int8"): 35.5,
    ("openai_gpt", "qnn_htp", "16a8w"): 73.0,
    ("markuplm", "reference", "int8"): 28.0,
    ("markuplm", "qnn_htp", "16a8w"): 74.0,
}


@pytest.mark.parametrize(("name", "backend", "preset"), list(SOFTMAX_FLOORS))
def test_minus_1e4_masks_stay_out_of_the_softmax_grids(name: str, backend: str, preset: str) -> None:
    _, program, prepared, held_out = _calibrated(name, backend, preset)
    converted = quantplug.convert(prepared)
    softmaxes = {n.name for n in prepared.graph.nodes if n.target in SOFTMAX_SCORES}
    state = prepared.meta[STATE_KEY]
    qparams = converted.meta["quantplug_qparams"]
    into_softmax = [
        g for g in state.groups if any(isinstance(k, tuple) and k[1] in softmaxes for k in g.keys)
    ]
    assert into_softmax, "no quantized softmax input"
    for group in into_softmax:
        width = _width(qparams[group.gid])
        assert width < WIDEST, f"{group.describe()} spans {width:.3g}"
    report = compare(program, converted, held_out)
    probabilities = [n for n in report.nodes if n.float_node in softmaxes or n.node in softmaxes]
    assert probabilities
    for node in probabilities:
        assert node.sqnr_db is not None and node.sqnr_db > SOFTMAX_FLOORS[name, backend, preset], node.node
