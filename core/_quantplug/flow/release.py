"""``convert(prepared, release_float_weights=True)``: the prepared module gives up its float weights.

Why: at LLM scale the float weights are most of what a flow holds, and after convert only the
integers are needed. The prepared module shares the float parameters with the exported program
(and the caller's model), so once a caller has dropped those, the prepared module's references are
the last ones: convert drops each as soon as the weight's integers are written, and the memory
comes back weight by weight instead of after convert (at 110M parameters, the float weights and
every weight's integers were held at once).

Only the prepared module's own references are dropped (its attributes, the holders prepare built);
the caller's model and exported program keep theirs, so a caller still holding them frees nothing
and loses nothing. What the converted program reads float (norms, biases kept float, parameters no
annotation quantizes) it holds itself. The prepared module is consumed: using it again (a forward,
calibration, convert, an algorithm's pass) raises a :class:`ConversionError` saying so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from _quantplug.algorithms.taps import AlgorithmRun, is_tap
from _quantplug.errors import ConversionError
from _quantplug.flow.state import PreparedState
from _quantplug.meta import ALGORITHMS_KEY, RELEASED_KEY, observer_gid

OPTION = "release_float_weights"


def refuse_released(module: Any, doing: str) -> None:
    """Raise if ``module`` is a prepared module a ``release_float_weights`` convert consumed."""
    meta = getattr(module, "meta", None)
    if isinstance(meta, dict) and meta.get(RELEASED_KEY):
        raise _consumed(doing)


def _consumed(doing: str) -> ConversionError:
    return ConversionError(
        f"cannot {doing}: this prepared module was consumed by convert({OPTION}=True), which "
        "released its float weights; prepare the exported program again (quantplug.prepare(ep, "
        f"quantizer)) and calibrate it, or convert without {OPTION} to keep using the prepared module"
    )


class _Consumed:
    """The forward of a consumed prepared module: a typed error, not a missing attribute."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _consumed("run this prepared module (calibration, an algorithm's pass)")


class FloatWeightRelease:
    """Drops ``prepared``'s reference to each float weight once every reader of it is served by
    integers (:meth:`written`), and the rest when convert is done (:meth:`finish`)."""

    def __init__(self, prepared: GraphModule, state: PreparedState) -> None:
        self.prepared = prepared
        #: get_attr target -> the (get_attr node, consumer) edges still reading it as float; the
        #: parked observers of constant groups and algorithms' taps read nothing in the converted
        #: program (convert drops them), so they are no readers
        self.readers: dict[str, set[tuple[str, str]]] = {}
        for node in prepared.graph.nodes:
            if node.op == "get_attr":
                edges = self.readers.setdefault(str(node.target), set())
                edges.update((node.name, user.name) for user in node.users if not _dropped(user, state))

    def written(self, producer: Node, user: Node) -> None:
        """``user`` reads ``producer``'s integers: the float weight goes once no reader is left."""
        target = str(producer.target)
        edges = self.readers.get(target)
        if edges is None:
            return
        edges.discard((producer.name, user.name))
        if not edges:
            del self.readers[target]
            _drop(self.prepared, target, keep=set())

    def finish(self, prepared: GraphModule, converted: nn.Module) -> None:
        """Drop ``prepared``'s remaining tensor attributes and what its algorithms gathered, and
        mark it consumed.

        Holders the converted program shares (a subgraph module it runs) keep theirs.
        """
        keep = {id(m) for m in converted.modules()}
        for node in prepared.graph.nodes:
            if node.op == "get_attr":
                _drop(prepared, str(node.target), keep)
        run = prepared.meta.get(ALGORITHMS_KEY)
        if isinstance(run, AlgorithmRun):
            run.release_statistics(prepared)
        consume(prepared)


def consume(prepared: GraphModule) -> None:
    """Mark ``prepared`` consumed: convert, calibration and algorithms refuse it from now on."""
    prepared.meta[RELEASED_KEY] = True
    prepared.forward = _Consumed()  # type: ignore[method-assign]


def _dropped(node: Node, state: PreparedState) -> bool:
    """A node convert leaves out of the converted program: a constant group's parked observer or
    an algorithm's calibration tap."""
    if is_tap(node):
        return True
    gid = observer_gid(node.target) if node.op == "call_module" else None
    return gid is not None and state.groups[gid].constant


def _drop(prepared: GraphModule, target: str, keep: set[int]) -> None:
    """Delete the tensor attribute at ``target`` from its holder on ``prepared`` (not from
    holders in ``keep``; a missing or non-tensor attribute is left alone)."""
    path, _, name = target.rpartition(".")
    try:
        holder = prepared.get_submodule(path)
    except AttributeError:
        return
    if id(holder) in keep or not isinstance(getattr(holder, name, None), torch.Tensor):
        return
    delattr(holder, name)
