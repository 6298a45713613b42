"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE; 4 experts, 2 per token, random weights).

Their sweep found that ``qnn_htp`` rewrote the router's integer ``token_index // top_k`` as
``floor(a / b)``, a float index ``index`` refused at the first calibration batch (a bare
IndexError). With experts as batched matmuls (``experts_implementation="batched_mm"``) both
quantize and lower at both backends; transformers' default CPU kernel is a custom op looping over
the experts, which lowering refuses with that fix named.

Floors: measured with these models, data and seeds minus 3 dB, rounded down to 0.5 dB.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import _quantplug.observers.block_ops
import quantplug
from _quantplug.errors import LoweringError
from tests.zoo.harness import float_case, quantizer, quiet, run, sqnr

pytest.importorskip("transformers")
pytest.importorskip("quantplug_qnn_htp")
pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

#: model -> (qnn_htp 16a8w, reference int8) floors in dB
FLOORS = {"mixtral": (36.5, 26.0), "qwen2_moe": (37.5, 27.5)}


@pytest.mark.parametrize("name", list(FLOORS))
def test_a_mixture_of_experts_quantizes_and_lowers(name: str) -> None:
    case = float_case(name)
    for (backend, preset), floor in zip((("qnn_htp", "16a8w"), ("reference", "int8")), FLOORS[name]):
        q = quantizer(backend, preset)
        with quiet():
            prepared = quantplug.prepare(case.program, q)
            run(prepared, case.calibration)
            converted = quantplug.convert(prepared)
            artifact = quantplug.lower(converted, q)  # qnn_htp: strict, every tensor encoded
        outputs = run(converted, case.held_out)
        measured = sqnr(case.reference, outputs)
        assert measured > floor, f"{name} at {backend} {preset}: {measured:.2f} dB, floor {floor}"
        if backend == "reference":  # ONNX Runtime runs what the program computes
            ran = [np.asarray(artifact.run(*batch)) for batch in case.held_out]
            assert abs(sqnr(case.reference, ran) - measured) < 0.5


@pytest.mark.parametrize(
    "preset, low, high, group",
    [("weight_only_int4", -8, 7, 32), ("dynamic_int8", -127, 127, None)],
    ids=["weight_only_int4", "dynamic_int8"],
)
@pytest.mark.parametrize("name", list(FLOORS))
def test_weight_presets_quantize_the_experts_weights(
    name: str, preset: str, low: int, high: int, group: int | None
) -> None:
    """Each expert parameter ``[experts, out, in]``, gathered per token, is stored as integers
    in blocks within one expert's row (``quantplug_reference.rules.gather_rules``): groups of 32
    inputs at int4, a whole row on the whole int8 grid under ``dynamic_int8`` (whose linears'
    integer products keep ``[-64, 64]``). ONNX Runtime computes what the program does."""
    case = float_case(name)
    q = quantizer("reference", preset)
    with quiet():
        prepared = quantplug.prepare(case.program, q)
        run(prepared, case.calibration)
        converted = quantplug.convert(prepared)
        artifact = quantplug.lower(converted, q)
    experts = [
        n
        for n in converted.graph.nodes
        if n.target == torch.ops.aten.index.Tensor
        and n.args[0].target == _quantplug.observers.block_ops.dequantize_per_block
    ]
    assert len(experts) == 4  # gate_up and down, in each of the 2 layers
    for gather in experts:
        dq = gather.args[0]
        codes = getattr(converted, dq.args[0].target)
        assert codes.dim() == 3 and list(dq.args[3]) == [1, 1, group or codes.shape[2]]
        assert int(codes.min()) >= low and int(codes.max()) <= high
        assert int(codes.abs().max()) >= high  # the whole grid: dequantized rows, no integer product
    measured = sqnr(case.reference, run(converted, case.held_out))
    ran = [np.asarray(artifact.run(*batch)) for batch in case.held_out]
    assert abs(sqnr(case.reference, ran) - measured) < 0.1


def test_qnn_htp_per_channel_embedding_puts_the_experts_on_the_weight_grid() -> None:
    """By default ``qnn_htp`` gives a gathered parameter the activation grid (16-bit at 16a4w),
    as an embedding table; ``per_channel_embedding`` gives each expert one 4-bit scale."""
    case = float_case("mixtral")
    q = quantizer("qnn_htp", "16a4w", per_channel_embedding=True)
    with quiet():
        prepared = quantplug.prepare(case.program, q)
        run(prepared, case.calibration)
        converted = quantplug.convert(prepared)
        artifact = quantplug.lower(converted, q)  # strict: every tensor encoded
    params = json.loads(artifact.files["model.encodings"])["param_encodings"]
    experts = [e for e in params if "experts" in e["name"]]
    assert len(experts) == 4  # gate_up and down, in each of the 2 layers
    assert all(e["enc_type"] == "PER_CHANNEL" and e["bw"] == 4 and len(e["scale"]) == 4 for e in experts)
    measured = sqnr(case.reference, run(converted, case.held_out))
    assert measured > 11.0, f"{measured:.2f} dB"  # 14.4 measured; 15.6 with 16-bit experts


def test_the_default_experts_kernel_calibrates_and_lowering_names_the_fix() -> None:
    """transformers' grouped-matmul kernel (its default on CPU) exports as one custom op."""
    from tests.zoo.sweep import TEXT, SweepModel, _moe

    make = _moe("MixtralForCausalLM", "MixtralConfig", experts_implementation=None, num_local_experts=4)
    spec = SweepModel("mixtral_grouped_mm", make, TEXT, "tokens")
    gen = torch.Generator().manual_seed(0)
    with quiet():
        model = spec.build()
        program = torch.export.export(model, spec.draw(gen))
    q = quantizer("qnn_htp", "16a8w")
    with quiet():
        prepared = quantplug.prepare(program, q)
        run(prepared, [spec.draw(gen)])  # the router's integer floor division stays an index
        converted = quantplug.convert(prepared)
        with pytest.raises(LoweringError, match=r"grouped_mm_fallback.*experts_implementation='batched_mm'"):
            quantplug.lower(converted, q)
