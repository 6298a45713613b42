"""LLM scale on one CPU: transformers Llama configs, quantplug ``qnn_htp`` against ExecuTorch's
QnnQuantizer through torchao, in one run.

    python -m bench.scale                          # 20M and 110M, every flow (about 30 minutes here)
    python -m bench.scale --sizes 20m --flows qnn_htp-16a4w qnn_htp-16a4w+seq_mse
    nice -n 10 python -m bench.scale --sizes 270m 500m --flows qnn_htp-16a8w executorch-16a8w

Every (size, flow) runs in a fresh process (``--one``), so each peak RSS is that flow's alone:
the process's high-water mark (``VmHWM``) read after each phase and reset before the next
(``/proc/self/clear_refs``). Per flow: seconds and peak RSS of export, prepare, calibration
(``--batches`` batches of 64 random tokens, batch 1, under ``torch.no_grad()``), convert and,
for quantplug, lower + save (the ONNX artifact, whose size on disk is reported); the output SQNR
of the converted program against the float model on a batch not calibrated on. Ratios printed:
each algorithm's added prepare+calibrate+convert time over the default flow's (target: at most
2x at 110M for SeqMSE and GPTQ at 16a4w), quantplug's time over ExecuTorch's at the same
precision, and the peak RSS over the float weights' bytes (target: 1.5x plus a fixed overhead).

Flows: ``qnn_htp-<precision>[+algorithm[/unguarded]]`` (``quantplug.prepare(ep, get_quantizer("qnn_htp",
precision=...), algorithms=[...])``, then ``lower``; ``/unguarded``: ``Algorithms([...], guard=False)``,
as AIMET and NNCF run, for ``bench.scale_oracles``) and ``executorch-<16a8w|16a4w>``
(``prepare_pt2e(ep.module(), QnnQuantizer)`` / ``convert_pt2e``, ExecuTorch 1.5.1, SM8750,
``QNN_SDK_ROOT=""`` before it is built; ExecuTorch's own lowering needs the QNN SDK, absent here,
so its artifact is not measured). Results: ``bench/results/scale.md`` and ``scale.json``, with the
machine's load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"

#: Llama configs (untied embeddings but 1b's: the lm_head is a 4-bit layer of its own, as in the issue's runs)
CONFIGS: dict[str, dict[str, int]] = {
    "20m": dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2),
    "110m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                 num_attention_heads=12, num_key_value_heads=4),
    "270m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=4),
    "500m": dict(vocab_size=32000, hidden_size=1280, intermediate_size=3584, num_hidden_layers=22,
                 num_attention_heads=20, num_key_value_heads=4),
    # Llama 3.2 1B's shape (1.24B parameters), its embedding table tied to the logits as there
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}  # fmt: skip
FLOWS = (
    "qnn_htp-16a8w",
    "qnn_htp-16a4w",
    "qnn_htp-16a4w+seq_mse",
    "qnn_htp-16a4w+gptq",
    "qnn_htp-16a4w_block",
    "qnn_htp-16a4w_block+seq_mse",
    "qnn_htp-16a4w_block+gptq",
    "executorch-16a8w",
    "executorch-16a4w",
)
TOKENS = 64


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Phases:
    """Seconds and peak RSS (MiB, the process's, not growth) of each phase, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.peak_mib: dict[str, float] = {}

    def run(self, name: str, fn: Any) -> Any:
        import gc

        gc.collect()
        _reset_peak()
        start = time.perf_counter()
        out = fn()
        self.seconds[name] = time.perf_counter() - start
        self.peak_mib[name] = _kib("VmHWM") / 1024
        return out


def _model(size: str) -> tuple[Any, list[tuple[Any, ...]], Any]:
    import torch

    from tests.torchvision_compat import ensure_importable

    ensure_importable()
    import transformers

    from bench.algorithm_models import LogitsOnly

    torch.manual_seed(0)
    options = {"max_position_embeddings": 2 * TOKENS, "use_cache": False, "tie_word_embeddings": False}
    config = transformers.LlamaConfig(**{**options, **CONFIGS[size]})
    model = LogitsOnly(transformers.LlamaForCausalLM(config)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, config.vocab_size, (1, TOKENS), generator=g),) for _ in range(5)]
    return model, batches, config


