"""``torch.export.save`` without the slow deep copy inside its canonical-form check.

Serializing a program (torch 2.13, ``ExportedProgramSerializer.serialize``) ends with a check
that the serialized program has a canonical form: ``canonicalize(serialized)``, whose result is
discarded. ``canonicalize`` starts with ``copy.deepcopy`` of the whole serialized program (a
tree of the serde schema's dataclasses, unions, enums, strings and numbers: one Python call
per object), which is three quarters of saving a converted program (1.9 s of 2.5 s for an
EfficientNet-B0: every ``model.pt2`` a reference artifact writes).

While :func:`saving` holds, the serializer's ``copy.deepcopy`` is a pickle round trip, which
copies the same objects in C (five times faster there), shared objects shared once as
``deepcopy`` does; anything pickle cannot copy goes to ``copy.deepcopy``. The check runs on an
equal copy and the bytes written are the same (``tests/core/test_peers.py`` compares the files).
On a torch version this was not verified on, torch's own ``deepcopy`` runs.
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from _quantplug.peers.versions import verified

_SERIALIZER = "torch._export.serde.serialize"
_lock = threading.RLock()
_depth = 0


def _copy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """``copy.deepcopy(obj)`` for plain data (what the serde schema is made of), through pickle."""
    if memo is None:
        try:
            return pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))
        except Exception:  # not plain data: the general copy decides (and reports)
            pass
    return copy.deepcopy(obj, memo)


@contextmanager
def saving() -> Iterator[None]:
    """Within: ``torch.export.save`` checks its canonical form on a pickled copy (same bytes)."""
    global _depth
    if "torch" not in sys.modules or not verified("torch_export_save"):
        yield
        return
    import importlib

    serializer = importlib.import_module(_SERIALIZER)
    with _lock:
        if _depth == 0:
            serializer.copy = SimpleNamespace(deepcopy=_copy)  # type: ignore[attr-defined]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                serializer.copy = copy  # type: ignore[attr-defined]
