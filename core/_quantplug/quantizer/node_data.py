"""What a backend reads and writes on a node besides its specs: why it is float, notes, its own data.

Functions over the keys of :mod:`_quantplug.meta`, so a plugin never spells a key: the core may
store them differently in a later release without breaking it.

* :func:`float_reason`: why annotation left a node float (``"discarded by override (...)"``,
  ``"backend 'x' has no rule for aten.foo.default"``), or None for an annotated node;
* :func:`is_discarded`: the user's overrides keep a node float (``discard``, a config of None);
* :func:`set_coverage_note`: a rule quantizing a node otherwise than the options asked (a
  smaller block) says so; ``coverage()`` shows it beside the node;
* :func:`set_backend_node_data` / :func:`backend_node_data`: data a backend's own compiler
  needs on the nodes it will take (a partitioner that accepts only nodes its quantizer marked).
  Set by a rule or an annotation stage, it stays on the node through ``prepare`` and ``convert``
  (the converted program's op node is the annotated node's copy) and reaches lowering passes,
  the artifact writer and ``to_exported_program``'s nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from _quantplug.meta import BACKEND_DATA_KEY, FLOAT_REASON_KEY, NOTE_KEY

#: how the reason of a node an override keeps float begins (``set_node_name(name, None)`` ...)
DISCARDED = "discarded by override"


def float_reason(node: Any) -> str | None:
    """Why annotation left ``node`` float, or None when it holds specs (or was never annotated)."""
    reason = node.meta.get(FLOAT_REASON_KEY)
    return None if reason is None else str(reason)


def is_discarded(node: Any) -> bool:
    """Whether the user's overrides keep ``node`` float (not the backend's rules)."""
    return str(node.meta.get(FLOAT_REASON_KEY, "")).startswith(DISCARDED)


def set_coverage_note(node: Any, note: str) -> None:
    """Note on a node a rule quantizes otherwise than the options asked; ``coverage()`` shows it."""
    node.meta[NOTE_KEY] = str(note)


def set_backend_node_data(node: Any, key: str, value: Any) -> None:
    """Attach ``value`` under ``key`` to ``node`` for the backend's own passes and compiler.

    Keys are the backend's own (prefix them with the backend's name when an extension may add
    its own); values should be plain data (text, numbers, tuples), since programs are copied and
    saved.
    """
    data = node.meta.get(BACKEND_DATA_KEY)
    if not isinstance(data, dict):
        data = node.meta[BACKEND_DATA_KEY] = {}
    data[str(key)] = value


def backend_node_data(node: Any, key: str | None = None, default: Any = None) -> Any:
    """The value stored under ``key`` on ``node`` (``default`` if none); without ``key``, all of
    them as a read-only mapping (empty when none)."""
    data: Mapping[str, Any] = node.meta.get(BACKEND_DATA_KEY) or {}
    if key is None:
        return dict(data)
    return data.get(key, default)
