"""Run one model through torchao's PT2E flow and through quantplug's, from the same export.

torchao gets ``ep.module()`` (what its users pass to ``prepare_pt2e``), quantplug the same
GraphModule, each with a fresh quantizer and the same calibration batches, so a difference in
what the two converted programs hold is a difference between the flows, never between inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

import quantplug


@dataclass
class Converted:
    torchao: GraphModule
    quantplug: GraphModule


def both(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    make_quantizer: Callable[[], Any],
    *,
    batches: Sequence[tuple[Any, ...]] | None = None,
) -> Converted:
    """Export ``model`` once, then prepare, calibrate and convert it with each flow."""
    exported = torch.export.export(model.eval(), inputs, strict=True)
    batches = batches or [inputs]
    results = []
    for prepare, convert in ((prepare_pt2e, convert_pt2e), (quantplug.prepare, quantplug.convert)):
        prepared = prepare(exported.module(), make_quantizer())
        for batch in batches:
            prepared(*batch)
        results.append(convert(prepared))
    return Converted(*results)
