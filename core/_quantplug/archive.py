"""Loading ``.pt2`` archives without running the code a hostile one can carry.

Loading a model runs code, as unpickling does: treat a ``.pt2`` from an untrusted source like a
script. ``torch.export.load`` runs an archive's code in several places:

* weights and constants marked ``use_pickle``, custom and opaque objects, the example inputs (and
  the older archive format's files) are unpickled, some with ``weights_only=False`` (any code);
* compiled AOTInductor models (shared libraries) are loaded;
* symbolic-shape expressions are parsed with ``sympy.sympify`` (``eval``);
* input guards (``guards_code``) are executed as Python; node, input and attribute names are
  pasted into the Python code torch.fx generates for the program; an op name may resolve to any
  function reachable from ``torch`` (``torch.os.system``).

:func:`load_program` reads the archive's JSON first and refuses, with
:class:`~_quantplug.errors.UnsafeArchiveError` naming what and where, any archive with pickled or
compiled entries (unless ``allow_pickle=True``: for files you trust) and any archive whose names,
expressions, guards or op targets are not of the plain forms ``torch.export.save`` writes (always:
no legitimate archive has them). Only then does ``torch.export.load`` run.
"""

from __future__ import annotations

import ast
import io
import json
import keyword
import logging
import math
import operator
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from _quantplug.errors import QuantplugError, UnsafeArchiveError

#: a dotted attribute path: identifiers and list indices (``layers.0.fc.weight``), a repeated
#: module call may end in ``@N`` (``blocks.0@1``)
_FQN_PART = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:@[0-9]+)?$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: sympy constructors that torch.export's ``srepr`` expressions use; ``sympify`` evaluates the
#: text, so nothing else may be called (``S("...")`` or ``N("...")`` would sympify again)
_SYMPY_CALLS = frozenset(
    {
        "Symbol", "Dummy", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Mod", "Max", "Min",
        "Abs", "floor", "ceiling", "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality",
        "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "And", "Or",
        "Not", "Piecewise", "ExprCondPair", "ITE", "BooleanTrue", "BooleanFalse", "Tuple",
        # torch.utils._sympy.functions (the deserializer's sympy_functions)
        "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
        "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
        "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt",
        "RoundDecimal", "ToFloat", "Identity", "OpaqueUnaryFn_sqrt", "BitwiseFn_bitwise_and",
        "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor",
    }
)  # fmt: skip
#: the constructors that take text: a symbol's name, a float's digits (never parsed as code)
_TEXT_ARGUMENT = {
    "Symbol": _IDENTIFIER,
    "Dummy": _IDENTIFIER,
    "Float": re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?(?:inf|nan)$"),
}
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "S", "True", "False", "None", "E", "pi", "I"})
#: calls a guard may make: tensor size queries on an input (``L['x'].size()[0]``), math and the
#: sympy helpers torch's guard code uses
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_GUARD_FUNCTIONS = frozenset(
    {"Max", "Min", "Abs", "FloorDiv", "IsNonOverlappingAndDenseIndicator", "cast_symbool_to_symint_guardless"}
)
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "log2", "isnan", "isinf"})
_GUARD_NAMES = frozenset({"L", "inf", "True", "False", "None"})

