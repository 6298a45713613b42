"""The ``quantplug`` command.

    quantplug backends [--json] [--check]      installed backends (--check imports them)
    quantplug algorithms [--json]              installed accuracy algorithms (from metadata)
    quantplug quantize [MODEL] [options]       quantize, lower, compare and report
    quantplug report OUT                       re-render OUT/report.html, print the summary
    quantplug conformance NAME                 run the backend conformance kit
    quantplug new-backend NAME                 write a backend distribution to start from
    quantplug metadata NAME [--check]          write (check) a backend's generated files
    quantplug                                  = quantplug quantize (the built-in demo)

Exit codes: 0 success, 2 bad input or usage (one line on stderr, the traceback with --verbose),
1 an unexpected internal error, 130 interrupted (SIGINT), 128 + N terminated by signal N.

Help, ``backends`` and every argument error answer without importing torch or any plugin (they
read package metadata); ``quantize`` imports them once its arguments are checked.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from _quantplug.cli import algorithms as algorithms_cli
from _quantplug.cli import mixed_precision as mixed_cli
from _quantplug.cli.algorithms import check_algorithm_arguments
from _quantplug.cli.checks import (
    COMMANDS,
    check_backend_options,
    check_calibration_path,
    check_model_spec,
    looks_like_model,
    unknown_command,
)
from _quantplug.cli.console import Console, silence_stdout, stdout_reader_gone
from _quantplug.cli.errors import InputError, Terminated
from _quantplug.peers.torch_export_save import saving
from _quantplug.plugins.api_version import PLUGIN_API_VERSION

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

DEFAULT_OUT = "quantplug-out"
DEFAULT_RANDOM_BATCHES = 8
DEFAULT_COMPARE_BATCHES = 4

RUNS_CODE = (
    "Loading a model runs code, as unpickling does: only load models you trust. A package.module:factory "
    "is imported and called. A .pt2 file is checked first and refused if it holds pickled data "
    "(--allow-pickle accepts it: then loading it may run any code) or names that are not plain "
    "identifiers (code torch would paste into the program it builds)."
)


# ------------------------------------------------------------------------------------------------
# quantplug backends
# ------------------------------------------------------------------------------------------------


def _summary_of(distribution: str | None) -> str | None:
    if not distribution:
        return None
    from importlib import metadata

    try:
        summary = metadata.distribution(distribution).metadata["Summary"]
    except (metadata.PackageNotFoundError, KeyError):
        return None
    return str(summary) if summary else None


def cmd_backends(args: argparse.Namespace, console: Console) -> int:
    import json

    from _quantplug.errors import QuantplugError
    from _quantplug.plugins.registry import list_backends, load_backend

    rows: list[dict[str, Any]] = []
    failed = False
    for entry in list_backends():
        row: dict[str, Any] = {
            "name": entry.name,
            "distribution": entry.distribution,
            "version": entry.version,
            "description": _summary_of(entry.distribution),
            "module": entry.module,
            "source": entry.source,
            "status": entry.status,
            "error": entry.error,
        }
        if entry.claimants:
            row["claimants"] = list(entry.claimants)
        if args.check and entry.status in ("available", "loaded", "error"):
            _quiet_torch(console)  # plugins import torch
            try:
                loaded = load_backend(entry.name)
            except QuantplugError as exc:
                failed = True
                row.update(status="error", error=str(exc))
            else:
                info = loaded.info
                row.update(
                    status="ok",
                    error=None,
                    description=info.description,
                    options=[
                        {
                            "name": o.name,
                            "type": getattr(o.type, "__name__", str(o.type)),
                            "default": o.default,
                            "choices": list(o.choices) if o.choices is not None else None,
                            "help": o.help,
                        }
                        for o in info.options
                    ],
                    presets=[p.name for p in info.presets],
                    extensions=list(loaded.extensions),
                )
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 1 if failed else EXIT_OK
    if not rows:
        print("no quantplug backends installed (pip install quantplug-reference)")
        return EXIT_OK
    name_w = max(4, *(len(r["name"]) for r in rows))
    dist_w = max(12, *(len(r["distribution"] or "in-process") for r in rows))
    ver_w = max(7, *(len(r["version"] or "-") for r in rows))
    print(f"{'NAME':<{name_w}}  {'DISTRIBUTION':<{dist_w}}  {'VERSION':<{ver_w}}  {'STATUS':<9}  DESCRIPTION")
    for r in rows:
        print(
            f"{r['name']:<{name_w}}  {(r['distribution'] or 'in-process'):<{dist_w}}  "
            f"{(r['version'] or '-'):<{ver_w}}  {r['status']:<9}  {r['description'] or ''}"
        )
        if r.get("error"):
            print(f"{'':<{name_w}}  error: {r['error']}")
        if r.get("claimants"):
            print(f"{'':<{name_w}}  claimed by: {', '.join(r['claimants'])}")
    if not args.check:
        console.detail("(status from package metadata only; --check imports each plugin)")
    return 1 if failed else EXIT_OK


# ------------------------------------------------------------------------------------------------
# quantplug quantize
# ------------------------------------------------------------------------------------------------


class _LoweringWithProgress:
    """The quantizer as ``lower()`` sees it, with each pass and the writer counted on a bar."""

    def __init__(self, quantizer: Any, bar: Any) -> None:
        from _quantplug.plugins.contract import LoweringPlan, NamedPass

        self._quantizer = quantizer
        plan = quantizer.lowering_plan()

        def counted(name: str, fn: Any) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                bar.step(name)
                result = fn(*a, **k)
                bar.advance(detail=name)
                return result

            return run

        self.plan = LoweringPlan(
            passes=tuple(NamedPass(p.name, counted(f"pass {p.name}", p.fn)) for p in plan.passes),
            writer=counted("writer", plan.writer) if plan.writer is not None else None,
            extra=plan.extra,
        )
        self.steps = len(plan.passes) + (1 if plan.writer is not None else 0)

    def lowering_plan(self) -> Any:
        return self.plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quantizer, name)


#: node notes of the re-export that describe quantplug's own passes, not the user's model: which
#: pass created a node from which (``from_node``) and the traced call (``torch_fn``). They were a
#: fifth of an unrolled LSTM's ``quantized.pt2`` (15.2 -> 11.8 MB); the model's own notes (module
#: path, stack trace into the user's code) stay.
_PASS_PROVENANCE = ("from_node", "torch_fn")


def _drop_pass_provenance(program: Any) -> None:
    for node in program.graph.nodes:
        for key in _PASS_PROVENANCE:
            node.meta.pop(key, None)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def check_quantize_arguments(args: argparse.Namespace) -> dict[str, str]:
    """Everything about ``quantize``'s arguments that can be checked without torch or a plugin.

    Returns the parsed ``--option`` pairs. A misspelt backend, option, preset or command, a
    value out of its declared range or a missing file fails here in a fraction of a second.
    """
    from _quantplug.cli.options import parse_pairs

    if args.random_batches < 1:
        raise InputError("--random-batches must be at least 1")
    if args.compare_batches < 1:
        raise InputError("--compare-batches must be at least 1")
    if args.nproc < 1:
        raise InputError("--nproc must be at least 1")
    pairs = parse_pairs(args.option)
    info = check_backend_options(args.backend, pairs)
    args.algorithms = check_algorithm_arguments(args)  # metadata only (issue 15)
    mixed_cli.check_arguments(
        args,
        pairs,
        info.preset_option if info is not None else None,
        [p.name for p in info.presets] if info is not None else None,
    )
    check_model_spec(args.model)
    check_calibration_path(args.calibration)
    return pairs


def cmd_quantize(args: argparse.Namespace, console: Console) -> int:
    from _quantplug.cli import distributed
    from _quantplug.cli.output import StagedOutput, storage_error

    pairs = check_quantize_arguments(args)
    if args.nproc > 1 and distributed.launched_world() is None:
        return distributed.launch(_without_nproc(args.argv), args.nproc, console)
    out_dir = Path(args.out)
    with distributed.joined_group() as group:  # None: one process
        if group is not None and not group.writer:
            _quantize_into(None, args, pairs, Console(quiet=True, verbose=console.verbose), group)
            return EXIT_OK
        with StagedOutput(out_dir) as stage:  # takes the lock: a second run on --out fails now
            try:
                data, debug = _quantize_into(stage, args, pairs, console, group)
                stage.commit()
            except Exception as exc:
                full = storage_error(exc, f"--out {str(out_dir)!r}")
                if full is None:
                    raise
                raise full from exc
    if not console.quiet:
        from _quantplug.report import format_summary

        print(format_summary(data, out_dir=str(out_dir)))
        if console.verbose:
            print(debug.format())
    return EXIT_OK


def _without_nproc(argv: Sequence[str]) -> list[str]:
    """The command line the launched processes run: the same, less ``--nproc``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


