"""Should ``reference`` ship an ExecuTorch/XNNPACK ``.pte`` beside its ONNX model? (issue 45.1d)

    python -m bench.executorch_speed                      # a few minutes on 2 cores
    python -m bench.executorch_speed --models mlp --batches 1 --threads 1

For each model, batch size and thread count, in one process and on the same input:

* ``float``: eager PyTorch (``torch.inference_mode``);
* ``ort``: the ``reference`` backend's artifact (QDQ ONNX run by ONNX Runtime's int8 kernels);
* ``pte_fp32``: the float model lowered to XNNPACK and run by ExecuTorch's runtime;
* ``pte_int8``: the model quantized through ``quantplug.prepare``/``convert`` with ExecuTorch's
  ``XNNPACKQuantizer`` (int8 activations, int8 per-channel weights, float bias), exported with
  ``quantplug.backend.to_exported_program``, lowered to XNNPACK, run by ExecuTorch's runtime;
* ``reference -> XNNPACK``: whether the ``reference`` preset's own Q/DQ program (what a ``.pte``
  option of the backend would lower) loads in ExecuTorch's XNNPACK delegate at all.

Each timing is the fastest of ``--rounds`` block medians, the runtimes taken in turn. The table
goes to ``bench/results/executorch_speed.md`` (Markdown, also printed).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.reference_speed import MODELS, _quantize, _time_all

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "executorch_speed.md"


class _Pte:
    """A program lowered to XNNPACK, loaded in ExecuTorch's runtime (the program outlives its method)."""

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        # the quantized kernels' out variants, for Q/DQ nodes XNNPACK leaves outside
        import executorch.kernels.quantized  # noqa: F401
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime

        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        graph = edge.exported_program().graph_module.graph
        self.outside = sorted(
            {
                str(n.target).split(".")[-2]
                for n in graph.nodes
                if n.op == "call_function"
                and "delegate" not in str(n.target)
                and "getitem" not in str(n.target)
            }
        )
        self.program = Runtime.get().load_program(edge.to_executorch().buffer)
        self.method = self.program.load_method("forward")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.execute([x])[0]  # type: ignore[no-any-return]


def _xnnpack_int8(model: torch.nn.Module, shape: tuple[int, ...], calib: int) -> Any:
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    import quantplug
    from quantplug.backend import to_exported_program

    gen = torch.Generator().manual_seed(0)
    ep = torch.export.export(model, (torch.randn(shape, generator=gen),))
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = quantplug.prepare(ep, quantizer)
    with torch.no_grad():
        for _ in range(calib):
            prepared(torch.randn(shape, generator=gen))
    converted = quantplug.convert(prepared)
    return converted, _Pte(to_exported_program(converted))


def _reference_in_xnnpack(converted: Any) -> str:
    """Does the reference preset's own program load in XNNPACK? ``ok`` or ExecuTorch's refusal."""
    from quantplug.backend import to_exported_program

    try:
        pte = _Pte(to_exported_program(converted))
    except Exception as exc:  # the delegate's refusal is the measurement
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return f"loads; outside XNNPACK: {', '.join(pte.outside) or '-'}"


def _set_threads(threads: int) -> None:
    from executorch.extension.pybindings import portable_lib

    torch.set_num_threads(threads)
    portable_lib._unsafe_reset_threadpool(threads)


def bench_one(name: str, batch: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ctor, shape_of, _ = MODELS[name]
    torch.manual_seed(0)
    model = ctor().eval()
    shape = shape_of(batch)
    _, reference_program, artifact = _quantize(model, shape, "int8", args.calib_batches)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    feeds = {artifact.inputs[0].name: x.numpy()}
    rows = []
    for threads in args.threads:
        # ExecuTorch's thread pool is reset before any program is loaded: resetting it under a
        # loaded XNNPACK runtime aborts the process
        _set_threads(threads)
        reference_xnnpack = _reference_in_xnnpack(reference_program)
        int8_program, pte_int8 = _xnnpack_int8(model, shape, args.calib_batches)
        pte_fp32 = _Pte(torch.export.export(model, (torch.randn(shape),)))
        with torch.no_grad():
            expected_int8 = int8_program(x)
        session = artifact.session(threads=threads)

        def run_float() -> Any:
            with torch.inference_mode():
                return model(x)

        fns = {
            "float": run_float,
            "ort": lambda s=session: s.run(None, feeds),
            "pte_fp32": lambda p=pte_fp32: p(x),
            "pte_int8": lambda p=pte_int8: p(x),
        }
        times = _time_all(fns, args)
        rows.append(
            {
                "model": name,
                "batch": batch,
                "threads": threads,
                **{f"{k}_ms": v for k, v in times.items()},
                "int8_err": float((pte_int8(x) - expected_int8).abs().max()),
                "int8_outside": pte_int8.outside,
                "reference_xnnpack": reference_xnnpack,
            }
        )
        del fns, pte_int8, pte_fp32  # unloaded before the thread pool is reset
    return rows


def _format(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    import executorch
    import onnxruntime

    lines = [
        "# ExecuTorch/XNNPACK `.pte` against the `reference` ONNX artifact and float",
        "",
        f"`python -m bench.executorch_speed --rounds {args.rounds}` on {platform.machine()} "
        f"({os.cpu_count()} cores), {_dt.date.today().isoformat()}; torch {torch.__version__}, "
        f"ExecuTorch {getattr(executorch, '__version__', '1.5.1')}, ONNX Runtime {onnxruntime.__version__}. "
        "Milliseconds per call (fastest of the block medians); speed-up = float / runtime. "
        f"Load average at the end: {os.getloadavg()[0]:.1f} (on a loaded machine the 2-thread rows "
        "measure the load, not the runtimes: read the 1-thread rows).",
        "",
        "| model | batch | threads | float ms | reference ORT int8 ms (x) | XNNPACK fp32 .pte ms (x) "
        "| XNNPACK int8 .pte ms (x) | int8 .pte vs its Q/DQ program | left outside XNNPACK "
        "| reference preset's program in XNNPACK |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cell(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.2f} ({r['float_ms'] / r[key]:.2f}x)"

        lines.append(
            f"| {r['model']} | {r['batch']} | {r['threads']} | {r['float_ms']:.2f} | {cell('ort_ms')} "
            f"| {cell('pte_fp32_ms')} | {cell('pte_int8_ms')} | max abs {r['int8_err']:.2g} "
            f"| {', '.join(r['int8_outside']) or '-'} | {r['reference_xnnpack']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet"], choices=sorted(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", nargs="+", type=int, default=[2, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-reps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per timing block")
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = [row for name in args.models for batch in args.batches for row in bench_one(name, batch, args)]
    text = _format(rows, args)
    print(text)
    with tempfile.NamedTemporaryFile("w", dir=args.out.parent, delete=False, suffix=".md") as f:
        f.write(text)
    os.replace(f.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
