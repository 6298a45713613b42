"""The report's data: one JSON-ready dict, the single source for report.json, report.html and the
text summary (so ``quantplug report OUT`` re-renders exactly what ``quantize`` wrote)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from _quantplug.errors import QuantplugError
from _quantplug.files import UnreadableFileError, read_json, write_atomic

SCHEMA = "quantplug-report/1"
WORST_COUNT = 20


class ReportError(QuantplugError):
    """A report folder or report.json that cannot be read."""


def finite_json(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, tuples lists, unknown objects their str() (what
    quantplug writes, its readers read back: :func:`~_quantplug.files.read_json` refuses
    ``NaN``/``Infinity``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [finite_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def build_report(
    debug: Any,
    *,
    backend: Mapping[str, Any],
    options: Mapping[str, Any],
    model: Mapping[str, Any],
    calibration: Mapping[str, Any],
    float_bytes: int | None = None,
    quantized_bytes: int | None = None,
    validation: Any = None,
    warnings: Sequence[str] = (),
    files: Sequence[Mapping[str, Any]] = (),
    timings: Mapping[str, float] | None = None,
    mixed_precision: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the report from a :class:`quantplug.debug.DebugReport` and what the run knows.

    ``validation`` is a :class:`quantplug.ValidationReport` (or its ``to_dict()``), or None.
    ``mixed_precision`` is the per-layer preset choice the run applied
    (:meth:`~_quantplug.mixed_precision.MixedPrecision.to_dict`, plus ``source`` and
    ``layers``), shown with its trade-off curve.
    """
    import torch

    d = debug.to_dict()
    nodes = d["nodes"]
    ranked = sorted((n for n in nodes if n["sqnr_db"] is not None), key=lambda n: (n["sqnr_db"], n["node"]))
    out_sqnr = debug.output_sqnr_db
    if validation is not None and hasattr(validation, "to_dict"):
        validation = validation.to_dict()
    ratio = (
        float_bytes / quantized_bytes
        if float_bytes is not None and quantized_bytes not in (None, 0)
        else None
    )
    data = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quantplug_version": _installed_version(),
        "torch_version": torch.__version__,
        "model": dict(model),
        "backend": dict(backend),
        "options": dict(options),
        "calibration": dict(calibration),
        "summary": {
            "nodes_compared": len(nodes),
            "nodes_total": len(d["quantized_ops"]) + len(d["float_nodes"]),
            "nodes_quantized": len(d["quantized_ops"]),
            "nodes_float": len(d["float_nodes"]),
            "nodes_removed": len(d["removed_nodes"]),
            "compare_batches": d["batches"],
            "output_sqnr_db": out_sqnr,
            "output_identical": out_sqnr == math.inf,
            "output_max_abs_error": d["output_max_abs_error"],
            "float_bytes": float_bytes,
            "quantized_bytes": quantized_bytes,
            "size_ratio": ratio,
            "sharing_groups": len(d["sharing_groups"]),
            "validation_violations": len((validation or {}).get("violations", [])),
            **_artifact_summary(d.get("artifact")),
        },
        "layers": nodes,
        "worst": ranked[:WORST_COUNT],
        "outputs": d["outputs"],
        "float_nodes": d["float_nodes"],
        "removed_nodes": d["removed_nodes"],
        "unmatched": d["unmatched"],
        "sharing_groups": d["sharing_groups"],
        "artifact": d.get("artifact"),
        "validation": validation,
        "warnings": list(warnings),
        "files": [dict(f) for f in files],
        "timings": dict(timings or {}),
    }
    if mixed_precision is not None:
        data["mixed_precision"] = dict(mixed_precision)
    return finite_json(data)


def _artifact_summary(artifact: Mapping[str, Any] | None) -> dict[str, Any]:
    """The backend artifact's output SQNR beside the program's (what ships vs what was analysed)."""
    if not artifact:
        return {}
    return {
        "artifact_measured": bool(artifact.get("ran")),
        "artifact_sqnr_db": artifact.get("sqnr_db"),
        "artifact_identical": bool(artifact.get("identical")),
        "artifact_gap_db": artifact.get("gap_db"),
        "artifact_flagged": bool(artifact.get("flagged")),
    }