#: batches the algorithms' float-program transforms see (all of them below this count): held in
#: memory at once, unlike calibration's streamed batches
TRANSFORM_BATCHES = 128


def _guard_verdict(prepared: Any, on: bool, held_out: str | None, console: Any) -> str:
    """What the algorithm guard did at convert, for the report (and the console when it kept a
    default: the user asked for an algorithm that some layer does not get)."""
    from _quantplug.algorithms.guard import decibels
    from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY

    if not on:
        return "off (--no-algorithm-guard)"
    run = prepared.meta.get(RUN_KEY)
    guard = getattr(run, "guarded", None)
    undone = [
        f"{name} undone ({decibels(worse, better):+.2f} dB)"
        for name, worse, better in getattr(run, "undone", [])
    ]
    verdicts = [*undone, *([guard.summary()] if guard is not None else [])]
    on_what = f" (judged on held-out data {held_out})" if held_out else ""
    if not verdicts:
        return f"on{on_what} (nothing to judge)"
    if undone or (guard is not None and guard.kept_out):
        console.info("algorithm guard: " + "; ".join(verdicts))
    return f"on{on_what}: " + "; ".join(verdicts)


def _transform_batches(data: Any, group: Any) -> list[Any]:
    """The batches the algorithms' float-program transforms (SmoothQuant, CLE) see: the first
    :data:`TRANSFORM_BATCHES` of the whole data, read by rank 0 and sent to the others, so every
    rank transforms with the same batches (a factory shuffling without a seed reads other batches
    on every rank) and prepares the same program."""
    return [b for b, _ in _first_batches(data, TRANSFORM_BATCHES, group)]