_FQN_KEYS = frozenset(
    {"parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "fqn", "target_name"}
)
_NAME_KEYS = frozenset({"name", "as_name"})
_NAME_TABLES = frozenset(
    {"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values"}
)


def load_program(path: str | Path, *, allow_pickle: bool = False) -> Any:
    """``torch.export.load(path)`` once :func:`check_archive` found nothing that would run code.

    Args:
        path: a ``.pt2`` file written by ``torch.export.save``.
        allow_pickle: accept pickled entries and compiled code (their loading may run any code
            the file holds): only for files you trust. Names, expressions and guards are checked
            either way.

    Raises:
        UnsafeArchiveError: the archive would run code when loaded.
        QuantplugError: the file is not a torch.export archive, or torch cannot load it (with
            the reason torch gave, not a pointer to hidden warnings).
    """
    check_archive(path, allow_pickle=allow_pickle)
    import torch

    with _captured_torch_logs() as records:
        try:
            return torch.export.load(str(path))
        except Exception as exc:
            detail = next((r for r in records if r.exc_info and r.exc_info[1] is not None), None)
            cause = detail.exc_info[1] if detail is not None and detail.exc_info else exc
            text = str(cause).strip().splitlines()
            reason = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
            raise QuantplugError(f"torch.export cannot load {str(path)!r}: {reason}") from exc


@contextmanager
def _captured_torch_logs() -> Iterator[list[logging.LogRecord]]:
    """torch.export.load logs the real error (a WARNING with the traceback) before raising one
    that says "check the warnings above"; keep those records to report the cause instead."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("torch.export")
    handler, propagate = Keep(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def check_archive(path: str | Path, *, allow_pickle: bool = False) -> None:
    """Refuse an archive whose loading would run code (see the module docstring)."""
    where = str(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise QuantplugError(
            f"{where!r} is not a torch.export archive (.pt2 files are zip archives): {exc}"
        ) from None
    with archive:
        names = archive.namelist()
        prefix = _prefix(names)
        if prefix is None:
            if any(PurePosixPath(n).name == "serialized_exported_program.json" for n in names):
                _check_legacy(archive, where, allow_pickle)
                return
            raise QuantplugError(
                f"{where!r} is a zip archive but not a torch.export program (no archive_format entry); "
                "write one with torch.export.save(torch.export.export(model, example_inputs), path)"
            )
        local = {n[len(prefix) :]: n for n in names if n.startswith(prefix)}
        models = sorted(n for n in local if n.startswith("models/") and n.endswith(".json"))
        if not models:
            raise QuantplugError(f"{where!r} holds no exported program (no models/*.json entry)")
        problems: list[str] = []
        if not allow_pickle:
            problems += _pickled_entries(archive, local)
        for name in models:
            doc = _read_json(archive, local[name], where)
            problems += [f"{name}: {p}" for p in _code_in_program(doc)]
        for name in sorted(n for n in local if n.endswith("_config.json") and n.startswith("data/")):
            doc = _read_json(archive, local[name], where)
            for fqn in (doc.get("config") or {}) if isinstance(doc, dict) else ():
                if not _is_fqn(fqn):
                    problems.append(f"{name}: {fqn!r} is not a plain attribute path")
    _refuse(where, problems, allow_pickle)


def _prefix(names: list[str]) -> str | None:
    for n in names:
        p = PurePosixPath(n)
        if p.name == "archive_format" and len(p.parts) <= 2:
            return "" if len(p.parts) == 1 else p.parts[0] + "/"
    return None


def _read_json(archive: zipfile.ZipFile, name: str, where: str) -> Any:
    try:
        return json.loads(archive.read(name))
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuantplugError(f"{where!r}: {name} is not valid JSON ({exc})") from None


def _refuse(where: str, problems: list[str], allow_pickle: bool) -> None:
    if not problems:
        return
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    pickled = any("pickle" in p or "compiled" in p for p in problems)
    advice = (
        " If you trust this file, pass allow_pickle=True (CLI: --allow-pickle): loading it may then run "
        "any code it holds."
        if pickled and not allow_pickle
        else " No file written by torch.export.save looks like this: it was crafted or damaged."
    )
    raise UnsafeArchiveError(f"refusing to load {where!r}: loading it would run code ({shown}).{advice}")


# ------------------------------------------------------------------------------------------------
# pickled and compiled entries
# ------------------------------------------------------------------------------------------------


def _pickled_entries(archive: zipfile.ZipFile, local: dict[str, str]) -> list[str]:
    found = []
    for name, full in sorted(local.items()):
        if name.startswith("data/aotinductor/"):
            found.append(f"{name} is compiled AOTInductor code (loaded as a shared library)")
        elif name.startswith(("data/weights/", "data/constants/")) and name.endswith(".pt"):
            found.append(f"{name} is a pickled legacy weights file")
        elif name.startswith(("data/weights/", "data/constants/")) and name.endswith("_config.json"):
            doc = _read_json(archive, full, archive.filename or "the archive")
            for fqn, meta in ((doc.get("config") or {}) if isinstance(doc, dict) else {}).items():
                path_name = str(meta.get("path_name", "")) if isinstance(meta, dict) else ""
                if isinstance(meta, dict) and meta.get("use_pickle"):
                    found.append(f"{fqn!r} is stored pickled ({name})")
                elif path_name.startswith(("custom_obj", "opaque_obj")):
                    found.append(f"{fqn!r} is a pickled object ({name})")
        elif name.startswith("data/sample_inputs/") and not _loads_without_pickle(archive.read(full)):
            found.append(f"{name} holds pickled objects other than tensors")
    return found


def _loads_without_pickle(data: bytes) -> bool:
    """Whether torch's restricted unpickler reads ``data`` (then torch never falls back to the
    unrestricted one, which runs code)."""
    if not data:
        return True
    import torch

    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        return False
    return True


def _check_legacy(archive: zipfile.ZipFile, where: str, allow_pickle: bool) -> None:
    """The format of torch <= 2.6: a JSON program and pickled (``.pt``) state."""
    problems = []
    for name in archive.namelist():
        if PurePosixPath(name).name == "serialized_exported_program.json":
            problems += [f"{name}: {p}" for p in _code_in_program(_read_json(archive, name, where))]
        elif name.endswith(".pt") and not allow_pickle and not _loads_without_pickle(archive.read(name)):
            problems.append(f"{name} holds pickled objects other than tensors (legacy format)")
    _refuse(where, problems, allow_pickle)


# ------------------------------------------------------------------------------------------------
# code in the program's JSON
# ------------------------------------------------------------------------------------------------


def _code_in_program(doc: Any) -> list[str]:
    """What in a serialized ExportedProgram torch would execute or paste into code."""
    problems: list[str] = []
    if not isinstance(doc, dict):
        return ["the program is not a JSON object"]
    for guard in doc.get("guards_code") or ():
        reason = _guard_problem(guard)
        if reason:
            problems.append(f"guard {guard!r} {reason}")
    _walk(doc, problems)
    return problems


def _walk(value: Any, problems: list[str]) -> None:
    if isinstance(value, list):
        for item in value:
            _walk(item, problems)
        return
    if not isinstance(value, dict):
        return
    if "target" in value and "inputs" in value and "outputs" in value:
        reason = _target_problem(value["target"])
        if reason:
            problems.append(f"node {value.get('name')!r} {reason}")
    for key, item in value.items():
        if key == "metadata":
            continue  # stack traces and module stacks: text torch shows, never runs
        if key in _NAME_KEYS and isinstance(item, str) and not _is_identifier(item):
            problems.append(f"name {item!r} is not a plain identifier")
        elif key in _FQN_KEYS and isinstance(item, str) and item and not _is_fqn(item):
            problems.append(f"{key} {item!r} is not a plain attribute path")
        elif key == "forward_arg_names" and isinstance(item, list):
            problems += [
                f"argument name {a!r} is not a plain identifier" for a in item if not _is_identifier(a)
            ]
        elif key in _NAME_TABLES and isinstance(item, dict):
            problems += [f"name {k!r} is not a plain identifier" for k in item if not _is_identifier(k)]
        elif key == "expr_str" and isinstance(item, str):
            reason = _sympy_problem(item)
            if reason:
                problems.append(f"expression {item!r} {reason}")
        _walk(item, problems)


def _is_identifier(text: Any) -> bool:
    return isinstance(text, str) and bool(_IDENTIFIER.match(text)) and not keyword.iskeyword(text)


def _is_fqn(text: Any) -> bool:
    return isinstance(text, str) and all(_FQN_PART.match(p) for p in text.split("."))


def _allowed_targets() -> tuple[frozenset[Any], tuple[type, ...]]:
    import torch

    try:
        from torch._export.serde.serialize import _SYM_OPS as sym_ops
    except ImportError:  # pragma: no cover - a torch without it
        sym_ops = set()
    functions = frozenset({*sym_ops, operator.getitem})
    kinds = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
    return functions, kinds


def _target_problem(target: Any) -> str | None:
    """Why an op target is not an operator (None: it is one), resolved as the deserializer does."""
    import torch

    if not isinstance(target, str):
        return f"has a target of type {type(target).__name__}"
    roots = {"_operator": operator, "torch": torch, "math": math}
    root_name, _, rest = target.partition(".")
    root = roots.get(root_name)
    if root is None or not all(_is_identifier(p) for p in rest.split(".")):
        return f"calls {target!r}, which is not an operator"
    obj: Any = root
    for part in rest.split("."):
        if not hasattr(obj, part):
            return f"calls {target!r}, which does not exist"
        obj = getattr(obj, part)
    functions, kinds = _allowed_targets()
    if isinstance(obj, kinds) or obj in functions:
        return None
    if root is math and callable(obj) and type(obj).__name__ == "builtin_function_or_method":
        return None
    return f"calls {target!r}, which is not an operator"


def _sympy_problem(text: str) -> str | None:
    """Why ``sympify(text)`` might do more than build an expression (None: it cannot)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return "is not an expression"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _SYMPY_CALLS:
                return f"calls {ast.unparse(node.func)}"
            texts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if texts and not all(
                _TEXT_ARGUMENT[node.func.id].match(t) for t in texts if node.func.id in _TEXT_ARGUMENT
            ):
                return "passes text to a constructor"
            if texts and node.func.id not in _TEXT_ARGUMENT:
                return "passes text to a constructor"
        elif isinstance(node, ast.Name):
            if node.id not in _SYMPY_CALLS and node.id not in _SYMPY_NAMES and not _IDENTIFIER.match(node.id):
                return f"uses {node.id!r}"
            if node.id.startswith("_"):
                return f"uses {node.id!r}"
        elif not isinstance(node, _EXPRESSION_NODES):
            return f"contains {type(node).__name__}"
    return None


