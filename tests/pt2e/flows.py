"""The two flows a PT2E user switches between, run side by side on one exported program.

``torchao`` is torchao 0.18's ``prepare_pt2e``/``convert_pt2e`` (the oracle), ``quantplug`` is
``quantplug.prepare``/``quantplug.convert``. Each gets its own ``ep.module()`` (torchao prepares in
place) and its own quantizer instance, then the same calibration batches and, optionally, the same
rewrite of the prepared module in between (what a PT2E user runs there: torchao's
``move_exported_model_to_eval``, ``delete_all_unused_submodules()``...).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

import quantplug

FLOWS = ("torchao", "quantplug")
qd = torch.ops.quantized_decomposed


def x86(*, is_qat: bool = False) -> X86InductorQuantizer:
    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=is_qat))


def prepare(flow: str, module: GraphModule, quantizer: Any, *, qat: bool = False) -> GraphModule:
    if flow == "torchao":
        return prepare_qat_pt2e(module, quantizer) if qat else prepare_pt2e(module, quantizer)
    return quantplug.prepare(module, quantizer, qat=qat)


def convert(flow: str, prepared: GraphModule) -> GraphModule:
    return convert_pt2e(prepared) if flow == "torchao" else quantplug.convert(prepared)


def calibrated(
    flow: str,
    program: torch.export.ExportedProgram,
    quantizer: Callable[[], Any],
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    qat: bool = False,
) -> GraphModule:
    """One flow's prepared module, fed ``batches`` (torchao's convert empties it: keep it apart)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(flow, program.module(), quantizer(), qat=qat)
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
    return prepared


def run_flow(
    flow: str,
    program: torch.export.ExportedProgram,
    quantizer: Callable[[], Any],
    batches: Sequence[tuple[torch.Tensor, ...]],
    *,
    between: Callable[[GraphModule], Any] | None = None,
    qat: bool = False,
) -> GraphModule:
    """One flow's converted module; ``between`` runs on the calibrated prepared module first."""
    prepared = calibrated(flow, program, quantizer, batches, qat=qat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if between is not None:
            between(prepared)
        return convert(flow, prepared)


def qdq_counts(gm: GraphModule) -> Counter[str]:
    """How many of each quantized_decomposed op the graph calls."""
    return Counter(
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "quantized_decomposed"
    )


def op_counts(gm: GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def batches(shape: Sequence[int], count: int = 3, seed: int = 0) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator),) for _ in range(count)]