def _first_batches(data: Any, count: int, group: Any) -> list[Any]:
    """The first ``count`` ``(batch, origin)`` pairs of ``data`` as rank 0 reads them, on every rank."""
    if group is None:
        return list(data.head(count))
    import torch.distributed as dist

    holder: list[Any] = [list(data.head(count)) if group.writer else None]
    dist.broadcast_object_list(holder, src=0)
    return list(holder[0])


def _held_out_batches(args: argparse.Namespace, model: Any, group: Any) -> list[Any] | None:
    """``--held-out``'s first batches (the guard judges on at most that many), read by rank 0
    and sent to the others, as :func:`_transform_batches`, so every rank judges alike."""
    from _quantplug.algorithms.guard import GUARD_BATCHES
    from _quantplug.cli.inputs import check_batches, open_calibration

    if args.held_out is None:
        return None
    data = open_calibration(args.held_out, model.inputs, "held-out data")
    head = _first_batches(data, GUARD_BATCHES, group)
    if not head:
        raise InputError(f"held-out data {args.held_out!r} holds no batches")
    batches, origins = [b for b, _ in head], [o for _, o in head]
    finite = args.nonfinite != "ignore"
    check_batches(batches, origins, model.inputs, model.program, finite=finite, what="held-out")
    return batches


def _calibration_data(args: argparse.Namespace, model: Any, warn: Any) -> tuple[Any, dict[str, Any]]:
    """The batches to calibrate on (read lazily) and the report's description of them."""
    from _quantplug.cli.inputs import CalibrationData, open_calibration, random_batches

    if args.calibration:
        return open_calibration(args.calibration, model.inputs), {"source": args.calibration, "random": False}
    if model.calibration is not None:
        demo = list(model.calibration)
        data = CalibrationData.of(demo, [f"demo batch {i}" for i in range(len(demo))], "built-in")
        return data, {"source": "built-in synthetic data", "random": False}
    batches = random_batches(model.program, args.random_batches)
    warn(
        f"no calibration data given (--calibration FILE.pt or FOLDER): calibrating on "
        f"{len(batches)} batches of RANDOM data shaped like the model's inputs; quantization "
        "ranges and the SQNR figures will not reflect real inputs"
    )
    data = CalibrationData.of(batches, [f"random batch {i}" for i in range(len(batches))], "random")
    return data, {"source": "random normal data", "random": True}