_EXPRESSION_NODES = (
    ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.keyword, ast.BinOp, ast.UnaryOp,
    ast.BoolOp, ast.Compare, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.Tuple,
)  # fmt: skip


def _guard_problem(text: Any) -> str | None:
    """Why a guard would do more than compare an input's sizes (None: it does only that)."""
    if not isinstance(text, str):
        return "is not text"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return "is not an expression"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            ok = (
                (isinstance(func, ast.Name) and func.id in _GUARD_FUNCTIONS)
                or (
                    isinstance(func, ast.Attribute)
                    and func.attr in _GUARD_METHODS
                    and _rooted_at_input(func.value)
                )
                or (
                    isinstance(func, ast.Attribute)
                    and func.attr in _GUARD_MATH
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "math"
                )
            )
            if not ok:
                return f"calls {ast.unparse(func)}"
        elif isinstance(node, ast.Attribute):
            if not (
                node.attr in _GUARD_METHODS or (node.attr in _GUARD_MATH and isinstance(node.value, ast.Name))
            ):
                return f"reads .{node.attr}"
        elif isinstance(node, ast.Name):
            if node.id not in _GUARD_NAMES and node.id not in _GUARD_FUNCTIONS and node.id != "math":
                return f"uses {node.id!r}"
        elif isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Constant) and not isinstance(node.slice.value, (int, str)):
                return "indexes with a non-constant"
        elif not isinstance(node, (*_EXPRESSION_NODES, ast.Attribute, ast.Subscript, ast.Slice)):
            return f"contains {type(node).__name__}"
    return None


def _rooted_at_input(node: ast.AST) -> bool:
    """``L['x']``, ``L['x'][0]``, ``L['x'].size()[0]``...: an expression on the inputs ``L``."""
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        else:
            return isinstance(node, ast.Name) and node.id == "L"
