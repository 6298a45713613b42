"""One rank of a multi-process test (see launch.py): ``python -m tests.distributed.worker SCENARIO``."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import quantplug
from quantplug.distributed import ddp, shard, sync_observers


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.fc2 = nn.Linear(2 * width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(torch.cat([h * 1.5, torch.softmax(h, dim=-1)], dim=-1))


def batches(n: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # scales differ per batch, so the extremes come from different batches (and ranks)
    return [torch.randn(4, 16, generator=g) * (0.5 + (i * 7 % 5)) for i in range(n)]


def program(width: int = 32) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(Net(width).eval(), (torch.randn(4, 16),))


def qparams(prepared: nn.Module) -> dict[str, Any]:
    from _quantplug.distributed.sync import named_observers

    return {
        name: tuple(t.clone() for t in obs.calculate_qparams())
        for name, obs in named_observers(prepared)
        if getattr(obs, "observed", True)
    }


def digest(module: nn.Module) -> str:
    h = hashlib.sha256(module.code.encode())  # type: ignore[union-attr]
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(bytes(t.detach().contiguous().clone().untyped_storage()))
    return h.hexdigest()


#: (backend, options) of the calibrate scenario, by name
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "minmax": ("reference", {"activation_observer": "minmax"}),
    "moving_average": ("reference", {"activation_observer": "moving_average"}),
    "histogram": ("reference", {"activation_observer": "histogram"}),
    "qnn_htp_minmax": ("qnn_htp", {"act_observer": "minmax", "precision": "16a8w"}),
}


def calibrate(option: str, data: Any) -> nn.Module:
    backend, options = SETUPS[option]
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program(), quantizer)
    with torch.no_grad():
        for x in data:
            prepared(x)
    return prepared


def scenario_calibrate(rank: int) -> dict[str, Any]:
    """Every observer kind the reference backend offers, 2 ranks against 1 process."""
    found: dict[str, Any] = {}
    for option in SETUPS:
        prepared = calibrate(option, shard(batches()))
        result = sync_observers(prepared, timeout=60)
        found[option] = {
            "qparams": qparams(prepared),
            "digest": digest(quantplug.convert(prepared)),
            "merged": result.observers,
        }
        if rank == 0:
            single = calibrate(option, batches())
            found[option]["single"] = qparams(single)
            found[option]["single_digest"] = digest(quantplug.convert(single))
    return found


def scenario_mismatch(rank: int) -> dict[str, Any]:
    """Rank 1 prepares a wider model: every rank must get the same clear error."""
    quantizer = quantplug.get_quantizer("reference", activation_observer="minmax")
    prepared = quantplug.prepare(program(32 if rank == 0 else 48), quantizer)
    prepared(batches()[0])
    try:
        sync_observers(prepared, timeout=60)
    except quantplug.DistributedError as exc:
        return {"error": str(exc)}
    return {"error": None}


def scenario_missing(rank: int) -> dict[str, Any]:
    """Rank 1 never syncs (it leaves the group early): rank 0 gets an error naming it in time."""
    quantizer = quantplug.get_quantizer("reference", activation_observer="minmax")
    prepared = quantplug.prepare(program(), quantizer)
    prepared(batches()[0])
    if rank == 1:
        import time

        time.sleep(8)  # alive but never arriving, then gone
        return {"error": None}
    try:
        sync_observers(prepared, timeout=3)
    except quantplug.DistributedError as exc:
        return {"error": str(exc)}
    return {"error": None}


def scenario_qat(rank: int) -> dict[str, Any]:
    """QAT under DDP, observers synced once after training: with plain DDP, whose buffer broadcast
    replaces every rank's statistics with rank 0's before each forward, rank 1's widest batch
    (its first) is lost; with quantplug's wrapper every rank's statistics reach the sync."""
    g = torch.Generator().manual_seed(3)
    scales = [1.0, 8.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # the widest batch is rank 1's first
    data = [torch.randn(4, 16, generator=g) * s for s in scales]
    mine = list(shard(data))
    found: dict[str, Any] = {}
    for mode in ("plain", "quantplug"):
        torch.manual_seed(0)
        quantizer = quantplug.get_quantizer("reference", activation_observer="minmax")
        prepared = quantplug.prepare(program(), quantizer, qat=True)
        model = torch.nn.parallel.DistributedDataParallel(prepared) if mode == "plain" else ddp(prepared)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in mine:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        sync_observers(model, timeout=60)
        found[mode] = {"qparams": qparams(prepared), "digest": digest(quantplug.convert(prepared))}
    if rank == 0:
        # one process observing every batch (the input's observer sees the data, not the weights)
        quantizer = quantplug.get_quantizer("reference", activation_observer="minmax")
        single = quantplug.prepare(program(), quantizer, qat=True)
        for x in data:
            single(x)
        found["single_input"] = qparams(single)
    return found


class AlgoNet(nn.Module):
    """LayerNorm -> linear -> ReLU -> linear: every built-in algorithm has something to do
    (SmoothQuant folds into the norm, CLE equalizes the pair, the rest choose both weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def algo_batches(n: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        x = torch.randn(4, 6, 16, generator=g) * (0.5 + (i * 7 % 5))
        x[..., 3] *= 20  # an outlier channel (what SmoothQuant migrates)
        x[..., 8 + i % 4] *= 6  # channels active on one rank's share only (round robin)
        out.append(x)
    return out


def algo_program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(AlgoNet().eval(), (algo_batches(1)[0],))


class SampleRows(quantplug.Algorithm):
    """A third-party-style algorithm collecting a reservoir sample of each layer's input rows."""

    name = "sample_rows"

    def __init__(self) -> None:
        self.samples: dict[str, Any] = {}

    def collector(self, site: Any) -> Any:
        from _quantplug.algorithms.collectors import InputSample

        return InputSample(max_rows=20) if site.has_layer else None

    def choose_weight(self, site: Any, grid: Any, codes: Any, collected: Any) -> None:
        self.samples[site.name] = collected


class Unmergeable(quantplug.Algorithm):
    """An algorithm whose collector has no merge hook."""

    name = "unmergeable"

    class Count:
        def __init__(self) -> None:
            self.n = 0

        def update(self, x: torch.Tensor) -> None:
            self.n += 1
            if os.environ.get("QUANTPLUG_TEST_UNMERGEABLE"):  # tells the test calibration ran
                (Path(os.environ["QUANTPLUG_TEST_OUT"]) / f"fed-{os.getpid()}").touch()

        def result(self) -> int:
            return self.n

    def collector(self, site: Any) -> Any:
        return Unmergeable.Count() if site.has_layer else None


#: the built-in algorithms (and their collecting variants) the algorithms scenario runs
ALGORITHM_RUNS: dict[str, list[Any]] = {
    "cle": ["cle"],
    "smoothquant": [("smoothquant", {"alpha": 0.5})],
    "bias_correction": ["bias_correction"],
    "bias_correction_float": [("bias_correction", {"sequential": False})],
    "seq_mse": [("seq_mse", {"candidates": 8})],
    "seq_mse_sequential": [("seq_mse", {"candidates": 8, "sequential": True})],
    "adaround": [("adaround", {"iterations": 40})],
    "gptq": ["gptq"],
    "gptq_sequential": [("gptq", {"sequential": True})],
}


def _algo_prepare(
    algorithms: list[Any], data: list[torch.Tensor], guard: bool = True, held_out: Any = None
) -> nn.Module:
    quantizer = quantplug.get_quantizer("qnn_htp", act_observer="minmax", precision="16a4w")
    return quantplug.prepare(
        algo_program(),
        quantizer,
        algorithms=quantplug.Algorithms(algorithms, calibration=data, guard=guard, held_out=held_out),
    )


def collected(prepared: nn.Module) -> dict[str, Any]:
    """What the algorithms' collectors hold after calibration (and the batches stored for
    sequential layer inputs), by weight and algorithm index."""
    from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY

    run = prepared.meta[RUN_KEY]  # type: ignore[operator]
    found: dict[str, Any] = {
        f"{key[0]}#{i}": c.result() for key, by in run.collectors.items() for i, c in by.items()
    }
    found["stored batches"] = None if run.inputs is None else run.inputs.batches
    return found


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """Calibrate as one process does: the reference runs of this rank see every batch, so the
    position of each in the calibration is its count, not its place among round-robin shards
    (``_quantplug.algorithms.sequential.calibration_position``, which places the guard's held-out
    batches and the stored ones)."""
    from _quantplug.algorithms import sequential

    original = sequential.calibration_position
    sequential.calibration_position = lambda seen: seen
    try:
        yield
    finally:
        sequential.calibration_position = original


def scenario_algorithms(rank: int) -> dict[str, Any]:
    """Every built-in algorithm calibrated on 2 ranks against 1 process; a reservoir sample merged;
    a collector that cannot merge; transforms given other data on each rank."""
    data = algo_batches()
    found: dict[str, Any] = {}
    for label, algorithms in ALGORITHM_RUNS.items():
        prepared = _algo_prepare(algorithms, data)  # transforms: the same batches on every rank
        with torch.no_grad():
            for x in shard(data):
                prepared(x)
        sync_observers(prepared, timeout=60)
        found[label] = {"digest": digest(quantplug.convert(prepared)), "collected": collected(prepared)}
        if rank == 0:
            single = _algo_prepare(algorithms, data)
            with torch.no_grad(), one_process():
                for x in data:
                    single(x)
            found[label]["single_digest"] = digest(quantplug.convert(single))
            found[label]["single_collected"] = collected(single)
    sampler = SampleRows()
    prepared = _algo_prepare([sampler], data)
    with torch.no_grad():
        for x in shard(data):
            prepared(x)
    sync_observers(prepared, timeout=60)
    quantplug.convert(prepared)
    found["sample_rows"] = sampler.samples
    found["unmergeable"] = _sync_error(_algo_prepare([Unmergeable()], data), data[rank])
    found["held_out"] = _held_out_merge(rank, data)
    found["held_out_on_one_rank"] = _sync_error(
        _algo_prepare(["gptq"], data, held_out=data[:2] if rank == 0 else None), data[rank]
    )
    # transforms given each rank's share instead of the same batches (unguarded: the guard may
    # undo the transform on every rank, leaving the same program on each, with nothing to name)
    found["transform_data"] = _sync_error(
        _algo_prepare([("smoothquant", {"alpha": 0.5})], list(shard(data)), guard=False), data[rank]
    )
    return found


def _held_out_merge(rank: int, data: list[torch.Tensor]) -> dict[str, Any]:
    """Each rank prepared with its own held-out batches (rank r: batches r and r + 2): after the
    sync both judge on the merged ones (round robin: batches 0, 1, 2, 3), as one process given
    those does."""
    from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY

    prepared = _algo_prepare(["gptq"], data, held_out=data[rank::2][:2])
    with torch.no_grad():
        for x in shard(data):
            prepared(x)
    sync_observers(prepared, timeout=60)
    found: dict[str, Any] = {
        "batches": [b[0] for b in prepared.meta[RUN_KEY].held_out],  # type: ignore[operator]
        "digest": digest(quantplug.convert(prepared)),
    }
    if rank == 0:
        single = _algo_prepare(["gptq"], data, held_out=data[:4])
        with torch.no_grad():
            for x in data:
                single(x)
        found["single_digest"] = digest(quantplug.convert(single))
    same = _algo_prepare(["gptq"], data, held_out=data[:3])  # the same batches on every rank
    with torch.no_grad():
        for x in shard(data):
            same(x)
    sync_observers(same, timeout=60)
    found["same_batches"] = [b[0] for b in same.meta[RUN_KEY].held_out]  # type: ignore[operator]
    return found


def _sync_error(prepared: nn.Module, x: torch.Tensor) -> str | None:
    """The error sync_observers raises after one batch, as ``"Type: message"`` (None: none)."""
    prepared(x)
    try:
        sync_observers(prepared, timeout=60)
    except quantplug.QuantplugError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def scenario_all(rank: int) -> dict[str, Any]:
    """The scenarios that end well, in one group (each process start costs seconds)."""
    return {name: globals()[f"scenario_{name}"](rank) for name in ("calibrate", "qat", "mismatch")}


def cli_rank(rank: int) -> None:
    """Run the command line in ``QUANTPLUG_TEST_ARGV`` as a launcher-started rank would (the
    command joins the group itself); record its exit code and whether the group outlived it."""
    import json

    from _quantplug.cli.main import main as cli_main

    if os.environ.get("QUANTPLUG_TEST_UNMERGEABLE"):
        quantplug.register_algorithm("unmergeable", Unmergeable)
    code = cli_main(json.loads(os.environ["QUANTPLUG_TEST_ARGV"]))
    found = {"exit": code, "group_left_open": dist.is_initialized()}
    torch.save(found, Path(os.environ["QUANTPLUG_TEST_OUT"]) / f"rank{rank}.pt")


def main() -> None:
    scenario = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if scenario == "cli":
        cli_rank(rank)
        # end as `python -m quantplug` ends a rank process (``_end_rank_process``): gloo's threads can
        # abort the interpreter's finalisation after a run that succeeded, with the group destroyed
        # (seen on a loaded machine: rank 1 exited -6 with its result written)
        from _quantplug.cli.main import _end_rank_process

        _end_rank_process(0)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = globals()[f"scenario_{scenario}"](rank)
    finally:
        out = Path(os.environ["QUANTPLUG_TEST_OUT"])
    torch.save(result, out / f"rank{rank}.pt")
    if scenario != "missing":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
