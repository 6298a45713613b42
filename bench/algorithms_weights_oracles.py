"""quantplug's GPTQ / SeqMSE / AdaRound side by side with NNCF 3.4 and AIMET 2.42 on the same models.

NNCF and AIMET do not share .venv (they may pull other packages; torch must stay 2.13.0), so this
runs in its own environment with torch pinned:

    python3.11 -m venv /tmp/oracles && V=/tmp/oracles/bin/python
    $V -m pip install torch==2.13.0 && $V -m pip install torchvision==0.28.0 --no-deps
    printf 'torch==2.13.0\ntorchvision==0.28.0\n' > /tmp/pins.txt
    $V -m pip install -c /tmp/pins.txt nncf==3.4.0 aimet-torch==2.42.0 scikit-learn
    $V -m pip install torchao==0.18.0 --no-deps             # NNCF's TorchFX backend imports it
    $V -m pip install openvino==2026.4.1                    # NNCF's GPTQ (bench.scale_oracles)
    $V -m pip install --no-deps -e . -e plugins/reference -e plugins/qnn_htp pluggy
    $V -m bench.algorithms_weights_oracles

Models: ``decoder`` (two Llama-style MLP blocks, LayerNorm + SwiGLU + residual, Gaussian weights,
inputs with a few outlier channels as LLM activations have) and ``digits`` (the MLP of
tests/reference/test_reference_digits.py, trained on scikit-learn's digits: real trained weights).
Same 8 calibration batches, SQNR on 4 others, in one run.

* NNCF ``compress_weights`` on the exported program (TorchFX; INT4_SYM, group 32, every layer,
  no backup precision) -- round to nearest, ``scale_estimation`` (its output-L2 scale search, the
  counterpart of SeqMSE), AWQ, and ``gptq`` (which NNCF 3.4 runs on OpenVINO models only) --
  against quantplug ``reference`` ``weight_only_int4`` (int4 symmetric, group 32): default,
  ``gptq``, ``seq_mse``, both, and GPTQ with its scale search (``gptq(scale_search=20)``, which
  like NNCF's scale estimation chooses each group's scale on the layer's output error).
* AIMET ``QuantizationSimModel`` (4-bit per-channel symmetric weights, 16-bit min-max activations)
  -- its default, ``apply_seq_mse``, ``Adaround`` (500 steps per layer, as quantplug's default)
  -- on qnn_htp's 4-bit grid ``[-7, 7]`` and on AIMET's own ``[-8, 7]`` (:func:`aimet_run`),
  against quantplug ``qnn_htp`` 16a4w with ``per_channel_linear=True, act_observer="minmax"``
  and ``act_range_margin=1`` (AIMET's grid options, ``bench/results/qnn_grid_study.md``; the
  preset on ExecuTorch's grid, per-tensor linear weights and its moving-average observer, is
  listed too): default, ``seq_mse``, ``adaround``, both, and ``seq_mse`` with AIMET's candidates
  (which reproduces AIMET's SeqMSE on the same grid: the implementations agree; the defaults'
  wider search is what is ahead).

NNCF's grid differs slightly (its int4 is [-8, 7] with scale max/8, reference's [-8, 7] with
max/7.5): compare each tool's gain over its own default as well as the absolute SQNR.
Writes ``bench/results/algorithms_weights_oracles.md``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quantplug
from bench.algorithm_models import batch_dynamic_shapes
from bench.algorithms import GPTQ_SCALE_SEARCH, spec_label

RESULTS = Path(__file__).resolve().parent / "results"


class MlpBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # AIMET 2.42 has no quantized RMSNorm
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 192, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MlpBlock(dim, hidden) for _ in range(layers)])
        self.head = nn.Linear(dim, 128, bias=False)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


#: qnn_htp's options that give AIMET's grid (qnn_grid_study.md): per-channel linear weights, min-max
AIMET_GRID_OPTIONS = {"per_channel_linear": True, "act_observer": "minmax", "act_range_margin": 1.0}
AIMET_GRID_OPTIONS_LABEL = "per_channel_linear+minmax"
#: (row, quantplug algorithms) compared with AIMET's same-named run
AIMET_SIDE_BY_SIDE: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("default", ()),
    ("seq_mse", ("seq_mse",)),
    ("seq_mse (AIMET's 20 candidates)", (("seq_mse", {"candidates": 20, "max_fraction": 1.0}),)),
    ("adaround", ("adaround",)),
    ("seq_mse+adaround", ("seq_mse", "adaround")),
)


def build(name: str) -> tuple[nn.Module, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if name == "decoder":
        scale = torch.ones(64)
        scale[[3, 17, 40]] = 20.0  # outlier channels
        return Decoder().eval(), [torch.randn(4, 16, 64, generator=g) * scale for _ in range(12)]
    from bench.algorithm_models import build as bench_build

    model, batches = bench_build("digits_mlp")
    return model, [b[0] for b in batches]


def sqnr(refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> float:
    signal = sum(float(r.double().pow(2).sum()) for r in refs)
    noise = sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(refs, outs))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def ours(
    model: nn.Module, batches: list[torch.Tensor], backend: str, algs: Sequence[Any], **opts: Any
) -> float:
    calibration, measure = batches[:8], batches[8:]
    ep = torch.export.export(model, (calibration[0],))
    quantizer = quantplug.get_quantizer(backend, **opts)  # unguarded: the algorithm's choices, as AIMET's
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(list(algs), guard=False))
    with torch.no_grad():
        for b in calibration:
            prepared(b)
        converted = quantplug.convert(prepared)
        return sqnr([model(b) for b in measure], [converted(b) for b in measure])


def nncf_run(model: nn.Module, batches: list[torch.Tensor], **flags: Any) -> float:
    import copy

    calibration, measure = batches[:8], batches[8:]
    # NNCF's data-aware algorithms run on TorchFX (its nn.Module backend takes no dataset options)
    dynamic = batch_dynamic_shapes([(b,) for b in batches])
    program = torch.export.export(copy.deepcopy(model), (calibration[0],), dynamic_shapes=dynamic).module()
    compressed = nncf_compress(program, calibration, **flags)
    with torch.no_grad():
        return sqnr([model(b) for b in measure], [compressed(b) for b in measure])


def nncf_compress(
    program: Any, calibration: Sequence[torch.Tensor], group_size: int = 32, **flags: Any
) -> Any:
    """NNCF 3.4 ``compress_weights`` on an exported program's module (TorchFX) or an OpenVINO model
    (:func:`openvino_model`, compressed in place: NNCF's OpenVINO backend), as this bench runs it:
    INT4_SYM on every layer (``all_layers``, no backup precision), ``group_size`` weights per scale
    (-1: one per output channel), the data-aware algorithms in ``flags`` fed ``calibration`` (as
    numpy arrays for an OpenVINO model, which is what its inference takes)."""
    import nncf

    items = list(calibration) if isinstance(program, nn.Module) else [b.numpy() for b in calibration]
    return nncf.compress_weights(
        program,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        ratio=1.0,
        group_size=group_size,
        all_layers=True,
        backup_mode=nncf.BackupMode.NONE,
        dataset=nncf.Dataset(items),
        subset_size=sum(b.shape[0] for b in calibration),
        **flags,
    )


def openvino_model(model: nn.Module, example: tuple[torch.Tensor, ...]) -> Any:
    """``model`` as an OpenVINO model, for NNCF's OpenVINO-only algorithms (GPTQ): converted from its
    ``torch.export`` program (OpenVINO 2026.4's TorchScript path has no rule for the ``aten::diff``
    of transformers' attention mask; the exported program has none left)."""
    import openvino

    with torch.no_grad():
        return openvino.convert_model(torch.export.export(model, example))


def openvino_run(ov_model: Any, inputs: Sequence[torch.Tensor], threads: int | None = None) -> torch.Tensor:
    """The first output of ``ov_model`` on ``inputs``, compiled for OpenVINO's CPU plugin at float32
    (its default on some CPUs is bf16, which would be measured as NNCF's error)."""
    import openvino

    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = openvino.Core().compile_model(ov_model, "CPU", config)
    return torch.from_numpy(compiled([x.numpy() for x in inputs])[0])


def aimet_run(model: nn.Module, batches: list[torch.Tensor], algorithm: str, grid: str = "aimet") -> float:
    """AIMET 2.42: QuantizationSimModel (4-bit per-channel symmetric weights, 16-bit activations).

    ``grid="aimet"``: its own 4-bit grid, ``[-8, 7]`` with ``scale = max(-min / 8, max / 7)`` (one
    level more than qnn_htp's; AIMET's quantsim v2 has no strict-symmetric mode). ``grid="qnn"``:
    every weight quantizer replaced by a ``[-7, 7]`` one (``scale = amax / 7``, qnn_htp's and
    ExecuTorch's), so both tools run on the same grid; two AIMET internals that assume a
    power-of-two grid are adapted (:func:`_aimet_on_qnn_grid`).
    """
    calibration, measure = batches[:8], batches[8:]
    reference = model
    model = aimet_prepare(model)
    dummy = calibration[0]

    if algorithm == "adaround":
        from aimet_common.defs import QuantScheme
        from aimet_torch.adaround.adaround_weight import Adaround, AdaroundParameters

        params = AdaroundParameters(  # quantplug's step count (AIMET's default 10,000: minutes per layer)
            data_loader=[(b, None) for b in calibration],
            num_batches=len(calibration),
            default_num_iterations=500,
        )
        # Adaround builds its own sim: on the qnn grid, the same restricted one. The model it returns
        # holds the rounded weights (a fresh sim's min-max encoding of them gives back the same
        # codes: each channel's largest weight sits on the grid's end), so its encodings file is not
        # needed (and cannot spell a [-7, 7] grid).
        with _patched(
            Adaround, "_get_quantsim", staticmethod(lambda m, **kw: aimet_sim(m, dummy, grid, **kw))
        ):
            with _patched(Adaround, "_export_encodings_to_json", classmethod(lambda cls, *a, **k: None)):
                with tempfile.TemporaryDirectory() as tmp:
                    model = Adaround.apply_adaround(
                        model,
                        dummy,
                        params,
                        path=tmp,
                        filename_prefix="ada",
                        default_param_bw=4,
                        default_quant_scheme=QuantScheme.post_training_tf,
                        default_config_file=_aimet_per_channel_config(),
                    )
        _strip_quantized_modules(model)
        sim = aimet_sim(model, dummy, grid)
    else:
        sim = aimet_sim(model, dummy, grid)
        if algorithm == "seq_mse":
            aimet_seq_mse(model, sim, calibration, grid)
    aimet_calibrate(sim, calibration)
    with torch.no_grad():
        return sqnr([reference(b) for b in measure], [sim.model(b) for b in measure])


def aimet_prepare(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its functionals (silu, *, +) as modules, as AIMET quantizes only modules."""
    import copy

    from tests.torchvision_compat import ensure_importable

    ensure_importable()  # AIMET imports torchvision, whose CUDA wheel needs its op schemas here
    from aimet_torch.model_preparer import prepare_model

    return prepare_model(copy.deepcopy(model))  # type: ignore[no-any-return]


def aimet_sim(model: nn.Module, dummy: Any, grid: str = "aimet", **kwargs: Any) -> Any:
    """AIMET's ``QuantizationSimModel`` of a prepared model: 4-bit per-channel symmetric weights,
    16-bit min-max (``post_training_tf``) activations, on ``grid`` (see :func:`aimet_run`)."""
    from aimet_common.defs import QuantScheme
    from aimet_torch.quantsim import QuantizationSimModel

    options = {
        "dummy_input": dummy,
        "quant_scheme": QuantScheme.post_training_tf,
        "default_param_bw": 4,
        "default_output_bw": 16,
        "config_file": _aimet_per_channel_config(),
        **kwargs,
    }
    sim = QuantizationSimModel(model, **options)
    return _aimet_on_qnn_grid()(sim) if grid == "qnn" else sim


def aimet_seq_mse(model: nn.Module, sim: Any, calibration: Sequence[Any], grid: str = "aimet") -> None:
    """AIMET's ``apply_seq_mse`` with its default parameters on ``calibration`` (all of it): sets the
    sim's weight encodings, which ``compute_encodings`` then leaves alone."""
    from aimet_torch.seq_mse import SeqMseParams, SequentialMse, apply_seq_mse

    # AIMET turns a candidate range into an encoding with a quantizer rebuilt from ``bitwidth``
    # (so [-8, 7]); on the qnn grid, one with the weight quantizer's own qmin/qmax
    own = (
        classmethod(_encoding_on_own_grid)
        if grid == "qnn"
        else SequentialMse.__dict__.get("compute_param_encodings")
    )
    with _patched(SequentialMse, "compute_param_encodings", own):
        apply_seq_mse(model, sim, list(calibration), SeqMseParams(num_batches=len(calibration)))


def aimet_calibrate(sim: Any, calibration: Sequence[Any]) -> None:
    """The sim's encodings from min-max statistics over ``calibration``."""

    def calibrate(m: nn.Module, _: Any = None) -> None:
        with torch.no_grad():
            for b in calibration:
                m(b)

    sim.compute_encodings(calibrate, None)


def _encoding_on_own_grid(cls: Any, quantizer: Any, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
    """AIMET's ``SequentialMse.compute_param_encodings`` keeping the quantizer's qmin/qmax."""
    from aimet_torch.quantization.affine import QuantizeDequantize

    qdq = QuantizeDequantize(quantizer.shape, qmin=quantizer.qmin, qmax=quantizer.qmax, symmetric=True)
    with qdq.compute_encodings():
        qdq(torch.stack([x_min, x_max]))
    quantizer.set_range(qdq.min, qdq.max)


def _strip_quantized_modules(module: nn.Module) -> None:
    """What AIMET's Adaround leaves quantized in the model it returns (it unwraps one level only:
    the sigmoid and multiply inside prepare_model's CustomSiLU stay wrapped, and a new
    QuantizationSimModel refuses "a model that already contains quantized modules")."""
    from aimet_torch.nn import BaseQuantizationMixin

    for name, child in module.named_children():
        if isinstance(child, BaseQuantizationMixin):
            child = child.get_original_module()
            setattr(module, name, child)
        _strip_quantized_modules(child)


class _patched:
    """``setattr`` for the duration of a ``with`` block."""

    def __init__(self, owner: Any, name: str, value: Any) -> None:
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self) -> None:
        self.saved = self.owner.__dict__.get(self.name)
        setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc: Any) -> None:
        if self.saved is None:  # inherited: uncover the base class's again
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.saved)


def _aimet_on_qnn_grid() -> Callable[[Any], Any]:
    """A function giving a QuantizationSimModel qnn_htp's 4-bit weight grid ``[-7, 7]``.

    AIMET reads ``bitwidth``/``signed`` of a weight quantizer (SeqMSE skips layers above 4 bits;
    Adaround asks both), which its quantizers define only on power-of-two grids: the replacement
    quantizers answer 4 and True.
    """
    from aimet_torch.quantization.affine import QuantizeDequantize

    class QnnWeightQuantizer(QuantizeDequantize):  # type: ignore[misc]
        @property
        def bitwidth(self) -> int:
            return 4

        @property
        def signed(self) -> bool:
            return True

    def restrict(sim: Any) -> Any:
        for _, module in sim.named_qmodules():
            weight = module.param_quantizers["weight"] if "weight" in module.param_quantizers else None
            if weight is not None:
                module.param_quantizers["weight"] = QnnWeightQuantizer(
                    weight.shape, qmin=-7, qmax=7, symmetric=True
                )
        return sim

    return restrict


def _aimet_per_channel_config() -> str:
    import json

    path = Path(tempfile.gettempdir()) / "quantplug_aimet_per_channel.json"
    config = {
        "defaults": {
            "ops": {"is_output_quantized": "True"},
            "params": {"is_quantized": "True", "is_symmetric": "True"},
            "strict_symmetric": "False",
            "unsigned_symmetric": "False",
            "per_channel_quantization": "True",
        },
        "params": {"bias": {"is_quantized": "False"}},
        "op_type": {},
        "supergroups": [],
        "model_input": {"is_input_quantized": "True"},
        "model_output": {},
    }
    path.write_text(json.dumps(config))
    return str(path)


def attempt(label: str, fn: Callable[[], float], rows: list[tuple[str, str]]) -> None:
    started = time.perf_counter()
    try:
        value = f"{fn():.2f}"
    except Exception as exc:
        traceback.print_exc()
        value = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    rows.append((label, f"{value} ({time.perf_counter() - started:.1f} s)"))
    print(f"  {label}: {rows[-1][1]}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.algorithms_weights_oracles")
    parser.add_argument("--models", nargs="+", default=["decoder", "digits"], choices=["decoder", "digits"])
    parser.add_argument("--tools", nargs="+", default=["nncf", "aimet"], choices=["nncf", "aimet"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    text = "# quantplug's weight algorithms against NNCF and AIMET (SQNR dB vs float, held-out batches)\n\n"
    text += (
        f"`python -m bench.algorithms_weights_oracles {' '.join(argv or [])}`".rstrip()
        + f" in its own venv (commands in the script's docstring), torch threads {args.threads}. "
        "NNCF 3.4 runs GPTQ only on OpenVINO models (its TorchFX backend refuses `gptq=True`). AIMET's "
        "quantsim v2 has no [-7,7] grid of its own: on qnn_htp's grid its weight quantizers are "
        "replaced (`aimet_run`). Times include each tool's first-call overheads; they are indicative "
        "only.\n"
    )
    tables = ""
    for name in args.models:
        model, batches = build(name)
        rows: list[tuple[str, str]] = []
        print(f"{name}:", flush=True)
        if "nncf" in args.tools:
            wo4 = {"preset": "weight_only_int4", "group_size": 32}
            for algs in ((), ("gptq",), ("seq_mse",), ("seq_mse", "gptq"), (GPTQ_SCALE_SEARCH,)):
                label = "quantplug reference wo_int4 g32 " + ("+".join(map(spec_label, algs)) or "default")
                attempt(label, partial(ours, model, batches, "reference", algs, **wo4), rows)
            for label, flags in (
                ("rtn", {}),
                ("scale_estimation", {"scale_estimation": True}),
                ("awq", {"awq": True}),
                ("awq+scale_estimation", {"awq": True, "scale_estimation": True}),
                ("gptq", {"gptq": True}),  # OpenVINO only in 3.4: recorded as the error it gives
            ):
                attempt(f"NNCF 3.4 INT4_SYM g32 {label}", partial(nncf_run, model, batches, **flags), rows)
        if "aimet" in args.tools:
            # the preset on ExecuTorch's grid: per-tensor linear weights, its moving-average observer
            preset = {"precision": "16a4w", "act_observer": "moving_average", "act_range_margin": 1.0}
            for algs in ((), ("seq_mse",), ("adaround",), ("seq_mse", "adaround")):
                label = "quantplug qnn_htp 16a4w " + ("+".join(algs) or "default")
                attempt(label, partial(ours, model, batches, "qnn_htp", algs, **preset), rows)
            side: dict[str, dict[str, str]] = {}
            for key, algs in AIMET_SIDE_BY_SIDE:
                label = f"quantplug qnn_htp 16a4w {AIMET_GRID_OPTIONS_LABEL} {key}"
                attempt(
                    label,
                    partial(ours, model, batches, "qnn_htp", algs, **{**preset, **AIMET_GRID_OPTIONS}),
                    rows,
                )
                side.setdefault(key, {})["quantplug"] = rows[-1][1]
            for grid, grid_label in (("qnn", "[-7,7] (qnn_htp's grid)"), ("aimet", "[-8,7] (AIMET's own)")):
                for alg in ("default", "seq_mse", "adaround"):
                    label = f"AIMET 2.42 W4 per-channel A16 {grid_label} {alg}"
                    attempt(label, partial(aimet_run, model, batches, alg, grid), rows)
                    side.setdefault(alg, {})[grid] = rows[-1][1]
            tables += (
                f"\n### {name}: the same algorithm on the same grid\n\n"
                f"quantplug `qnn_htp` 16a4w with {AIMET_GRID_OPTIONS_LABEL} (4-bit per-channel [-7,7] "
                "weights, 16-bit min-max activations) against AIMET 2.42 on that grid, and on its own "
                "[-8,7] grid:\n\n"
                "| algorithm | quantplug | AIMET [-7,7] | AIMET [-8,7] |\n|---|---|---|---|\n"
            )
            tables += "".join(
                f"| {key} | {v.get('quantplug', '-')} | {v.get('qnn', '-')} | {v.get('aimet', '-')} |\n"
                for key, v in side.items()
            )
        text += f"\n## {name}\n\n| run | SQNR (dB) (time) |\n|---|---|\n"
        text += "".join(f"| {label} | {value} |\n" for label, value in rows)
    text += tables
    out = RESULTS / "algorithms_weights_oracles.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
