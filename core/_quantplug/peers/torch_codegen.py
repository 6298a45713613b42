"""torch.fx code generation without its per-node overheads that do not change the code.

Generating the Python code of a prepared or converted program (``GraphModule.recompile``) is a
third of prepare + convert. Most of it is torch.fx's own bookkeeping, repeated per node:

* ``Graph.python_code`` gives every node a temporary ``_repr_fn`` and restores it afterwards:
  two assignments per node, each through ``Node.__setattr__``, which (torch 2.13) takes the node
  out of the graph's ``_find_nodes_lookup_table`` and files it again under the same
  ``(op, target)`` key, hashing the target (an ``OpOverload``, hashed in Python) each time. The
  key is the node's ``op`` and ``target``, which code generation never changes: while
  :func:`generating_code` holds, the graph shows ``Node.__setattr__`` an empty table (nothing to
  re-file) and gets its own table back, unchanged, afterwards.
* every call and every operator argument asks ``_get_qualified_name`` (module lookups, string
  work) and ``_is_from_torch`` (a regular expression) about the same few targets, and every
  constant argument asks ``is_opaque_value_type`` (a registry walk over the type's MRO) about
  the same few types: pure functions of their argument, answered from a memo for the duration.

The generated code is the same (``tests/core/test_peers.py`` compares it with torch's own path).
While :func:`generating_code` holds, ``graph.python_code`` is first asked of
:mod:`_quantplug.peers.torch_python_code`, which writes the graphs quantplug compiles in one pass
(a third of torch's time); what it leaves to torch runs the path above.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx.graph as fx_graph
from torch.fx import Graph

from _quantplug.peers import torch_python_code
from _quantplug.peers.versions import verified

_TABLE = "_find_nodes_lookup_table"
#: the module-level functions of torch.fx.graph answered from a memo while code is generated
_MEMOIZED = ("_get_qualified_name", "_is_from_torch", "is_opaque_value_type")
_lock = threading.RLock()
_depth = 0
_originals: dict[str, Any] = {}  # torch's own functions while the memoized ones are bound


def _memo(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` answering each object once, by identity (no hashing: an ``OpOverload`` hashes in
    Python, and equal but distinct objects must not share an answer)."""
    answers: dict[int, tuple[Any, Any]] = {}

    def memoized(obj: Any) -> Any:
        found = answers.get(id(obj))
        if found is not None and found[0] is obj:
            return found[1]
        answer = fn(obj)
        answers[id(obj)] = (obj, answer)  # holds obj: its id is not reused meanwhile
        return answer

    return memoized


@contextmanager
def generating_code(graph: Graph) -> Iterator[None]:
    """Hold while ``graph``'s module is (re)compiled; nothing else may edit ``graph`` meanwhile.

    ``graph.python_code`` answers from :mod:`_quantplug.peers.torch_python_code` meanwhile
    (which hands what it does not know to torch's own path, made cheaper as described above)."""
    bound = "python_code" not in graph.__dict__
    if bound:
        graph.__dict__["python_code"] = torch_python_code.bound_to(graph)
    try:
        with _torch_path_memoized(graph):
            yield
    finally:
        if bound:
            del graph.__dict__["python_code"]


@contextmanager
def _torch_path_memoized(graph: Graph) -> Iterator[None]:
    global _depth
    table = graph.__dict__.get(_TABLE)
    if table is None or not verified("torch_codegen"):
        yield
        return
    with _lock:  # one thread at a time binds, and the outermost holder restores, torch's functions
        if not _depth:
            found = {name: fn for name in _MEMOIZED if callable(fn := getattr(fx_graph, name, None))}
            if len(found) < len(_MEMOIZED):  # another torch.fx: its own path
                yield
                return
            _originals.update(found)
            for name, fn in found.items():
                setattr(fx_graph, name, _memo(fn))
        _depth += 1
        setattr(graph, _TABLE, ())  # ``node in ()`` is False: Node.__setattr__ leaves the table alone
        try:
            yield
        finally:
            setattr(graph, _TABLE, table)
            _depth -= 1
            if not _depth:
                for name, fn in _originals.items():
                    setattr(fx_graph, name, fn)
                _originals.clear()
