"""Lowering speed: ``quantplug.lower`` against torch's ONNX exporter on the same converted program.

    python -m bench.lowering                          # MLP 16/64/256 blocks, both backends: ~5 min
    python -m bench.lowering --blocks 16 64 --backends reference --no-peer
    python -m bench.lowering --profile 256            # + cProfile of lower() on the 256-block MLP

The model is an MLP of N blocks (``Linear(64, 64)`` + ReLU; four exported nodes per block: 256
blocks are the 1,026-node program of issue 12.10), exported once per size. For each backend
(``reference`` int8, ``qnn_htp`` 16a8w), in one process with ``--threads`` torch threads:

* prepare, one calibration batch, convert (``quantplug.prepare`` / ``quantplug.convert``) and
  ``lower`` (``quantplug.lower(converted, quantizer)``), ``--repeats`` times, each stage's minimum
  reported (the first lowering of a process also builds torch's ONNX registry: timed once, apart,
  before the runs: ``registry``);
* ``save``: ``artifact.save(dir)`` (for ``reference`` it serializes ``model.pt2``, which torch takes
  longer to do than quantplug to lower);
* the peer, the path lowering took before: ``torch.onnx.export(converted, args, dynamo=True,
  opset_version=21)`` (a torch.export re-trace, the exporter's decompositions and its optimizer),
  once per size (it is slow), skipped above ``--peer-max-blocks``, after all quantplug timings.

Reported: seconds per stage, ``lower/convert``, the garbage collector's seconds within ``lower``,
lowering ms per exported node (flat when lowering is linear) and ``peer/lower``. Results go to
``bench/results/lowering.md`` (also printed) and ``lowering.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import pstats
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import quantplug
from bench.run import machine_description

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
BACKENDS: dict[str, dict[str, Any]] = {"reference": {"preset": "int8"}, "qnn_htp": {"precision": "16a8w"}}


class MLP(nn.Module):
    def __init__(self, blocks: int, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    gc.collect()
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


class _GcClock:
    """Seconds Python's cyclic garbage collector runs while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
        """``fn(*args)`` (after a full collection, like :func:`_timed`), its seconds, and the
        collector's seconds within them."""
        gc.collect()
        self.seconds = 0.0
        gc.callbacks.append(self)
        try:
            start = time.perf_counter()
            out = fn(*args)
            seconds = time.perf_counter() - start
        finally:
            gc.callbacks.remove(self)
        return out, seconds, self.seconds


def registry_seconds() -> float:
    """Building torch's ONNX registry (torchlib's functions): once per process and opset."""
    from _quantplug.peers import onnx_translate

    onnx_translate._base_registry.cache_clear()
    onnx_translate._decomposition_table.cache_clear()
    with onnx_translate._quiet():
        _, seconds = _timed(
            lambda: (onnx_translate._base_registry(21), onnx_translate._decomposition_table(21))
        )
    return seconds


def peer_export(converted: Any, args: tuple[Any, ...]) -> float:
    """The old path: torch's dynamo exporter on the converted program (optimizer on)."""
    from _quantplug.lowering.onnx.export import translation_table
    from _quantplug.peers.onnx_translate import _quiet

    with _quiet():
        _, seconds = _timed(
            lambda: torch.onnx.export(
                converted,
                args,
                dynamo=True,
                opset_version=21,
                custom_translation_table=translation_table(),
                verbose=False,
            )
        )
    return seconds


