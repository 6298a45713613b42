"""Calibration on 1 and 2 processes (torch.distributed, gloo): speed-up, sync cost, memory.

    .venv/bin/python -m bench.distributed            # about 3 minutes on 2 idle cores

* **speed**: decoder-32 (bench/models.py) prepared with the ``reference`` backend, calibrated on
  ``--batches`` (256) token batches, by one process and by two (each ``shard()``-ing the
  batches, one torch thread each), then ``sync_observers``. For each observer kind: one process's
  calibration time, two processes' (the slower rank) plus the sync, the speed-up, and the sync's
  share. The sync is timed after a barrier, so it does not include waiting for the slower rank.
* **memory**: a small conv model fed streamed calibration data (``_quantplug.cli.inputs``: a
  single .pt file of N batches of 1x3x128x128 floats, 192 KiB each, and a folder of N files)
  for N = 256, 1024, 2048: each process's peak RSS. Streaming keeps it flat; holding the data
  would add N x 192 KiB (400 MiB at 2048).

Results go to ``bench/results/distributed.md`` and ``.json`` with the load average before and
after (the machine is shared: compare runs taken at a low load).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OBSERVERS = ("minmax", "histogram")
SIZES = (256, 1024, 2048)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(world: int, worker_args: list[str], out: Path) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
    }
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.distributed",
                "--worker",
                *worker_args,
                "--result",
                str(out / f"{r}.json"),
            ],
            cwd=ROOT,
            env={**env, "RANK": str(r)},
        )
        for r in range(world)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"a worker failed ({worker_args})")
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- workers


def _speed_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import quantplug
    from _quantplug.meta import observer_children
    from bench.models import build
    from quantplug.distributed import shard, sync_observers

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo")
    model, batch = build("decoder-32")
    program = torch.export.export(model, batch(0))
    found: dict[str, Any] = {}
    for observer in OBSERVERS:
        quantizer = quantplug.get_quantizer("reference", activation_observer=observer)
        prepared = quantplug.prepare(program, quantizer)
        with torch.no_grad():
            prepared(*batch(10**6))  # warm-up, not part of the data: first-call costs
            for _, obs in observer_children(prepared):  # forget it again
                for name, buf in obs.named_buffers():
                    if name.endswith(("min_val",)):
                        buf.fill_(float("inf"))
                    elif name.endswith("max_val"):
                        buf.fill_(float("-inf"))
                    elif name.endswith(("num_batches", "histogram")):
                        buf.zero_()
            start, cpu_start = time.perf_counter(), time.process_time()
            count = 0
            for i in shard(range(args.batches)):
                prepared(*batch(i))
                count += 1
            calibrate = time.perf_counter() - start
            cpu = time.process_time() - cpu_start
        sync = 0.0
        state_bytes = 0
        if world > 1:
            dist.barrier()
            result = sync_observers(prepared)
            sync, state_bytes = result.seconds, result.state_bytes
        scales = [float(s.reshape(-1)[0]) for s, _ in (o.calculate_qparams() for o in _observed(prepared))]
        found[observer] = {
            "calibrate_s": calibrate,
            "calibrate_cpu_s": cpu,
            "sync_s": sync,
            "batches": count,
            "bytes": state_bytes,
            "scales": scales,
        }
    if world > 1:
        dist.destroy_process_group()
    return found


def _observed(prepared: Any) -> list[Any]:
    from _quantplug.distributed.sync import named_observers

    return [o for _, o in named_observers(prepared) if getattr(o, "observed", False) and o.needs_data]


def _memory_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import quantplug
    from _quantplug.cli.inputs import input_specs, open_calibration

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world > 1:
        dist.init_process_group("gloo")
    program = torch.export.export(_conv_model(), (torch.randn(1, 3, 128, 128),))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference", activation_observer="minmax"))
    before = _memory()
    peak_anon = [before["RssAnon"]]
    done = threading.Event()

    def sample() -> None:  # anonymous memory's peak: the kernel keeps none
        while not done.wait(0.005):
            peak_anon[0] = max(peak_anon[0], _memory()["RssAnon"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    data = open_calibration(args.data, input_specs(program))
    count = 0
    with torch.no_grad():
        for call, _ in data.batches(rank, world):
            call.run(prepared)
            count += 1
    if world > 1:
        from quantplug.distributed import sync_observers

        sync_observers(prepared)
        dist.destroy_process_group()
    done.set()
    sampler.join()
    after = _memory()
    return {
        "batches": count,
        "hwm_mib": after["VmHWM"] / 1024,
        "anon_before_mib": before["RssAnon"] / 1024,
        "anon_peak_mib": max(peak_anon[0], after["RssAnon"]) / 1024,
    }


def _memory() -> dict[str, int]:
    """VmHWM (peak RSS, file-backed pages included; reset at exec, unlike ru_maxrss, which keeps
    the launching process's) and RssAnon (memory not backed by a file), in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) for k in ("VmHWM", "RssAnon")}


def _conv_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    ).eval()


