"""Running the zoo: float references, quantplug's flow per preset, the peers' flows, SQNR.

Everything a zoo test needs is computed once per process and shared (``functools.cache``): the
exported program and float outputs of a model are used by every preset, a converted program by
the accuracy, lowering and integer-weight checks. Calibration and held-out batches are drawn from
fixed seeds, so every machine quantizes the same numbers.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule

import quantplug
from tests.zoo.models import IMAGE, MODELS, Inputs
from tests.zoo.more_models import MORE_MODELS

CALIBRATION_BATCHES = 2
HELD_OUT_BATCHES = 4
#: the first seed of the fresh draws that re-judge a peer comparison (``redrawn_sqnrs``)
REDRAW_SEED = 100

REFERENCE_PRESETS = ("int8", "a16w8", "weight_only_int4", "dynamic_int8")
QNN_PRESETS = ("8a8w", "16a8w", "16a4w", "16a4w_block", "16a16w")
SOC_MODEL = "SM8650"  # HTP V75: every precision above is allowed
PRESETS: tuple[tuple[str, str], ...] = tuple(("reference", p) for p in REFERENCE_PRESETS) + tuple(
    ("qnn_htp", p) for p in QNN_PRESETS
)


RECORD_ENV = "QUANTPLUG_ZOO_RECORD"


def record(**fields: Any) -> None:
    """Append one measurement as a JSON line to the file named by ``$QUANTPLUG_ZOO_RECORD``, if set
    (how the floors table and the peer comparison are remeasured: ``tests/zoo/report.py``)."""
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(fields) + "\n")


@dataclass
class FloatCase:
    """A zoo model exported once, with its batches and its float outputs on the held-out batches."""

    name: str
    model: torch.nn.Module
    program: torch.export.ExportedProgram
    calibration: list[Inputs]
    held_out: list[Inputs]
    reference: list[torch.Tensor]


@functools.cache
def float_case(name: str, calibration_batches: int = CALIBRATION_BATCHES) -> FloatCase:
    """``calibration_batches`` beyond the zoo's 2 are drawn after the held-out batches, so the
    first 2 and the held-out batches are the same whatever the count."""
    zoo: Any
    if name in MODELS or name in MORE_MODELS:
        zoo = MODELS[name] if name in MODELS else MORE_MODELS[name]
        draw = zoo.draw
    else:  # one of the architectures tests/zoo/sweep.py tries (it imports this module)
        from tests.zoo.sweep import SWEEP

        zoo = SWEEP[name]
        draw = functools.partial(zoo.draw, batch=IMAGE[0])  # the zoo's batch
    model = zoo.build()
    gen = torch.Generator().manual_seed(1234)
    example = draw(gen)
    calibration = [draw(gen) for _ in range(CALIBRATION_BATCHES)]
    held_out = [draw(gen) for _ in range(HELD_OUT_BATCHES)]
    calibration += [draw(gen) for _ in range(calibration_batches - CALIBRATION_BATCHES)]
    with quiet():
        program = torch.export.export(model, example)
        with torch.no_grad():  # on a copy: RWKV writes its weights, the program's, on its first call
            eager = copy.deepcopy(model)
            reference = [eager(*batch) for batch in held_out]
    return FloatCase(name, model, program, calibration, held_out, reference)


@contextmanager
def quiet() -> Iterator[None]:
    """Silence the peers' and transformers' deprecation chatter (it is not what is tested)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def sqnr(reference: list[torch.Tensor], outputs: list[Any]) -> float:
    """Signal-to-quantization-noise ratio in dB over all held-out outputs (float64 sums)."""
    signal = noise = 0.0
    for ref, out in zip(reference, outputs, strict=True):
        r = ref.detach().to(torch.float64)
        o = torch.as_tensor(out).detach().to(torch.float64)
        signal += float(r.pow(2).sum())
        noise += float((r - o).pow(2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def run(gm: Callable[..., Any], batches: list[Inputs]) -> list[Any]:
    with torch.no_grad():
        return [gm(*batch) for batch in batches]


def quantizer(backend: str, preset: str, **options: Any) -> Any:
    if backend == "qnn_htp":
        return quantplug.get_quantizer("qnn_htp", soc_model=SOC_MODEL, precision=preset, **options)
    # one ONNX Runtime thread, as the zoo runs torch (tests/conftest.py: one intra-op thread)
    return quantplug.get_quantizer(backend, preset=preset, ort_threads=1, **options)


@dataclass
class Quantized:
    """quantplug's result for one model and preset."""

    quantizer: Any
    program: GraphModule
    sqnr: float


Options = tuple[tuple[str, Any], ...]  # extra quantizer options, hashable (a cache key)


@functools.cache
def quantized(name: str, backend: str, preset: str, options: Options = ()) -> Quantized:
    """export (shared) -> prepare -> calibrate -> convert, and the program's SQNR against float."""
    case = float_case(name)
    q = quantizer(backend, preset, **dict(options))
    with quiet():
        prepared = quantplug.prepare(case.program, q)
        run(prepared, case.calibration)
        converted = quantplug.convert(prepared)
    return Quantized(q, converted, sqnr(case.reference, run(converted, case.held_out)))


# --- peers (test oracles only): torchao's prepare_pt2e/convert_pt2e with ExecuTorch's quantizers ---


def executorch_qnn_quantizer(preset: str) -> Any:
    """ExecuTorch's QnnQuantizer configured as quantplug's qnn_htp defaults (per-channel conv only)."""
    os.environ.setdefault("QNN_SDK_ROOT", "")  # or ExecuTorch tries to download an SDK
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

    q = QnnQuantizer(soc_model=getattr(QcomChipset, SOC_MODEL))
    q.set_default_quant_config(
        getattr(QuantDtype, f"use_{preset}"), is_conv_per_channel=True, is_linear_per_channel=False
    )
    return q


def xnnpack_quantizer(preset: str) -> Any:
    """XNNPACKQuantizer: static int8 per-channel (vs reference int8) or dynamic (vs dynamic_int8)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    q = XNNPACKQuantizer()
    q.set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=preset == "dynamic_int8"))
    return q


@dataclass(frozen=True)
class Peer:
    """ExecuTorch's quantizer for the same scheme as one of our presets, and the options under
    which ours is compared with it."""

    name: str
    factory: Callable[[str], Any]
    options: Options = ()


#: the reference backend's default weight grid is 7-bit ([-64, 64], ``weight_bits=7``: its ONNX
#: Runtime artifact is exact on CPUs without VNNI); XNNPACKQuantizer's is [-127, 127], so the
#: like-for-like comparison runs the reference presets at ``weight_bits=8``
_EIGHT_BIT_WEIGHTS: Options = (("weight_bits", 8),)

#: our preset -> its peer; presets without an equivalent peer are absent
PEERS: dict[tuple[str, str], Peer] = {
    ("reference", "int8"): Peer("XNNPACKQuantizer", xnnpack_quantizer, _EIGHT_BIT_WEIGHTS),
    ("reference", "dynamic_int8"): Peer("XNNPACKQuantizer dynamic", xnnpack_quantizer, _EIGHT_BIT_WEIGHTS),
    **{
        ("qnn_htp", p): Peer("QnnQuantizer", executorch_qnn_quantizer)
        for p in ("8a8w", "16a8w", "16a4w", "16a16w")
    },
}


def peer_options(backend: str, preset: str) -> Options:
    """The options ours runs under when compared with the peer: the peer's, and at qnn_htp
    ``EXECUTORCH_DEFAULTS`` (QnnQuantizer's moving-average observer without a range margin, and
    LSTM/GRU/RNN ops left float, as it has no rule for them): the like-for-like comparison
    quantizes what it quantizes, as it does (qnn_htp's defaults, which the floors measure, observe
    the calibrated extremes with a 16-bit margin and unroll recurrent layers)."""
    options = PEERS[(backend, preset)].options
    if backend == "qnn_htp":
        from quantplug_qnn_htp import EXECUTORCH_DEFAULTS

        return (*options, *sorted(EXECUTORCH_DEFAULTS.items()))
    return options


@functools.cache
def _peer_input(name: str, qnn: bool) -> GraphModule:
    """What ``prepare_pt2e`` makes of the model before it asks the quantizer to annotate, up to
    what no preset changes: the program as a module with torchao's conv/linear-batch-norm
    fusion and, for QnnQuantizer (``qnn``), its ``transform_for_annotation``, which depends on
    the SoC only. Made once per model (the transform re-traces the graph: a third of the peer's
    flow); each flow prepares a copy, on which ``prepare_pt2e``'s own fusion finds nothing."""
    from torchao.quantization.pt2e.utils import _fuse_conv_bn_, _fuse_linear_bn_

    with quiet():
        if qnn:
            model = copy.deepcopy(_peer_input(name, False))
            return executorch_qnn_quantizer("8a8w").transform_for_annotation(model)  # type: ignore[no-any-return]
        model = float_case(name).program.module()
        _fuse_conv_bn_(model)
        _fuse_linear_bn_(model)
        return model  # type: ignore[no-any-return]


def torchao_prepared(name: str, backend: str, preset: str) -> GraphModule:
    """torchao's ``prepare_pt2e`` with the peer quantizer, on a copy of the model's
    :func:`_peer_input` (the quantizer's own transform has nothing left to do there)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    peer = PEERS[(backend, preset)]
    qnn = peer.factory is executorch_qnn_quantizer
    model = copy.deepcopy(_peer_input(name, qnn))
    quantizer = peer.factory(preset)
    if qnn:  # applied to the shared input already
        quantizer.transform_for_annotation = lambda m: m
    with quiet():
        return prepare_pt2e(model, quantizer)  # type: ignore[no-any-return]


@functools.cache
def torchao_converted(name: str, backend: str, preset: str) -> GraphModule:
    """The peer's program: torchao's prepare_pt2e/convert_pt2e with the peer quantizer."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    prepared = torchao_prepared(name, backend, preset)
    with quiet():
        run(prepared, float_case(name).calibration)
        return convert_pt2e(prepared)  # type: ignore[no-any-return]


@functools.cache
def peer_sqnr(name: str, backend: str, preset: str) -> float:
    case = float_case(name)
    return sqnr(case.reference, run(torchao_converted(name, backend, preset), case.held_out))


@functools.cache
def redrawn_sqnrs(name: str, backend: str, preset: str, draws: int) -> list[tuple[float, float]]:
    """(ours, peer's) SQNR on ``draws`` fresh draws of calibration and held-out batches (fixed
    seeds, distinct from the zoo's own): the same model and program, only the data changes.

    One draw of two calibration batches decides the peer comparison of most models, but on a deep
    random network a range that differs by a few tenths of a percent moves the SQNR by a dB either
    way, so a single draw below the margin is judged again on the mean over these draws."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    case = float_case(name)
    zoo = MODELS[name]
    pairs: list[tuple[float, float]] = []
    for draw in range(draws):
        gen = torch.Generator().manual_seed(REDRAW_SEED + draw)
        calibration = [zoo.draw(gen) for _ in range(CALIBRATION_BATCHES)]
        held_out = [zoo.draw(gen) for _ in range(HELD_OUT_BATCHES)]
        reference = run(case.model, held_out)
        with quiet():
            prepared = quantplug.prepare(
                case.program, quantizer(backend, preset, **dict(peer_options(backend, preset)))
            )
            run(prepared, calibration)
            ours = sqnr(reference, run(quantplug.convert(prepared), held_out))
            theirs_prepared = torchao_prepared(name, backend, preset)
            run(theirs_prepared, calibration)
            theirs = sqnr(reference, run(convert_pt2e(theirs_prepared), held_out))
        pairs.append((ours, theirs))
    return pairs


@functools.cache
def foreign_converted(name: str) -> GraphModule:
    """ExecuTorch's QnnQuantizer (8a8w) through quantplug.prepare/convert: the foreign-quantizer path."""
    case = float_case(name)
    with quiet():
        prepared = quantplug.prepare(case.program, executorch_qnn_quantizer("8a8w"))
        run(prepared, case.calibration)
        return quantplug.convert(prepared)


def forget() -> None:
    """Drop every cached result (the zoo fixture calls it when pytest moves to the next model)."""
    for cached in (
        float_case,
        quantized,
        _peer_input,
        torchao_converted,
        peer_sqnr,
        redrawn_sqnrs,
        foreign_converted,
    ):
        cached.cache_clear()