def bench_one(
    blocks: int, backend: str, args: argparse.Namespace, log: Callable[[str], None]
) -> tuple[dict[str, Any], Callable[[], None]]:
    """The row of ``mlp-<blocks>`` lowered by ``backend``, and the peer's run, which fills the
    row's ``peer_s`` (run it after every quantplug timing: the exporter leaves the process
    heavier: later lowerings took a quarter longer)."""
    torch.manual_seed(0)
    model = MLP(blocks).eval()
    x = torch.randn(8, 64)
    program = torch.export.export(model, (x,))
    row: dict[str, Any] = {"model": f"mlp-{blocks}", "blocks": blocks, "backend": backend}
    row["nodes"] = len(program.graph.nodes)
    times: dict[str, list[float]] = {"prepare_s": [], "convert_s": [], "lower_s": [], "lower_gc_s": []}
    clock = _GcClock()
    for _ in range(args.repeats):  # each stage's minimum over repeats (background load hits all)
        quantizer = quantplug.get_quantizer(backend, **BACKENDS[backend])
        prepared, seconds = _timed(quantplug.prepare, program, quantizer)
        times["prepare_s"].append(seconds)
        with torch.no_grad():
            prepared(x)
        converted, seconds = _timed(quantplug.convert, prepared)
        times["convert_s"].append(seconds)
        artifact, seconds, collecting = clock.timed(quantplug.lower, converted, quantizer)
        times["lower_s"].append(seconds)
        times["lower_gc_s"].append(collecting)
    for key, values in times.items():
        row[key] = min(values)
        row[key.replace("_s", "_all_s")] = values
    fastest = times["lower_s"].index(row["lower_s"])
    row["lower_gc_s"] = times["lower_gc_s"][fastest]  # in the fastest lowering
    with tempfile.TemporaryDirectory() as tmp:
        _, row["save_s"] = _timed(artifact.save, tmp)
    import onnx

    row["onnx_nodes"] = len(onnx.load_from_string(artifact.files["model.onnx"]).graph.node)  # type: ignore[union-attr,arg-type]
    row["peer_s"] = None

    def run_peer() -> None:
        if not (args.peer and blocks <= args.peer_max_blocks):
            return
        try:
            row["peer_s"] = peer_export(converted, (x,))
        except Exception as exc:  # report, do not stop the bench
            row["peer_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log(f"  {row['model']:>9} {backend:<9} peer {row.get('peer_s')}")

    if blocks in args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        quantplug.lower(converted, quantizer)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        path = args.out / f"profile_lowering_{backend}_mlp-{blocks}.txt"
        path.write_text(text.getvalue())
        log(f"  profile -> {path}")
    log(
        f"  {row['model']:>9} {backend:<9} nodes {row['nodes']:5d}  prepare {row['prepare_s']:.3f}s  "
        f"convert {row['convert_s']:.3f}s  lower {row['lower_s']:.3f}s  save {row['save_s']:.3f}s"
    )
    return row, run_peer


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.1f}x"


def _load(values: Any) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def render(
    rows: list[dict[str, Any]], machine: dict[str, Any], registry: float, args: argparse.Namespace
) -> str:
    lines = [
        "# Lowering: quantplug.lower vs torch.onnx.export(dynamo=True) of the converted program",
        "",
        f"`python -m bench.lowering {' '.join(args.argv)}`".replace(" `", "`"),
        "",
        f"{machine['date']}, {machine['cpu_model']}, {machine['nproc']} cores, "
        f"torch {machine['versions']['torch']}, {args.threads} torch thread(s), load average "
        f"{_load(machine['load_average_start'])} at start, {_load(machine['load_average_end'])} at the end.",
        "",
        f"Building torch's ONNX registry, once per process (in the first lowering): {registry:.2f} s.",
        "",
        "| model | exported nodes | backend | prepare s | convert s | **lower s** | **lower/convert** "
        "| of which GC s | lower ms/node | save s | peer s | peer/lower | ONNX nodes |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peer = "-" if r["peer_s"] is None else f"{r['peer_s']:.2f}"
        if r.get("peer_error"):
            peer = f"failed ({r['peer_error'][:60]})"
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['backend']} | {r['prepare_s']:.3f} | {r['convert_s']:.3f} | "
            f"**{r['lower_s']:.3f}** | **{_ratio(r['lower_s'], r['convert_s'])}** | {r['lower_gc_s']:.3f} | "
            f"{1000 * r['lower_s'] / r['nodes']:.2f} | {r['save_s']:.3f} | {peer} | "
            f"{_ratio(r['peer_s'], r['lower_s'])} | {r['onnx_nodes']} |"
        )
    lines += [
        "",
        "Stage times are minima over repeats; `lower` runs after the registry is built; `save` writes "
        "the artifact (`reference`: model.onnx, encodings.json and model.pt2, whose serialization by "
        "torch dominates). `lower` holds Python's cyclic garbage collector and collects the garbage it "
        "made before it returns: that collection is in its time (the GC column); prepare and convert "
        "run with the collector as the process has it. "
        "The peer is the path `lower` took before (issue 12.10): torch.export re-trace + the dynamo "
        "exporter's decompositions + onnxscript's optimizer.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip torch.onnx.export")
    parser.add_argument("--peer-max-blocks", type=int, default=256)
    parser.add_argument(
        "--profile", type=int, nargs="*", default=[], help="block counts to profile lower() at"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    args.out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    machine = machine_description()
    registry = registry_seconds()
    runs = [bench_one(blocks, backend, args, print) for blocks in args.blocks for backend in args.backends]
    for _, run_peer in runs:
        run_peer()
    rows = [row for row, _ in runs]
    machine["load_average_end"] = __import__("os").getloadavg()
    text = render(rows, machine, registry, args)
    print(text)
    (args.out / "lowering.md").write_text(text)
    (args.out / "lowering.json").write_text(
        json.dumps({"machine": machine, "registry_s": registry, "rows": rows, "argv": args.argv}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