def _calibrate(prepared: Any, batches: list[tuple[Any, ...]]) -> None:
    """Calibration as a user runs it: without autograd (outputs kept with their autograd graphs held
    every batch's saved tensors, +280 MiB at 110M, which is the bench's doing, not the flow's)."""
    import torch

    with torch.no_grad():
        for batch in batches:
            prepared(*batch)


def _sqnr(reference: Any, got: Any) -> float:
    import math

    ref, out = reference.double(), got.double()
    noise = float((ref - out).pow(2).sum())
    return float("inf") if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)


def _fixed_overhead_mib(backend: str) -> float:
    """RSS with every library the flow uses imported and nothing built: what no model size changes."""
    import torch  # noqa: F401

    from tests.torchvision_compat import ensure_importable

    ensure_importable()
    import transformers  # noqa: F401

    if backend == "qnn_htp":
        import onnx  # noqa: F401
        import onnx_ir  # noqa: F401
        import onnxscript  # noqa: F401

        import quantplug

        quantplug.get_quantizer("qnn_htp")  # the plugin
    return _kib("VmRSS") / 1024


def run_one(
    size: str, flow: str, batches_n: int, lowered: bool = True, release: bool = True
) -> dict[str, Any]:
    """One flow on one size, in this process: what :func:`main` runs in a fresh process each.

    With ``release`` (the default) a quantplug flow does what a script that owns its model can:
    it drops the float model and the exported program once prepared (the float reference output
    is computed before), and converts with ``release_float_weights=True``, so the prepared module
    holds the last references to the float weights and convert frees each as its integers are
    written. ``--keep-float`` keeps both through convert, as before (the flow's memory with a
    caller that keeps its model).
    """
    import torch

    fixed_mib = _fixed_overhead_mib(flow.partition("-")[0])
    model, batches, _ = _model(size)
    model_mib = _kib("VmRSS") / 1024
    calibration, held_out = batches[: max(1, min(batches_n, 4))], batches[-1]
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        reference = model(*held_out)
    phases = Phases()
    backend, _, rest = flow.partition("-")
    precision, _, algorithm = rest.partition("+")
    ep = phases.run("export", lambda: torch.export.export(model, calibration[0]))
    artifact_bytes = None
    artifact_files: dict[str, int] = {}
    if backend == "qnn_htp":
        import quantplug

        quantizer = quantplug.get_quantizer("qnn_htp", precision=precision)
        algorithm, _, mode = algorithm.partition("/")  # "/unguarded": every choice kept, all batches fit
        algorithms: Any = [algorithm] if algorithm else []
        if mode == "unguarded":
            algorithms = quantplug.Algorithms(algorithms, guard=False)
        prepared = phases.run("prepare", lambda: quantplug.prepare(ep, quantizer, algorithms=algorithms))
        if release:  # the prepared module's references to the float weights are the last ones
            del model, ep
        phases.run("calibrate", lambda: _calibrate(prepared, calibration))
        quantized = phases.run("convert", lambda: quantplug.convert(prepared, release_float_weights=release))
        del prepared  # consumed (release) or no longer needed
        with torch.no_grad():
            output = quantized(*held_out)

        def lower_and_save() -> dict[str, int]:
            with tempfile.TemporaryDirectory() as out:
                quantplug.lower(quantized, quantizer).save(out)
                return {p.name: p.stat().st_size for p in sorted(Path(out).rglob("*")) if p.is_file()}

        if lowered:
            artifact_files = phases.run("lower", lower_and_save)
            artifact_bytes = sum(artifact_files.values())
    else:
        os.environ["QNN_SDK_ROOT"] = ""  # before ExecuTorch's quantizer is built: no SDK download
        from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
        from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        quantizer = QnnQuantizer(soc_model=QcomChipset.SM8750)
        dtype = {"16a8w": QuantDtype.use_16a8w, "16a4w": QuantDtype.use_16a4w}[precision]
        quantizer.set_default_quant_config(dtype, is_conv_per_channel=True, is_linear_per_channel=False)
        prepared = phases.run("prepare", lambda: prepare_pt2e(ep.module(), quantizer))
        phases.run("calibrate", lambda: _calibrate(prepared, calibration))
        quantized = phases.run("convert", lambda: convert_pt2e(prepared))
        with torch.no_grad():
            output = quantized(*held_out)
    return {
        "size": size,
        "flow": flow,
        "params": params,
        "release_float_weights": release and backend == "qnn_htp",
        "weights_mib": weights_bytes / 2**20,
        "fixed_mib": fixed_mib,  # RSS with the libraries imported, before the model is built
        "model_mib": model_mib,  # RSS once the float model is built
        "seconds": phases.seconds,
        "peak_mib": phases.peak_mib,
        "artifact_mib": None if artifact_bytes is None else artifact_bytes / 2**20,
        "artifact_files": artifact_files,  # bytes of each file written
        "sqnr_db": _sqnr(reference, output),
        "reference_sum": float(reference.double().sum()),  # the same model in every flow (and venv)
    }


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}x"