def _calibrate(
    prepared: Any, data: Any, model: Any, args: argparse.Namespace, console: Console, group: Any
) -> int:
    """Run this process's share of the batches through ``prepared``, each checked against the
    model's inputs first; merge the statistics of all ranks. Returns the batches over all ranks."""
    import torch

    from _quantplug.cli import distributed
    from _quantplug.cli.inputs import check_batches, nonfinite_input_error
    from _quantplug.distributed.sync import sync_observers
    from _quantplug.errors import NonFiniteError, QuantplugError

    rank, size = (group.rank, group.world_size) if group is not None else (0, 1)
    shared = distributed.SharedCount() if group is not None else None
    count = 0
    label = "calibrating" if group is None else f"calibrating ({size} processes)"
    with console.progress(label, data.total or 0, "batches", done_label="calibrated") as bar:
        with torch.no_grad():
            for i, (batch, origin) in enumerate(data.batches(rank, size)):
                index = i if data.shards_itself else rank + i * size
                where = origin if data.shards_itself or group is None else f"{origin}, rank {rank}"
                check_batches(
                    [batch],
                    [where],
                    model.inputs,
                    model.program,
                    finite=args.nonfinite != "ignore",
                    start=index,
                )
                try:
                    batch.run(prepared)
                except NonFiniteError as exc:
                    raise nonfinite_input_error(
                        exc, index, where, batch, model.inputs, model.program
                    ) from exc
                except QuantplugError:
                    raise
                except Exception as exc:
                    raise InputError(
                        f"calibration batch {index} ({where}) failed: {_first_line(exc)}"
                    ) from exc
                count += 1
                total = shared.add() if shared is not None else None
                bar.advance(1 if total is None else total - bar.count)
        if group is not None:
            import torch.distributed as dist

            sync_observers(prepared, timeout=distributed.SYNC_TIMEOUT)
            counts = torch.tensor([count], dtype=torch.int64)
            dist.all_reduce(counts)
            count = int(counts[0])
            bar.advance(count - bar.count)  # every rank's batches, all done now
    if count == 0:
        raise InputError(f"calibration data {data.source!r} holds no batches")
    return count