# ----------------------------------------------------------------------------- driver


def _write_data(root: Path, n: int) -> tuple[Path, Path]:
    import torch

    g = torch.Generator().manual_seed(n)
    single = root / f"stack{n}.pt"
    folder = root / f"folder{n}"
    folder.mkdir()
    batches = [torch.randn(1, 3, 128, 128, generator=g) for _ in range(n)]
    torch.save(batches, single)
    for i, b in enumerate(batches):
        torch.save(b, folder / f"{i:05d}.pt")
    return single, folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=256)
    parser.add_argument("--worker", choices=("speed", "memory"))
    parser.add_argument("--data")
    parser.add_argument("--result")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        result = _speed_worker(args) if args.worker == "speed" else _memory_worker(args)
        Path(args.result).write_text(json.dumps(result))
        return 0

    load_before = os.getloadavg()
    rows: dict[str, Any] = {"command": "python -m bench.distributed " + " ".join(argv or sys.argv[1:])}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        speed = {
            w: _spawn(w, ["speed", "--batches", str(args.batches)], _mkdir(root / f"speed{w}"))
            for w in (1, 2)
        }
        rows["speed"] = speed
        memory: dict[str, Any] = {}
        if not args.skip_memory:
            for n in SIZES:
                single, folder = _write_data(root, n)
                for kind, path in (("file", single), ("folder", folder)):
                    for w in (1, 2):
                        memory[f"{kind}-{n}-{w}"] = _spawn(
                            w, ["memory", "--data", str(path)], _mkdir(root / f"m{kind}{n}{w}")
                        )
        rows["memory"] = memory
    rows["load_before"] = load_before
    rows["load_after"] = os.getloadavg()
    rows["cores"] = os.cpu_count()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distributed.json").write_text(json.dumps(rows, indent=1))
    text = _markdown(rows, args)
    (out / "distributed.md").write_text(text)
    print(text)
    return 0


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _markdown(rows: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Calibration on 1 and 2 processes (torch.distributed, gloo)",
        "",
        f"Command: `{rows['command'].strip()}` (from the repository root). {rows['cores']} cores; "
        f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in rows['load_before'])}, "
        f"after {tuple(round(x, 2) for x in rows['load_after'])}.",
        "",
        f"decoder-32, reference backend, {args.batches} batches of 1x64 tokens, one torch thread per "
        "process. Wall times need two idle cores; CPU times (each process's own) show the split of the "
        "work whatever else runs: `cpu speed-up` = one process's CPU time / the busier rank's.",
        "",
        "| observer | 1 process calib (s) | 2 processes calib, slower rank (s) | sync (s) | speed-up "
        "| cpu speed-up | sync / calib | state sent per rank | qparams equal to 1 process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for observer in OBSERVERS:
        one = rows["speed"][1][0][observer]
        two = [r[observer] for r in rows["speed"][2]]
        calib2 = max(r["calibrate_s"] for r in two)
        cpu2 = max(r["calibrate_cpu_s"] for r in two)
        sync = max(r["sync_s"] for r in two)
        same = two[0]["scales"] == one["scales"]
        close = max(abs(a - b) / abs(b) for a, b in zip(two[0]["scales"], one["scales"]) if b)
        verdict = "exactly" if same else f"max rel. diff {close:.2e}"
        lines.append(
            f"| {observer} | {one['calibrate_s']:.2f} | {calib2:.2f} | {sync:.3f} | "
            f"{one['calibrate_s'] / (calib2 + sync):.2f}x | {one['calibrate_cpu_s'] / cpu2:.2f}x | "
            f"{100 * sync / calib2:.2f} % | {two[0]['bytes'] / 1024:.0f} KiB | {verdict} |"
        )
    if rows["memory"]:
        lines += [
            "",
            "Peak memory per process (MiB) calibrating a small conv model on streamed 1x3x128x128 "
            "batches (192 KiB each; holding them would take N x 0.19 MiB): `anon`, memory not backed "
            "by a file (sampled every 5 ms); `rss`, the kernel's peak resident set (VmHWM), which "
            "also counts the pages of the memory-mapped calibration file read so far (page cache the "
            "OS can drop at will).",
            "",
            "| data | batches | 1 process anon / rss | 2 processes anon / rss (each) |",
            "|---|---|---|---|",
        ]
        for key, result in rows["memory"].items():
            kind, n, w = key.split("-")
            if w != "1":
                continue
            two = rows["memory"][f"{kind}-{n}-2"]
            lines.append(
                f"| {kind} | {n} | {result[0]['anon_peak_mib']:.0f} / {result[0]['hwm_mib']:.0f} | "
                + ", ".join(f"{r['anon_peak_mib']:.0f} / {r['hwm_mib']:.0f}" for r in two)
                + " |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
