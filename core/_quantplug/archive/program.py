"""What in a serialized ``ExportedProgram`` torch would execute or paste into code.

``torch.export.load`` parses symbolic-shape expressions with ``sympy.sympify`` (``eval``), runs
input guards (``guards_code``) as Python, pastes node, input and attribute names into the code
torch.fx generates, and resolves op names from ``torch`` (``torch.os.system`` resolves).
:func:`code_in_program` lists every place of a program's JSON that is not of the plain form
``torch.export.save`` writes: an identifier, an attribute path, arithmetic on symbols and input
sizes, an operator.
"""

from __future__ import annotations

import ast
import keyword
import math
import operator
import re
from typing import Any

#: (every pattern is matched with ``fullmatch``: ``$`` would accept a trailing newline)
#: a dotted attribute path: identifiers and list indices (``layers.0.fc.weight``), a repeated
#: module call may end in ``@N`` (``blocks.0@1``)
_FQN_PART = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:@[0-9]+)?")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

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
    "Float": re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?(?:inf|nan)"),
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


def code_in_program(doc: Any) -> list[str]:
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
        elif key in _FQN_KEYS and isinstance(item, str) and item and not is_fqn(item):
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
    return isinstance(text, str) and bool(_IDENTIFIER.fullmatch(text)) and not keyword.iskeyword(text)


def is_fqn(text: Any) -> bool:
    return isinstance(text, str) and all(_FQN_PART.fullmatch(p) for p in text.split("."))


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
                _TEXT_ARGUMENT[node.func.id].fullmatch(t) for t in texts if node.func.id in _TEXT_ARGUMENT
            ):
                return "passes text to a constructor"
            if texts and node.func.id not in _TEXT_ARGUMENT:
                return "passes text to a constructor"
        elif isinstance(node, ast.Name):
            if (
                node.id not in _SYMPY_CALLS
                and node.id not in _SYMPY_NAMES
                and not _IDENTIFIER.fullmatch(node.id)
            ):
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