def _quantize_into(
    stage: Any, args: argparse.Namespace, pairs: dict[str, str], console: Console, group: Any = None
) -> Any:
    """The run itself: every file goes into ``stage.path``; returns the report data and comparison.

    In a group of processes (``--nproc``, torchrun) every rank calibrates its share; rank 0 alone
    (``stage`` given) goes on to convert, lower, compare and write; the others return None.
    """
    with signals_deferred():  # extension modules' initialisers cannot unwind a signal's exception
        import torch

        _quiet_torch(console)
        from _quantplug.algorithms.config import Algorithms
        from _quantplug.api import get_quantizer
        from _quantplug.cli.inputs import check_batches, load_model
        from _quantplug.cli.output import storage_cause
        from _quantplug.debug.compare import compare, tensor_bytes
        from _quantplug.flow.convert import convert
        from _quantplug.flow.prepare import prepare
        from _quantplug.lowering.lower import lower
        from _quantplug.meta import STATE_KEY
        from _quantplug.observers.nonfinite import ignored_counts, masked_counts
        from _quantplug.plugins.registry import load_backend
        from _quantplug.report import build_report, write_report

        quantizer = get_quantizer(args.backend, **pairs)  # imports the backend's plugin
        loaded = load_backend(args.backend)

    started = time.perf_counter()
    timings: dict[str, float] = {}
    run_warnings: list[str] = []

    def warn(message: str) -> None:
        run_warnings.append(message)
        console.warn(message)

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 3)
        return now

    backend = {
        "name": quantizer.backend,
        "distribution": loaded.entry.distribution,
        "version": loaded.entry.version,
        "description": loaded.info.description,
    }
    options = {**quantizer.options, "strict": quantizer.strict}
    if args.algorithms:  # shown with the options in the report (issue 15)
        options["algorithms"] = ", ".join(
            name + ("(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")
            for name, opts in args.algorithms
        )

    t = time.perf_counter()
    console.info("loading model: " + (args.model or "built-in demo"))
    model = load_model(args.model, allow_pickle=args.allow_pickle)
    program = model.program
    data, calibration = _calibration_data(args, model, warn)
    calibration["nonfinite"] = args.nonfinite
    first = data.head(1)  # a batch that does not fit the model fails now, before prepare
    check_batches(
        [b for b, _ in first], [o for _, o in first], model.inputs, program, finite=args.nonfinite != "ignore"
    )
    t = lap("load", t)

    mixed = None
    if args.mixed_presets is not None:
        from _quantplug.mixed_precision import weighted_layers

        # at most: each layer at each higher preset alone, then one greedy step per raise
        steps = 2 * len(weighted_layers(program)) * (len(args.mixed_presets) - 1)
        with console.progress("mixed precision search", steps, "measurements", done_label="searched") as bar:
            mixed = mixed_cli.choose(
                args,
                pairs,
                program,
                [b for b, _ in data.head(mixed_cli.SEARCH_BATCHES)],
                progress=lambda step: bar.advance(detail=step),
            )
        t = lap("mixed_precision", t)
    elif args.mixed_precision_file is not None:
        mixed = mixed_cli.choose(args, pairs, program, [])
    if mixed is not None:  # the run quantizes with the choice: its default preset plus overrides
        quantizer = mixed_cli.quantizer_for(mixed, pairs)
        options = {
            **quantizer.options,
            "strict": quantizer.strict,
            "mixed_precision": f"{len(mixed['overrides'])} layer override(s)",
            **({"algorithms": options["algorithms"]} if "algorithms" in options else {}),
        }
        if stage is not None:
            mixed_cli.write_choice(mixed, stage.path)

    algorithms = (  # --held-out and --no-algorithm-guard come only with --algorithm (checked)
        Algorithms(
            args.algorithms,
            calibration=_transform_batches(data, group),
            guard=args.algorithm_guard,
            held_out=_held_out_batches(args, model, group),
        )
        if args.algorithms
        else None
    )
    prepared = prepare(program, quantizer, nonfinite=args.nonfinite, algorithms=algorithms)
    if group is not None and args.algorithms:
        from _quantplug.algorithms.merge import check_mergeable

        check_mergeable(prepared)  # an algorithm whose statistics cannot merge: refused before calibrating
    t = lap("prepare", t)
    calibration["batches"] = _calibrate(prepared, data, model, args, console, group)
    if group is not None:
        calibration["processes"] = group.world_size
        if not group.writer:
            return None
    masked = masked_counts(prepared)
    if masked:  # infinities the model computes (attention masks), left out of the statistics
        calibration["infinities_masked"] = masked
    ignored = ignored_counts(prepared)
    if ignored:
        calibration["nonfinite_ignored"] = ignored
        shown = ", ".join(f"{where}: {n}" for where, n in list(ignored.items())[:3])
        more = f" and {len(ignored) - 3} more" if len(ignored) > 3 else ""
        warn(
            f"--nonfinite ignore: {sum(ignored.values())} NaN/inf value(s) left out of the calibration "
            f"statistics ({shown}{more})"
        )
    t = lap("calibrate", t)
    if args.algorithms:  # minutes on an LLM: a bar over the layers the algorithms choose, with its ETA
        from _quantplug.algorithms.progress import layer_progress

        with console.progress("algorithms", 0, "layers", done_label="weights chosen") as bar:

            def advance(done: int, layers: int, label: str, left: float | None) -> None:
                bar.total = layers
                bar.advance(detail=label)

            with layer_progress(advance):
                quantized = convert(prepared)
    else:
        quantized = convert(prepared)
    t = lap("convert", t)
    if args.algorithms:
        options["algorithm_guard"] = _guard_verdict(prepared, args.algorithm_guard, args.held_out, console)

    artifact = None  # measured beside the program by compare() when the backend can run it
    bar = console.progress("lowering", 0, "steps", done_label="lowered")
    lowering_quantizer = _LoweringWithProgress(quantizer, bar)
    if lowering_quantizer.plan.writer is None:
        warn(
            f"backend {quantizer.backend!r} provides no artifact writer: no backend artifact written "
            "(the quantized program and the report are)"
        )
    else:
        bar.total = lowering_quantizer.steps + 1  # passes, the writer, saving the files
        with bar:
            artifact = lower(quantized, lowering_quantizer)
            for line in artifact.metadata.get("warnings", ()):  # the backend's findings
                warn(str(line))
            bar.step("saving")
            artifact.save(stage.path / "artifact")
            bar.advance(detail="saved")
    t = lap("lower", t)

    compare_inputs = [batch for batch, _ in data.head(args.compare_batches)]
    example = compare_inputs[0]
    try:
        exported = torch.export.export(quantized, example.args, dict(example.kwargs))
        _drop_pass_provenance(exported)
        with saving():  # torch's canonical-form check on a pickled copy: the same file, faster
            torch.export.save(exported, str(stage.path / "quantized.pt2"))
    except Exception as exc:
        if storage_cause(exc) is not None:
            raise  # a full disk stops the run (cmd_quantize names --out)
        warn(f"the quantized program could not be saved as quantized.pt2: {_first_line(exc)}")
    t = lap("save", t)

    with console.progress("comparing", len(compare_inputs), "batches", done_label="compared") as bar:
        debug = compare(
            program,
            quantized,
            compare_inputs,
            prepared=prepared,
            artifact=artifact,
            progress=lambda d, n: bar.advance(),
        )
    t = lap("compare", t)
    state = prepared.meta.get(STATE_KEY)
    timings["total"] = round(time.perf_counter() - started, 3)
    data = build_report(
        debug,
        backend=backend,
        options=options,
        model=model.describe(),
        calibration=calibration,
        float_bytes=tensor_bytes(program),
        quantized_bytes=tensor_bytes(quantized),
        validation=getattr(state, "validation", None),
        warnings=run_warnings,
        files=[
            *({"path": p, "bytes": n} for p, n in stage.files()),
            {"path": "report.html", "bytes": None},
            {"path": "report.json", "bytes": None},
        ],
        timings=timings,
        mixed_precision=mixed,
    )
    write_report(data, stage.path)
    return data, debug


