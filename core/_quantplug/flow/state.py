"""What prepare leaves for convert: the sharing groups and the prepared state (``gm.meta[STATE_KEY]``)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.fx import GraphModule, Node

from _quantplug.meta import observer_target
from _quantplug.sharing.resolution import Key, describe_key
from _quantplug.validation.engine import CalibratedPlan
from _quantplug.validation.report import ValidationReport


@dataclass
class Group:
    """One sharing group: its spec, its keys, and whether only parameters/buffers flow through it.

    ``constant`` groups are quantized at convert from the parameters' values (their observer's
    node in the prepared graph, which the weight's readers read, passes the weight through during
    calibration, see :mod:`_quantplug.observers.parked`); in QAT no group is, since training
    changes the weights.
    """

    gid: int
    spec: Any
    keys: list[Key]
    constant: bool
    dynamic: bool
    #: its observer's calls in one forward pass make one update (``SharingGroups.observed_per_pass``)
    per_pass: bool = False
    #: a float spec's group (``annotation.spec_view.is_float_spec``): its tensors stay floating
    #: point, no qparams; convert drops its observer (float16: a cast to half and back)
    floating: bool = False

    @property
    def target(self) -> str:
        """Its observer's attribute name on the prepared module (``activation_post_process_N``)."""
        return observer_target(self.gid)

    def describe(self) -> str:
        shown = ", ".join(describe_key(k) for k in self.keys[:3])
        more = f" and {len(self.keys) - 3} more" if len(self.keys) > 3 else ""
        return shown + more


@dataclass
class PreparedState:
    """What convert() needs beyond the prepared graph itself (kept in ``gm.meta``)."""

    groups: list[Group]
    group_of: dict[Key, int]
    qat: bool
    backend: str | None
    validation: ValidationReport | None = None
    #: the constraint checks convert runs on the calibrated encodings (constraints v2)
    calibrated_checks: CalibratedPlan | None = None
    #: keys of constant groups, quantized by convert as observers would have been:
    #: node outputs (name -> group id) and input edges ((producer, consumer) -> group id)
    constant_outputs: dict[str, int] = field(default_factory=dict)
    constant_edges: dict[tuple[str, str], int] = field(default_factory=dict)

    def observer(self, gm: GraphModule, gid: int) -> nn.Module:
        return getattr(gm, observer_target(gid))

    def __deepcopy__(self, memo: dict[Any, Any]) -> PreparedState:
        """A copy whose specs name graph nodes without copying them.

        A derived spec's ``derived_from`` holds nodes of the annotated graph; deep-copying one
        follows its neighbours through the whole graph to the fake tensors of ``meta["val"]``,
        which refuse to be copied, so ``copy.deepcopy(prepared)`` failed. Each node becomes the
        copied graph's node where ``GraphModule.__deepcopy__`` already copied the graph (its
        ``graph_copy`` records old -> new nodes in ``memo``), else stays itself, as torch's
        ``graph_copy`` keeps the nodes inside ``node.meta``'s annotations. Convert reads them
        only through their names (sharing keys), which the copy keeps.
        """
        for node in _nodes_in(self.groups):
            memo.setdefault(id(node), memo.get(node, node))
        twin = PreparedState.__new__(PreparedState)
        memo[id(self)] = twin
        for f in dataclasses.fields(self):
            setattr(twin, f.name, copy.deepcopy(getattr(self, f.name), memo))
        return twin


def _nodes_in(value: Any) -> list[Node]:
    """The fx nodes held by ``value``, through dataclasses, lists, tuples, sets and dicts."""
    found: list[Node] = []
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Node):
            found.append(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    return found