def write_json(data: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """report.json, strict JSON (non-finite numbers become null), replaced in one rename."""
    write_atomic(path, json.dumps(finite_json(data), indent=2, allow_nan=False) + "\n")


def load_report(location: str | os.PathLike[str]) -> dict[str, Any]:
    """Read report.json from a folder written by ``quantplug quantize`` (or the file itself), as
    untrusted input (:func:`~_quantplug.files.read_json`: a regular file, bounded, finite)."""
    path = Path(location)
    if path.is_dir():
        path = path / "report.json"
    if not os.path.lexists(path):
        raise ReportError(f"no report.json in {location!s} (write one with `quantplug quantize --out DIR`)")
    try:  # a regular file of bounded size and depth, finite numbers (report.json is strict JSON)
        data = read_json(path)
    except UnreadableFileError as exc:
        raise ReportError(f"cannot read {exc}") from None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ReportError(f"{path} is not a quantplug report (expected schema {SCHEMA!r})")
    problem = _check(data, _REPORT, "")
    if problem is not None:
        raise ReportError(f"{path} is damaged: {problem}; write it again with `quantplug quantize --out DIR`")
    return data


# ------------------------------------------------------------------------------------------------
# what the renderers read, and of which type (other fields are free: later versions add some)
# ------------------------------------------------------------------------------------------------

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))
_SCALAR = (str, int, float, bool, type(None))
_ROW = {
    "node": _OPT_STR,
    "op": _OPT_STR,
    "sqnr_db": _OPT_NUM,
    "identical": (bool, type(None)),
    "max_abs_error": _OPT_NUM,
    "shape": (list, type(None)),
    "note": _OPT_STR,
    "quantized": (bool, type(None)),
}
_REASON = {"node": _OPT_STR, "op": _OPT_STR, "reason": _OPT_STR}
_GROUP = {"members": [str], "scale": _OPT_NUM, "channels": _OPT_NUM}
_REPORT: dict[str, Any] = {
    "created": _OPT_STR,
    "summary": {"*": (int, float, bool, type(None))},
    "backend": {"*": _SCALAR},
    "model": {"source": _OPT_STR, "name": _OPT_STR},
    "calibration": {"source": _SCALAR, "batches": _SCALAR, "random": (bool, type(None))},
    "options": {"*": (str, int, float, bool, type(None), list, dict)},
    "layers": [_ROW],
    "worst": [_ROW],
    "outputs": [_ROW],
    "float_nodes": [_REASON],
    "removed_nodes": [_REASON],
    "sharing_groups": [_GROUP],
    "validation": (dict, type(None)),
    "warnings": [str],
    "files": [{"path": str, "bytes": _OPT_NUM}],
    "timings": {"*": _OPT_NUM},
    "mixed_precision": {
        "backend": str,
        "default": str,
        "source": str,
        "layers": _OPT_NUM,
        "chosen": (int, type(None)),
        "overrides": {"*": str},
        "target": {"*": _OPT_NUM},
        "curve": [{"weight_bytes": _OPT_NUM, "sqnr_db": _OPT_NUM, "overrides": {"*": str}}],
    },
}


def _check(value: Any, spec: Any, where: str) -> str | None:
    """Why ``value`` does not fit ``spec`` (a type or types, ``{field: spec}`` with ``"*"`` for
    every field, or ``[item spec]``), naming the field; None when it fits."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where or 'the report'} must be an object, not {type(value).__name__}"
        for key, item in value.items():
            sub = spec.get(key, spec.get("*"))
            if sub is not None:
                problem = _check(item, sub, f"{where}.{key}" if where else key)
                if problem:
                    return problem
        return None
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"{where} must be a list, not {type(value).__name__}"
        for i, item in enumerate(value):
            problem = _check(item, spec[0], f"{where}[{i}]")
            if problem:
                return problem
        return None
    if not isinstance(value, spec):
        return f"{where} holds {json.dumps(value)[:40]} ({type(value).__name__})"
    return None


def _installed_version() -> str | None:
    """quantplug's version as installed (its distribution's metadata, as ``quantplug --version``
    reads it); None when it is not installed."""
    try:
        return metadata.version("quantplug")
    except metadata.PackageNotFoundError:
        return None