# ------------------------------------------------------------------------------------------------
# quantplug report
# ------------------------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from _quantplug.files import refuse_planted_links, write_atomic
    from _quantplug.report import format_summary, load_report, render_html

    folder = Path(args.out)
    if not folder.is_dir():
        folder = folder.parent
    refuse_planted_links(folder / "report.html", repr(str(folder / "report.html")))
    data = load_report(args.out)
    try:
        page, summary = render_html(data), format_summary(data)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # a hand-edited report.json that load_report's checks let through: still the file's fault
        raise InputError(f"{folder / 'report.json'} cannot be rendered: {type(exc).__name__}: {exc}") from exc
    target = folder / "report.html"
    try:
        write_atomic(target, page)
    except OSError as exc:
        raise InputError(f"cannot write {target}: {exc.strerror or exc}") from exc
    if not console.quiet:
        print(summary)
        print(f"report:      {target}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# parser and entry point
# ------------------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, *, sub: bool) -> None:
    default: Any = argparse.SUPPRESS if sub else False
    p.add_argument("-q", "--quiet", action="store_true", default=default, help="only warnings and errors")
    p.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="more detail, and tracebacks on errors"
    )


def build_parser(*, backend_help: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantplug",
        description="Quantize PyTorch 2 programs for a hardware backend. "
        "Without a command: `quantplug quantize` on the built-in demo.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok, 2 bad input or usage, 1 internal error",
    )
    _add_common(parser, sub=False)
    parser.add_argument(
        "--version",
        action="version",
        version=f"quantplug {_version()} (plugin API {PLUGIN_API_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")

    p = sub.add_parser(
        "backends",
        help="list installed backends",
        description="List installed backends from package metadata (no plugin is imported unless --check).",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--check",
        action="store_true",
        help="import each plugin: its options, or its load error (exit 1 if any fails)",
    )
    _add_common(p, sub=True)
    p.set_defaults(func=cmd_backends)

    epilog = None
    if backend_help:
        from _quantplug.cli.options import backends_epilog

        epilog = (
            backends_epilog()
            + "\n\naccuracy algorithms (--algorithm NAME):\n"
            + algorithms_cli.algorithms_help()
        )
    p = sub.add_parser(
        "quantize",
        help="quantize a program (default: the built-in demo)",
        description="Prepare, calibrate, convert and lower a program for a backend, compare it with the "
        "float program node by node, and write OUT/quantized.pt2, OUT/artifact/, OUT/report.html "
        "and OUT/report.json.\n\n" + RUNS_CODE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog,
    )
    p.add_argument(
        "model",
        nargs="?",
        help="a torch.export.save()d program (.pt2), or package.module:factory returning "
        "(model, example_inputs), imported from the current folder first; omitted: the built-in demo "
        "model and data. Loading a model runs code: only load models you trust",
    )
    p.add_argument(
        "-c",
        "--calibration",
        metavar="PATH",
        help="a .pt file (torch.save of a tensor, a tuple of tensors, a dict of keyword inputs, or a "
        "list of them: one batch each) or a folder of .pt files; omitted: random data (with a warning)",
    )
    p.add_argument("-b", "--backend", default="reference", help="backend name (default: reference)")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option, repeatable; checked against the backend's declared options (listed below)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"output folder (default: {DEFAULT_OUT}), replaced as a whole when the run succeeds; "
        "files of yours in it are kept",
    )
    p.add_argument(
        "--nonfinite",
        choices=("error", "strict", "ignore"),
        default="error",
        help="NaN/inf values reaching an observer during calibration: 'error' (default) stops at the "
        "first batch holding a NaN, or an infinity in the inputs, naming the file, batch, input and "
        "node (infinities the model computes, attention masks, are left out of the statistics); "
        "'strict' stops at any NaN/inf; 'ignore' leaves them all out of the statistics and counts "
        "them in the report",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="calibrate on N local processes (torch.distributed through torch's launcher), each on "
        "every N-th batch; their statistics are merged and the first process writes --out. On "
        "several machines: run under `torchrun --nnodes ...` instead (see docs/distributed.md)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="load a .pt2 that holds pickled data (weights, constants, example inputs): unpickling runs "
        "any code the file contains; only for files you trust",
    )
    p.add_argument(
        "--random-batches",
        type=int,
        default=DEFAULT_RANDOM_BATCHES,
        metavar="N",
        help=f"random batches when no calibration data is given (default: {DEFAULT_RANDOM_BATCHES})",
    )
    p.add_argument(
        "--compare-batches",
        type=int,
        default=DEFAULT_COMPARE_BATCHES,
        metavar="N",
        help=f"calibration batches the numeric comparison runs (default: {DEFAULT_COMPARE_BATCHES})",
    )
    algorithms_cli.add_quantize_arguments(p)
    mixed_cli.add_quantize_arguments(p)
    _add_common(p, sub=True)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser(
        "report",
        help="re-render OUT/report.html from OUT/report.json and print its summary",
        description="Re-render report.html from report.json (written by `quantplug quantize --out OUT`) "
        "and print a text summary.",
    )
    p.add_argument("out", nargs="?", default=DEFAULT_OUT, help=f"the output folder (default: {DEFAULT_OUT})")
    _add_common(p, sub=True)
    p.set_defaults(func=cmd_report)

    from _quantplug.cli import conformance, metadata, scaffold  # backend authors' (no torch at import)

    conformance.add_parser(sub, _add_common)
    scaffold.add_parser(sub, _add_common)
    metadata.add_parser(sub, _add_common)
    algorithms_cli.add_parser(sub, _add_common)
    return parser


