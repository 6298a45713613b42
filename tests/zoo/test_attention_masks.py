"""Attention masks filled with ``torch.finfo(dtype).min``, as transformers fills them (small
configs, random weights, the sweep's builders and seeds).

Observers took -3.4e38 for data: the softmax input's grid spanned it, every real score rounded to
the same code, and attention became a plain average of the visible positions at every 8-bit
preset of ``reference`` (T5 22.5 dB, MPT 25.7; random weights hide most of it, a trained model
would lose its attention outright). ``quantplug.observers.nonfinite`` now takes a value the model
computes at or below -65504 for a mask, as it takes ``-inf``.

The check is structural: no activation grid of the converted program spans a mask value, and
the observers counted the masks. Floors: measured minus 3 dB, rounded down to 0.5 dB.
"""

from __future__ import annotations

import copy

import pytest
import torch

import quantplug
from quantplug.observers.nonfinite import masked_counts
from tests.zoo.sweep import SWEEP, export, quantizer, run, sqnr

pytest.importorskip("transformers")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

#: model -> SQNR floor at reference int8 (measured: T5 28.3, MPT 27.3, BLOOM 35.2)
FLOORS = {"t5": 25.0, "mpt": 24.0, "bloom": 32.0}
#: the widest activation grid a real value needs here is under 40; a mask value makes it 3.4e38
WIDEST = 1e3


@pytest.mark.parametrize("name", list(FLOORS))
def test_finfo_min_masks_stay_out_of_the_grids(name: str) -> None:
    spec = SWEEP[name]
    gen = torch.Generator().manual_seed(1234)
    model = spec.build()
    program, _ = export(model, spec.draw(gen))
    calibration = [spec.draw(gen) for _ in range(2)]
    held_out = [spec.draw(gen) for _ in range(2)]
    reference = run(copy.deepcopy(model), held_out)
    prepared = quantplug.prepare(program, quantizer("reference", "int8"))
    run(prepared, calibration)
    assert masked_counts(prepared), "the observers saw no mask"
    converted = quantplug.convert(prepared)
    widths = {
        key: float(torch.as_tensor(qp.scale).max()) * (qp.quant_max - qp.quant_min)
        for key, qp in converted.meta["quantplug_qparams"].items()
        if qp.quant_max - qp.quant_min < 2**16  # activations and weights, not int32 biases
    }
    widest = max(widths, key=widths.__getitem__)
    assert widths[widest] < WIDEST, f"group {widest} spans {widths[widest]:.3g}"
    assert sqnr(reference, run(converted, held_out)) > FLOORS[name]
