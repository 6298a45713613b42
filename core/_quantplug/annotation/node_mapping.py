"""Annotations carried onto another graph's nodes.

An annotation names nodes: an input's producer (``input_qspec_map``'s keys), a shared edge or
node (``SharedQuantizationSpec``), the edges a derived encoding is derived from. convert builds
the converted program as a new graph and copies each node's meta; an annotation copied as it is
keeps naming the prepared graph's nodes, and through them (a node holds its graph, a graph its
module) the whole prepared module: its observers, the algorithms' Hessian sums and stored batches,
the guard's simulation -- more than an LLM's float weights, for as long as the converted program
lives. torchao's convert rewrites the prepared graph in place, so its annotations name nodes of
the program they sit on; mapped onto the copies, quantplug's do too.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

__all__ = ["Memo", "map_nodes"]

#: id of a value mapped -> (the value, what it was mapped to)
Memo = dict[int, tuple[Any, Any]]

#: what a spec's fields mostly hold, which never hold a node: returned at once (convert maps every
#: annotation of the program; walking these costs more than the nodes)
_ATOMS = (
    type(None),
    bool,
    int,
    float,
    str,
    torch.dtype,
    torch.qscheme,
    type,
    types.FunctionType,
    functools.partial,
)
#: a dataclass type's field names
_FIELDS: dict[type, tuple[str, ...]] = {}


def map_nodes(value: Any, copies: Mapping[Node, Node], memo: Memo | None = None) -> Any:
    """``value`` with each :class:`~torch.fx.Node` in it replaced by its copy in ``copies``.

    Dataclasses (quantplug's specs and annotations, torchao's alike: frozen or not), dicts, lists
    and tuples holding a node are copied around the replacement, their other fields shared (a
    copy's fields are set as they are, so a spec's validation does not run again); a value
    holding no node is returned as it is, not copied, and a node without a copy stays. ``memo``
    (by id, holding each original) keeps one copy of a spec that several annotations share."""
    memo = {} if memo is None else memo
    return _map(value, copies, memo)


def _map(value: Any, copies: Mapping[Node, Node], memo: Memo) -> Any:
    if isinstance(value, Node):
        return copies.get(value, value)
    if isinstance(value, _ATOMS):
        return value
    key = id(value)
    if key in memo and memo[key][0] is value:  # (the original is held: its id is not reused)
        return memo[key][1]
    memo[key] = (value, value)  # a cycle back to a value being mapped reads it as it is
    mapped: Any = value
    if isinstance(value, dict):
        items = [(_map(k, copies, memo), _map(v, copies, memo)) for k, v in value.items()]
        if any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(items, value.items())):
            mapped = dict(items)
    elif isinstance(value, (list, tuple)):
        parts = [_map(v, copies, memo) for v in value]
        if any(p is not v for p, v in zip(parts, value)):
            mapped = parts if isinstance(value, list) else _tuple_like(value, parts)
    elif dataclasses.is_dataclass(value):
        names = _FIELDS.get(type(value))
        if names is None:
            names = _FIELDS[type(value)] = tuple(f.name for f in dataclasses.fields(value))
        changed = {
            name: new for name in names if (new := _map(old := getattr(value, name), copies, memo)) is not old
        }
        if changed:
            mapped = _shallow_copy(value)
            for name, new in changed.items():
                object.__setattr__(mapped, name, new)
    memo[key] = (value, mapped)
    return mapped


def _shallow_copy(value: Any) -> Any:
    """``copy.copy(value)`` without its dispatch for a plain instance (convert copies one
    annotation per annotated node); any other through ``copy.copy``."""
    cls = type(value)
    state = getattr(value, "__dict__", None)
    if type(state) is not dict or hasattr(cls, "__copy__") or cls.__reduce_ex__ is not object.__reduce_ex__:
        return copy.copy(value)
    made = object.__new__(cls)
    made.__dict__.update(state)
    return made


def _tuple_like(value: tuple[Any, ...], parts: list[Any]) -> tuple[Any, ...]:
    """A tuple of ``value``'s type (a named tuple keeps its class) holding ``parts``."""
    if type(value) is tuple:
        return tuple(parts)
    return type(value)(*parts)