def thread_env(threads: int | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a flow's fresh process: ``threads`` intra-op threads for torch (and its
    BLAS) when given. On a shared 2-core machine torch's default of one thread per core makes every
    parallel op wait for a descheduled worker: the 110M default flow's calibration took 4 s of CPU
    per batch at load 4 and 0.15 s on one thread, so ratios taken at the default move with the
    load; ``--threads 1`` on every flow of a run compares the same work."""
    env = dict(os.environ if env is None else env)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def threads_label(machine: dict[str, Any]) -> str:
    threads = machine.get("threads")
    return "torch's default threads" if threads is None else f"{threads} torch thread(s) per flow"


def render(results: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    lines = [
        "# LLM scale: quantplug qnn_htp vs ExecuTorch QnnQuantizer (`python -m bench.scale`)",
        "",
        f"Machine: {machine['nproc']} cores, {threads_label(machine)}, load average {machine['load_start']} "
        f"at the start, {machine['load_end']} at the end (shared: absolute times are inflated, ratios are "
        "from one run). "
        f"Llama configs with random weights, batch 1 x {TOKENS} tokens; each flow in a fresh process.",
        "",
        "| size | flow | params | export s | prepare s | calib s | convert s | p+c+c s | lower s "
        "| peak RSS MiB (max phase) | peak / weights | (peak - fixed) / weights | artifact MiB | SQNR dB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['flow']} | failed: {r['error']} |" + " |" * 11)
            continue
        s, peak = r["seconds"], max(r["peak_mib"].values())
        cells = [
            r["size"],
            r["flow"],
            f"{r['params'] / 1e6:.1f}M",
            *(f"{s[p]:.1f}" for p in ("export", "prepare", "calibrate", "convert")),
            f"{s['prepare'] + s['calibrate'] + s['convert']:.1f}",
            f"{s['lower']:.1f}" if "lower" in s else "-",
            f"{peak:.0f}",
            f"{peak / r['weights_mib']:.2f}x",
            f"{(peak - r['fixed_mib']) / r['weights_mib']:.2f}x" if "fixed_mib" in r else "-",
            "-" if r["artifact_mib"] is None else f"{r['artifact_mib']:.1f}",
            f"{r['sqnr_db']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "fixed = RSS with torch, transformers, onnx and the backend imported, before the model is built "
        "(what no model size changes); the memory target is (peak - fixed) / weights <= 1.5x.",
        "",
        (
            "quantplug flows drop the float model and the exported program once prepared and convert with "
            "`release_float_weights=True`: the prepared module's references to the float weights are the "
            "last, and convert frees each weight as its integers are written (`--keep-float` keeps them "
            "through convert: the memory of a caller that holds its model)."
            if any(r.get("release_float_weights") for r in results)
            else "quantplug flows kept the float model and the exported program through convert "
            "(`--keep-float`, or results from before `release_float_weights`)."
        ),
        "",
        "Peak RSS per phase, MiB (each phase's own high-water mark; the float model alone holds "
        "`model` - `fixed`):",
        "",
        "| size | flow | weights | fixed | model | export | prepare | calibrate | convert | lower+save |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r or "fixed_mib" not in r:
            continue
        p = r["peak_mib"]
        lines.append(
            f"| {r['size']} | {r['flow']} | {r['weights_mib']:.0f} | {r['fixed_mib']:.0f} | "
            f"{r['model_mib']:.0f} | "
            + " | ".join(
                f"{p[k]:.0f}" if k in p else "-"
                for k in ("export", "prepare", "calibrate", "convert", "lower")
            )
            + " |"
        )
    with_files = [r for r in results if r.get("artifact_files")]
    if with_files:
        lines += ["", "Artifact files, MiB:", ""]
        for r in with_files:
            files = ", ".join(f"`{name}` {size / 2**20:.2f}" for name, size in r["artifact_files"].items())
            lines.append(f"- {r['size']} {r['flow']}: {files}")
    lines += ["", "Ratios (same run):", ""]
    by = {(r["size"], r["flow"]): r for r in results if "error" not in r}

    def pcc(r: dict[str, Any]) -> float:
        return float(r["seconds"]["prepare"] + r["seconds"]["calibrate"] + r["seconds"]["convert"])

    for (size, flow), r in by.items():
        base_flow, _, algorithm = flow.partition("+")
        base = by.get((size, base_flow))
        if algorithm and base is not None:
            added = pcc(r) - pcc(base)
            lines.append(
                f"- {size} {flow}: adds {added:.1f} s to the default flow's prepare+calibrate+convert "
                f"({pcc(base):.1f} s): {_ratio(added, pcc(base))} (target <= 2x); "
                f"SQNR {r['sqnr_db'] - base['sqnr_db']:+.2f} dB"
            )
        if not algorithm and flow.startswith("qnn_htp-"):
            peer = by.get((size, "executorch-" + flow.split("-", 1)[1]))
            if peer is not None:
                lines.append(
                    f"- {size} {flow} vs ExecuTorch: prepare+calibrate+convert {_ratio(pcc(r), pcc(peer))}, "
                    f"peak RSS {_ratio(max(r['peak_mib'].values()), max(peer['peak_mib'].values()))}, "
                    f"SQNR {r['sqnr_db'] - peer['sqnr_db']:+.2f} dB"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["20m", "110m"], choices=sorted(CONFIGS))
    parser.add_argument("--flows", nargs="+", default=list(FLOWS), choices=FLOWS)
    parser.add_argument("--batches", type=int, default=4, help="calibration batches (at most 4)")
    parser.add_argument("--no-lower", action="store_true", help="stop at convert (the algorithms' ratios)")
    parser.add_argument(
        "--keep-float",
        action="store_true",
        help="quantplug flows keep the float model and program through convert (no release_float_weights)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads in every flow's process (default: torch's; see thread_env)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--name", default="scale", help="results file stem")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "FLOW"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(
            json.dumps(
                run_one(args.one[0], args.one[1], args.batches, not args.no_lower, not args.keep_float)
            )
        )
        return 0
    machine = {
        "nproc": os.cpu_count(),
        "threads": args.threads,
        "load_start": [round(x, 2) for x in os.getloadavg()],
    }
    results: list[dict[str, Any]] = []
    for size in args.sizes:
        for flow in args.flows:
            print(f"[scale] {size} {flow} ...", file=sys.stderr, flush=True)
            done = subprocess.run(
                [sys.executable, "-m", "bench.scale", "--one", size, flow, "--batches", str(args.batches)]
                + (["--no-lower"] if args.no_lower else [])
                + (["--keep-float"] if args.keep_float else []),
                capture_output=True,
                text=True,
                env=thread_env(args.threads),
            )
            try:
                result = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                result = {"size": size, "flow": flow, "error": f"exit {done.returncode}: {tail[:200]}"}
            print(f"[scale] {json.dumps(result)}", file=sys.stderr, flush=True)
            results.append(result)
    machine["load_end"] = [round(x, 2) for x in os.getloadavg()]
    text = render(results, machine)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}.json").write_text(
        json.dumps({"machine": machine, "results": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
