"""The guard's default held-out split (``HELD_OUT_EVERY``): every 4th calibration batch is kept
from the algorithms and the transforms, and the guard judges on those batches; with fewer
batches, or ``held_out="calibration"``, it judges on the calibration batches as in 0.1."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

import quantplug
from _quantplug.algorithms.sequential import HELD_OUT_EVERY
from _quantplug.algorithms.spec import TransformContext
from _quantplug.algorithms.taps import taps
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from tests.algorithms.test_algorithm_guard import BATCH, Mlp, data

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def prepared_and_calibrated(batches: int, **config: Any) -> tuple[Any, torch.Tensor]:
    x = data()[: batches * BATCH]
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(["gptq"], **config))
    with torch.no_grad():
        for i in range(0, len(x), BATCH):
            prepared(x[i : i + BATCH])
    return prepared, x


def test_every_4th_batch_is_held_out_from_the_algorithms_and_judged_on() -> None:
    assert HELD_OUT_EVERY == 4
    prepared, x = prepared_and_calibrated(8)
    run = prepared.meta[RUN_KEY]
    held = [batch[0] for batch in run.held_out]
    assert len(held) == 2
    assert torch.equal(held[0], x[3 * BATCH : 4 * BATCH]) and torch.equal(held[1], x[7 * BATCH :])
    fed, store = taps(prepared)
    assert fed and all(tap.batches == 6 for tap in fed)  # the collectors saw the other six
    assert store is not None and len(store.batches) == 6 and store.seen == 8
    quantplug.convert(prepared)
    assert run.guarded is not None and run.guarded.judged_on == "held-out"


def test_with_fewer_than_4_batches_the_guard_judges_on_the_calibration_batches() -> None:
    prepared, _ = prepared_and_calibrated(3)
    run = prepared.meta[RUN_KEY]
    assert run.held_out == [] and all(tap.batches == 3 for tap in taps(prepared)[0])
    quantplug.convert(prepared)
    assert run.guarded is not None and run.guarded.judged_on == "calibration"


def test_held_out_calibration_keeps_every_batch_for_the_algorithms() -> None:
    prepared, _ = prepared_and_calibrated(8, held_out="calibration")
    run = prepared.meta[RUN_KEY]
    assert run.held_out is None and all(tap.batches == 8 for tap in taps(prepared)[0])
    quantplug.convert(prepared)
    assert run.guarded is not None and run.guarded.judged_on == "calibration"


def test_a_held_out_string_other_than_calibration_is_a_typed_error() -> None:
    with pytest.raises(quantplug.OptionError, match=r"held_out must be batches, None .* or 'calibration'"):
        quantplug.Algorithms(["gptq"], held_out="last")


class Recording(quantplug.Algorithm):
    """A transform that changes nothing and records how many batches it was given."""

    name = "recording"
    seen: ClassVar[list[int]] = []

    def transform_program(self, gm: torch.fx.GraphModule, context: TransformContext) -> None:
        Recording.seen.append(len(context.calibration or []))


@pytest.mark.parametrize(("held_out", "given"), [(None, 6), ("calibration", 8)])
def test_transforms_see_the_calibration_batches_not_held_out(held_out: Any, given: int) -> None:
    x = data()
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    batches = [(x[i : i + BATCH],) for i in range(0, len(x), BATCH)]
    Recording.seen.clear()
    quantplug.prepare(
        ep,
        quantplug.get_quantizer("reference", preset="int8"),
        algorithms=quantplug.Algorithms([Recording()], calibration=batches, held_out=held_out),
    )
    assert Recording.seen == [given]