def _error_line(exc: BaseException) -> str:
    from _quantplug.errors import ConstraintViolationError

    if isinstance(exc, ConstraintViolationError):
        violations = exc.report.violations
        first = violations[0].format() if violations else ""
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        return (
            f"{len(violations)} backend constraint violation(s): {first}{more}; "
            "pass --option strict=false to only warn"
        )
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] + (" (more with --verbose)" if len(lines) > 1 else "")


def _configure_logging(console: Console) -> None:
    handler = logging.StreamHandler(console.stream)
    handler.setFormatter(
        logging.Formatter("%(levelname)s: %(message)s" if console.verbose else "warning: %(message)s")
    )
    logger = logging.getLogger("quantplug")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG if console.verbose else logging.WARNING)


def _quiet_torch(console: Console) -> None:
    """Without --verbose, silence torch's own chatter (warnings and WARNING log records, e.g. the
    ONNX exporter's registry): noise for CLI users. Called once torch is imported (it configures
    its loggers on import)."""
    if console.verbose:
        return
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


#: signals received inside ``signals_deferred`` (None outside it)
_deferred: list[int] | None = None


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Signals arriving inside are raised when it ends, not where they land.

    Importing torch (or a plugin's extension modules) runs Python code from inside C++ module
    initialisers; an exception raised there by a signal handler cannot unwind through them and
    aborts the process ("terminate called after throwing an instance of
    'pybind11::error_already_set'"), skipping the cleanup of the staged output.
    """
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield
    finally:
        pending, _deferred = _deferred, outer
    if pending and outer is not None:
        outer.extend(pending)  # still inside an outer deferral: raised when that one ends
    elif pending:
        _raise_for(pending[0])


@contextmanager
def _signals_as_exceptions(received: list[int]) -> Iterator[None]:
    """While the command runs, SIGTERM and SIGHUP raise :class:`Terminated` (by default they kill
    the process at once, leaving the staging folder behind) and SIGINT raises KeyboardInterrupt;
    each signal is also recorded in ``received``, because the code it interrupts (an exporter, say)
    may turn the exception into another error. The previous handlers are restored afterwards."""

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        if _deferred is not None:
            _deferred.append(signum)
            return
        _raise_for(signum)

    previous = {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            previous[signum] = signal.signal(signum, on_signal)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _route(argv: list[str]) -> tuple[str | None, list[str]]:
    """The command and the argument list argparse sees (``quantplug [options]`` = ``quantize``)."""
    top_level = {"-q", "--quiet", "-v", "--verbose", "-h", "--help"}
    first = next((a for a in argv if a not in top_level), None)
    wants_help = any(a in ("-h", "--help") for a in argv)
    if first in COMMANDS:
        return first, argv
    if first is None and wants_help:
        return None, argv  # `quantplug --help`: the top-level help
    if first == "--version":
        return None, argv
    if first is not None and not first.startswith("-") and not looks_like_model(first):
        raise unknown_command(first)  # `quantplug backend` is a misspelt command, not a model path
    return "quantize", ["quantize", *argv]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``quantplug`` command; its exit code. ``argv`` None: the program's own arguments, and a
    process that ran as a rank of ``--nproc``/torchrun ends here (:func:`_end_rank_process`)."""
    from _quantplug.cli import distributed

    code = _main(sys.argv[1:] if argv is None else argv)
    if argv is None and distributed.left_launched_group():
        _end_rank_process(code)
    return code


def _end_rank_process(code: int) -> NoReturn:
    """End a rank's process with ``code``, without the interpreter's finalisation.

    A gloo group's C++ threads can still hold tensors when the interpreter tears itself down, and
    the process then aborts ("terminate called without an active exception", exit -6) after a run
    that succeeded, even with the group destroyed; the launcher then stops every other rank (seen on
    CI: rank 1 exiting while rank 0 lowered). The run's work is done and written by then, so only
    what finalisation adds is skipped: Python's exit handlers (the user's, logging's) still run and
    the output streams are flushed.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to write
                pass
        os._exit(code)


def _main(argv: Sequence[str]) -> int:
    argv = list(argv)
    try:
        command, argv = _route(argv)
    except InputError as exc:
        Console().error(str(exc))
        return EXIT_USAGE
    wants_help = any(a in ("-h", "--help") for a in argv)
    parser = build_parser(backend_help=wants_help and command == "quantize")
    args = parser.parse_args(argv)
    args.argv = argv  # what processes started by --nproc run again
    console = Console(
        quiet=bool(getattr(args, "quiet", False)), verbose=bool(getattr(args, "verbose", False))
    )
    _configure_logging(console)

    from _quantplug.errors import QuantplugError

    received: list[int] = []
    try:
        with _signals_as_exceptions(received):
            return int(args.func(args, console))
    except BaseException as exc:
        if isinstance(exc, Terminated) and not received:  # --nproc's launcher: torch's agent caught it
            received.append(exc.signum)
        if received:  # whatever the interrupted code made of the signal
            signum = received[0]
            console.error("interrupted" if signum == signal.SIGINT else f"terminated by signal {signum}")
            return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum
        if isinstance(exc, BrokenPipeError) and stdout_reader_gone():
            silence_stdout()  # the reader (| head) took what it wanted: the command's work is done
            return EXIT_OK
        if isinstance(exc, (InputError, QuantplugError)):
            if console.verbose:
                traceback.print_exc(file=console.stream)
            console.error(_error_line(exc))
            return EXIT_USAGE
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            # no signal arrived (``received``), and no command of ours exits: code we ran (a
            # plugin's hook, a model's forward...) called sys.exit or raised KeyboardInterrupt;
            # ending with its status would report success for a run that did not complete
            from _quantplug.plugins.culprit import culprit, exit_call

            if console.verbose:
                traceback.print_exception(exc, file=console.stream)
            what = exit_call(exc) if isinstance(exc, SystemExit) else "KeyboardInterrupt"
            console.error(
                f"{what} from code quantplug ran ({culprit(exc)}): the command did not complete"
                + ("" if console.verbose else " (run with --verbose for the traceback)")
            )
            return EXIT_INTERNAL
        if not isinstance(exc, Exception):
            raise
        if console.verbose:
            traceback.print_exc(file=console.stream)
        console.error(
            f"internal error: {type(exc).__name__}: {_error_line(exc)}"
            + ("" if console.verbose else " (run with --verbose for the traceback)")
        )
        return EXIT_INTERNAL


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("quantplug")
    except metadata.PackageNotFoundError:
        return "unknown"


def run_module() -> NoReturn:
    """``python -m quantplug``: the command, without the working folder shadowing packages."""
    # `python -m` puts the working folder first on sys.path (the `quantplug` script does not): a
    # matplotlib.py or torch.py there must not shadow the real ones. The factory import gets the
    # folder back for itself (_quantplug.cli.inputs).
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    sys.exit(main())


if __name__ == "__main__":
    run_module()
