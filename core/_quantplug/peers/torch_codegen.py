"""torch.fx code generation without re-filing every node twice in the graph's lookup table.

``Graph.python_code`` gives every node a temporary ``_repr_fn`` and restores it afterwards: two
assignments per node, each through ``Node.__setattr__``, which (torch 2.13) takes the node out of
the graph's ``_find_nodes_lookup_table`` and files it again under the same ``(op, target)`` key,
hashing the target (an ``OpOverload``, hashed in Python) each time: about a fifth of generating
the code of a prepared or converted program. The table's key is the node's ``op`` and
``target``, which code generation never changes, so while :func:`generating_code` holds, the
graph shows ``Node.__setattr__`` an empty table (nothing to re-file) and gets its own table back,
unchanged, afterwards. The generated code is the same (``tests/core/test_peers.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.fx import Graph

from _quantplug.peers.versions import verified

_TABLE = "_find_nodes_lookup_table"


@contextmanager
def generating_code(graph: Graph) -> Iterator[None]:
    """Hold while ``graph``'s module is (re)compiled; nothing else may edit ``graph`` meanwhile."""
    table = graph.__dict__.get(_TABLE)
    if table is None or not verified("torch_codegen"):
        yield
        return
    setattr(graph, _TABLE, ())  # ``node in ()`` is False: Node.__setattr__ leaves the table alone
    try:
        yield
    finally:
        setattr(graph, _TABLE, table)
