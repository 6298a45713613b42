"""``--mixed-precision`` and ``--mixed-precision-file``: per-layer presets in ``quantplug quantize``.

``--mixed-precision 16a4w,16a8w --target-sqnr 30`` (or ``--weight-budget +25%``) runs the search of
:mod:`_quantplug.mixed_precision` on the first calibration batches before the run,
applies the choice it finds, and writes it to ``OUT/mixed_precision.json``: the per-layer
overrides, the target and every point the search measured, drawn as the trade-off curve in
``report.html``. The file is the user's to read and edit; ``--mixed-precision-file FILE`` applies
it again without searching (also under ``--nproc``, where every process must apply the same).

The arguments are checked here without torch; the search itself runs in ``choose``. An applied
file is read as untrusted input (a regular file, bounded, not too deep, finite numbers) and
checked before torch is imported: its backend, its ``preset_option`` (the backend's own: another
option would silently receive the presets) and its presets, against the backend's metadata.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _quantplug.cli.errors import InputError

#: calibration batches the search calibrates and measures every candidate on (the first ones)
SEARCH_BATCHES = 8
FILE_NAME = "mixed_precision.json"
#: the format the file declares (``_quantplug.algorithms.mixed_precision.FORMAT``, not imported
#: here: it imports torch)
FILE_FORMAT = "quantplug-mixed-precision/1"
#: the largest mixed_precision.json read (one entry per layer and per measured point)
FILE_LIMIT = 64 * 2**20

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
_UNITS |= {"kib": 1024, "mib": 1024**2, "gib": 1024**3}
_SIZE = re.compile(r"^\s*(?P<number>\d+(\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class Budget:
    """A weight budget: absolute bytes, or a growth over the all-cheapest model (0.25: +25 %)."""

    bytes: float | None = None
    growth: float | None = None


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mixed-precision",
        metavar="PRESET,PRESET[,...]",
        help="choose a preset per layer among these (e.g. 16a4w,16a8w): every conv/linear layer starts "
        "at the one with the fewest weight bits and the search raises the layers whose next preset "
        "buys the most output SQNR per weight byte, measuring every step on the first "
        f"{SEARCH_BATCHES} calibration batches; needs --target-sqnr or --weight-budget. The choice is "
        f"written to OUT/{FILE_NAME} and its accuracy-size curve to the report",
    )
    p.add_argument(
        "--target-sqnr",
        type=float,
        metavar="DB",
        help="with --mixed-precision: the smallest model whose output SQNR reaches DB",
    )
    p.add_argument(
        "--weight-budget",
        metavar="SIZE",
        help="with --mixed-precision: the most accurate model whose conv/linear/recurrent weights fit SIZE "
        "(those the backend leaves float counted at their size): bytes "
        "(1500000, 800KiB, 1.5MB) or growth over the all-cheapest model (+25%%)",
    )
    p.add_argument(
        "--mixed-precision-file",
        metavar="FILE",
        help=f"apply the per-layer presets of a {FILE_NAME} written by an earlier --mixed-precision run "
        "(edit it to taste) instead of searching",
    )


def parse_budget(text: str) -> Budget:
    """``+25%`` (growth), ``1500000``, ``800KiB``, ``1.5MB`` (bytes)."""
    raw = text.strip()
    if raw.endswith("%"):
        number = raw[:-1].lstrip("+").strip()
        try:
            growth = float(number) / 100
        except ValueError:
            growth = -1.0
        if not growth >= 0 or growth == float("inf"):
            raise InputError(f"--weight-budget {text!r}: a growth is a non-negative percentage, e.g. +25%")
        return Budget(growth=growth)
    found = _SIZE.match(raw)
    unit = found.group("unit").lower() if found else ""
    if found is None or unit not in _UNITS:
        raise InputError(
            f"--weight-budget {text!r} is not a size: give bytes (1500000), a size with a unit "
            "(800KiB, 1.5MB; units B, kB, MB, GB, KiB, MiB, GiB) or a growth over the all-cheapest "
            "model (+25%)"
        )
    value = float(found.group("number")) * _UNITS[unit]
    if value <= 0:
        raise InputError(f"--weight-budget {text!r} must be more than 0 bytes")
    return Budget(bytes=value)


def check_arguments(
    args: argparse.Namespace,
    pairs: Mapping[str, str],
    preset_option: str | None,
    presets: list[str] | None,
) -> None:
    """The mixed-precision arguments against each other and the backend's declared presets.

    ``preset_option`` and ``presets`` come from the backend's metadata (None: unknown before import,
    the search checks them then). Sets ``args.mixed_presets`` (a list) and ``args.mixed_budget``.
    """
    from _quantplug.suggest import did_you_mean

    wanted = getattr(args, "mixed_precision", None)
    target, budget = getattr(args, "target_sqnr", None), getattr(args, "weight_budget", None)
    applied = getattr(args, "mixed_precision_file", None)
    args.mixed_presets, args.mixed_budget = None, None
    if wanted is None:
        if target is not None or budget is not None:
            flag = "--target-sqnr" if target is not None else "--weight-budget"
            raise InputError(
                f"{flag} is the target of a mixed-precision search: add --mixed-precision PRESET,PRESET"
            )
        if applied is not None and preset_option and preset_option in pairs:
            raise InputError(
                f"--mixed-precision-file sets the presets (its 'default' and per-layer overrides): leave out "
                f"--option {preset_option}={pairs[preset_option]}, or edit the file"
            )
        if applied is not None:
            args.mixed_choice = read_choice(applied, args.backend, preset_option, presets)
        return
    if applied is not None:
        raise InputError(
            "--mixed-precision searches for a choice and --mixed-precision-file applies one: give one of them"
        )
    if (target is None) == (budget is None):
        raise InputError(
            "--mixed-precision needs exactly one target: --target-sqnr DB (the smallest model reaching "
            "it) or --weight-budget SIZE (the most accurate model within it)"
        )
    from _quantplug.cli.distributed import launched_world

    if getattr(args, "nproc", 1) > 1 or launched_world() is not None:  # --nproc, or under torchrun
        raise InputError(
            "--mixed-precision searches in one process: run it once without --nproc (or torchrun), "
            f"then pass --mixed-precision-file OUT/{FILE_NAME} to the multi-process run"
        )
    names = list(dict.fromkeys(p.strip() for p in str(wanted).split(",") if p.strip()))
    if len(names) < 2:
        raise InputError(
            f"--mixed-precision {wanted!r}: give at least two presets to choose from, comma-separated "
            "(e.g. 16a4w,16a8w)"
        )
    if presets is not None:
        for name in names:
            if name not in presets:
                raise InputError(
                    f"--mixed-precision: backend {args.backend!r} has no preset {name!r}"
                    f"{did_you_mean(name, presets)}; its presets: {', '.join(presets)}"
                )
    if preset_option and preset_option in pairs:
        raise InputError(
            f"--mixed-precision chooses the preset per layer: leave out --option {preset_option}="
            f"{pairs[preset_option]}"
        )
    if target is not None and not -1000 < target < 1000:
        raise InputError(f"--target-sqnr {target}: give an SQNR in dB, e.g. 30")
    args.mixed_presets = names
    args.mixed_budget = parse_budget(budget) if budget is not None else None


def read_choice(
    path: str, backend: str, preset_option: str | None, presets: list[str] | None
) -> dict[str, Any]:
    """``--mixed-precision-file``'s choice, checked against ``backend`` (its ``preset_option`` and
    ``presets`` from metadata; None: unknown before the plugin is imported, checked in ``choose``)."""
    from _quantplug.files import UnreadableFileError, read_json
    from _quantplug.suggest import did_you_mean

    where = f"--mixed-precision-file {path!r}"
    written = f"(a {FILE_NAME} written by `quantplug quantize --mixed-precision`)"
    try:
        data = read_json(path, limit=FILE_LIMIT)
    except FileNotFoundError:
        raise InputError(f"{where} not found {written}") from None
    except UnreadableFileError as exc:
        raise InputError(f"cannot read --mixed-precision-file {exc}") from None
    except OSError as exc:
        raise InputError(f"{where} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise InputError(f"{where} cannot be read: it is not a {FILE_FORMAT} document {written}")
    default, overrides = data.get("default"), data.get("overrides", {})
    if not isinstance(default, str) or not isinstance(overrides, dict):
        raise InputError(f"{where}: 'default' must be a preset name and 'overrides' an object {written}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in overrides.items()):
        raise InputError(f"{where}: 'overrides' must map layer names to preset names")
    if not isinstance(data.get("options", {}), dict) or not isinstance(data.get("target", {}), dict):
        raise InputError(f"{where}: 'options' and 'target' must be objects {written}")
    if data.get("backend") != backend:
        raise InputError(
            f"{where} holds presets of backend {data.get('backend')!r}, not {backend!r}: pass --backend "
            f"{data.get('backend')} or search again"
        )
    check_preset_option(where, data.get("preset_option"), backend, preset_option)
    unknown = sorted({default, *overrides.values()} - set(presets or ()))
    if presets is not None and unknown:  # (without metadata: MixedPrecision.check, once imported)
        raise InputError(
            f"{where} uses preset {unknown[0]!r}{did_you_mean(unknown[0], presets)}, which backend "
            f"{backend!r} does not offer; its presets: {', '.join(presets)}"
        )
    return data


def check_preset_option(where: str, named: Any, backend: str, preset_option: str | None) -> None:
    """A file's ``preset_option`` is the backend's: the option its ``default`` and overrides are
    given to. Another one (``activation_dtype``) would silently receive a preset name that happens
    to be one of its values, the preset itself staying at its default."""
    if preset_option is not None and named != preset_option:
        raise InputError(
            f"{where} names preset_option {named!r}, but backend {backend!r} selects presets with option "
            f"{preset_option!r}: its 'default' and overrides are {preset_option} values; set "
            f'"preset_option": "{preset_option}" in the file'
        )


def choose(
    args: argparse.Namespace,
    pairs: Mapping[str, str],
    program: Any,
    batches: list[Any],
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """The run's mixed precision as report data (``to_dict()`` plus ``source`` and ``layers``),
    searched on ``batches`` or read from ``--mixed-precision-file``; None when neither is asked."""
    from _quantplug.errors import QuantplugError
    from _quantplug.mixed_precision import MixedPrecision, search_mixed_precision, weighted_layers

    options = dict(pairs)
    if args.mixed_presets is not None:
        budget: Budget | None = args.mixed_budget
        found = search_mixed_precision(
            program,
            args.backend,
            args.mixed_presets,
            batches,
            target_sqnr_db=args.target_sqnr,
            max_weight_bytes=budget.bytes if budget is not None else None,
            max_weight_growth=budget.growth if budget is not None else None,
            options=options,
            progress=progress,
        )
        source = "search"
    elif args.mixed_precision_file is not None:
        from _quantplug.plugins.registry import load_backend

        path = Path(args.mixed_precision_file)
        data = getattr(args, "mixed_choice", None)
        if data is None:  # not checked yet (a caller other than check_arguments)
            data = read_choice(str(path), args.backend, None, None)
        try:
            found = MixedPrecision.from_dict(data)
        except (ValueError, KeyError, TypeError, AttributeError, QuantplugError) as exc:
            raise InputError(
                f"--mixed-precision-file {str(path)!r} cannot be read: {type(exc).__name__}: {exc} "
                f"(it must be a {FILE_NAME} written by `quantplug quantize --mixed-precision`)"
            ) from None
        where = f"--mixed-precision-file {str(path)!r}"
        check_preset_option(
            where, found.preset_option, args.backend, load_backend(args.backend).info.preset_option
        )
        found.options = options  # this run's options; the file gives the presets
        found.check(program)
        source = str(path)
    else:
        return None
    return {**found.to_dict(), "source": source, "layers": len(weighted_layers(program))}


def quantizer_for(mixed: Mapping[str, Any], pairs: Mapping[str, str]) -> Any:
    """The run's quantizer: the choice's default preset with its per-layer overrides applied."""
    from _quantplug.mixed_precision import MixedPrecision

    chosen = MixedPrecision.from_dict(mixed)
    chosen.options = dict(pairs)
    return chosen.quantizer()


def write_choice(mixed: Mapping[str, Any], folder: Path) -> Path:
    """``FOLDER/mixed_precision.json``: the choice as ``--mixed-precision-file`` reads it back:
    strict JSON, a measurement without a finite value (identical outputs: infinite SQNR) as null."""
    from _quantplug.report.data import finite_json

    keep = {k: v for k, v in mixed.items() if k not in ("source", "layers")}
    path = folder / FILE_NAME
    path.write_text(json.dumps(finite_json(keep), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path
