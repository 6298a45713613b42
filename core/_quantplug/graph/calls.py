"""One call's inputs to a program: positional and keyword arguments, as the user gives them.

Programs exported from real models often take keyword inputs (``input_ids=..., attention_mask=...``).
Calibration data, the numeric debugger and the CLI therefore take each batch as a tuple
(positional arguments), a dict (keyword arguments) or a :class:`Call` (both), and run it the way
the exported program's calling convention (its pytree ``in_spec``) says: by name for keywords.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
from torch.utils import _pytree as pytree

from _quantplug.errors import QuantplugError


@dataclass(frozen=True)
class Call:
    """Positional ``args`` and keyword ``kwargs`` of one call."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: Any) -> Call:
        """A batch as the user gave it: a Call, a dict (keywords), a tuple or list, or one value."""
        if isinstance(batch, Call):
            return batch
        if isinstance(batch, dict):
            if not all(isinstance(k, str) for k in batch):
                raise QuantplugError(
                    "a dict batch holds keyword inputs, so its keys must be the input names (strings); "
                    f"got keys {list(batch)!r}"
                )
            return cls((), dict(batch))
        if isinstance(batch, (tuple, list)):
            return cls(tuple(batch))
        return cls((batch,))

    def run(self, fn: Callable[..., Any]) -> Any:
        """``fn(*args, **kwargs)``."""
        return fn(*self.args, **self.kwargs)

    def describe(self) -> str:
        """'2 positional', 'keyword a, b' or both: what a message says the caller gave."""
        return _inputs_phrase(len(self.args), list(self.kwargs))

    def _extra(self, in_spec: pytree.TreeSpec) -> str:
        """The inputs given beyond what ``in_spec`` takes, for a message ('' when none)."""
        if in_spec.num_children != 2:
            return ""
        args_spec, kwargs_spec = in_spec.children()
        extra = []
        if len(self.args) > args_spec.num_children:
            extra.append(f"{len(self.args) - args_spec.num_children} positional input(s) too many")
        unknown = sorted(set(self.kwargs) - {str(k) for k in kwargs_spec.context or ()})
        if unknown:
            extra.append(f"unknown keyword input(s) {', '.join(unknown)}")
        return "; ".join(extra)

    def flat(self, in_spec: pytree.TreeSpec | None, what: str = "the program") -> list[Any]:
        """The program's flat (placeholder-order) inputs for this call, per its ``in_spec``.

        Without an ``in_spec`` (a plain traced GraphModule) only positional arguments can be
        matched to placeholders.
        """
        if in_spec is None:
            if self.kwargs:
                raise QuantplugError(
                    f"{what} takes its inputs by position only; got keyword inputs {sorted(self.kwargs)}"
                )
            return list(self.args)
        if (
            not self.kwargs
            and len(self.args) == in_spec.num_leaves
            and all(isinstance(a, torch.Tensor) for a in self.args)
        ):
            return list(self.args)  # every input by position, as the generated forward takes them
        extra = self._extra(in_spec)
        if extra:  # tree_flatten_spec reads only what the spec names: the rest would vanish unseen
            raise QuantplugError(
                f"{self.describe()} input(s) do not match {what}, which takes {signature(in_spec)}: {extra}"
            )
        try:
            return list(fx_pytree.tree_flatten_spec((self.args, dict(self.kwargs)), in_spec))
        except Exception as exc:
            raise QuantplugError(
                f"{self.describe()} input(s) do not match {what}, which takes {signature(in_spec)} "
                f"({type(exc).__name__}: {exc})"
            ) from exc


def in_spec_of(program: torch.export.ExportedProgram | torch.nn.Module) -> pytree.TreeSpec | None:
    """The ``(args, kwargs)`` pytree spec a program's callers follow, if it records one."""
    if isinstance(program, torch.export.ExportedProgram):
        return program.call_spec.in_spec
    return getattr(program, "_in_spec", None)


def signature(in_spec: pytree.TreeSpec | None) -> str:
    """What a program with ``in_spec`` takes, for messages: 'N positional and keyword a, b'."""
    if in_spec is None or in_spec.num_children != 2:
        return "positional inputs"
    args_spec, kwargs_spec = in_spec.children()
    return _inputs_phrase(args_spec.num_children, [str(k) for k in kwargs_spec.context or ()])


def _inputs_phrase(positional: int, keywords: list[str]) -> str:
    parts = [f"{positional} positional"] if positional or not keywords else []
    if keywords:
        parts.append("keyword " + ", ".join(keywords))
    return " and ".join(parts)


def unflatten(flat: list[Any], in_spec: pytree.TreeSpec | None) -> Call:
    """The Call whose flat inputs are ``flat`` (e.g. random values made per placeholder)."""
    if in_spec is None:
        return Call(tuple(flat))
    args, kwargs = pytree.tree_unflatten(flat, in_spec)
    return Call(tuple(args), dict(kwargs))


def check_flat_inputs(module: torch.nn.Module, flat: list[Any], what: str = "the program") -> None:
    """Each flat input matches its placeholder's recorded dtype and static shape.

    A program run on a wrong shape fails deep inside torch (an exported module's shape guard
    raises a bare AssertionError); this names the input and both shapes instead.
    """
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders):
        raise QuantplugError(f"{what} takes {len(placeholders)} input(s), got {len(flat)}")
    for node, value in zip(placeholders, flat):
        expected = node.meta.get("val")
        if not isinstance(expected, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            raise QuantplugError(f"{what}: input {node.name!r} must be a tensor, got {type(value).__name__}")
        dims = tuple(d if isinstance(d, int) else None for d in expected.shape)
        shape_ok = value.dim() == len(dims) and all(e is None or e == d for e, d in zip(dims, value.shape))
        if not shape_ok or value.dtype != expected.dtype:
            wanted = "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"
            got = "(" + ", ".join(map(str, value.shape)) + ")"
            dtype = str(expected.dtype).removeprefix("torch.")
            raise QuantplugError(
                f"{what}: input {node.name!r} has shape {got} and dtype "
                f"{str(value.dtype).removeprefix('torch.')}; the program expects {wanted} {dtype}"
            )


def input_misfit(
    module: torch.nn.Module, call: Call, what: str = "the prepared model"
) -> QuantplugError | None:
    """Why ``call`` does not fit ``module`` (wrong count, names, dtype or static shape), or None.

    For explaining a call torch has already refused: the error names the input at fault instead
    of the op deep inside the program that tripped over it.
    """
    try:
        check_flat_inputs(module, call.flat(in_spec_of(module), what=what), what=what)
    except QuantplugError as exc:
        return exc
    return None
