"""Combining what the algorithms collected on several processes (distributed calibration).

With calibration split over N processes (``quantplug.distributed.sync_observers``, ``quantplug
quantize --nproc N``, torchrun), each rank's collectors see its share of the batches. The sync
gathers every collector's :meth:`~_quantplug.algorithms.spec.MergeableCollector.state` from every
rank and calls :func:`merge_collector` on every rank with the same list, in rank order, so every
rank ends with the same collectors and converts the same program. The rules:

=====================================  ==========================================  ===========================
collector                              merged state                                against one process
=====================================  ==========================================  ===========================
``LayerHessian`` (seq_mse, adaround,   ``sum x x^T``, its shrinkage's fourth       equal up to the order of
gptq), ``Gram``                        moments and row counts added in rank order  the float64 additions
                                       (float64)
``RunningMean`` (bias_correction)      sums and counts added in rank order         the same
``InputSample``                        :func:`~_quantplug.algorithms.collectors.    a uniform sample of every
                                       merge_samples`                              rank's rows (another one)
the store of batches for sequential    :func:`~_quantplug.algorithms.sequential.    the same batches (round-
layer inputs                           merged_store`: round robin under the caps   robin sharding)
=====================================  ==========================================  ===========================

Collectors that calibration does not feed (sequential algorithms' own, which convert feeds from
the merged store; weights without a layer input) are the same on every rank and not merged. A
``LayerHessian`` that reads another's sums (:func:`~_quantplug.algorithms.weight_layers.share_hessians`)
sends an empty state and merges nothing: its leader's merge is what it reads. A fed
collector without the hook is refused by :func:`check_mergeable`, naming its algorithm and class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from _quantplug.algorithms.spec import MergeableCollector
from _quantplug.algorithms.taps import taps
from _quantplug.errors import CollectorMergeError, QuantplugError


@dataclass(frozen=True)
class FedCollector:
    """A collector that calibration feeds: the weight whose layer input it sees, its algorithm."""

    site: str
    algorithm: str
    collector: Any

    def describe(self) -> str:
        kind = class_name(self.collector)
        return f"the {kind} collector of algorithm {self.algorithm!r} for weight {self.site}"


def class_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def fed_collectors(prepared: nn.Module) -> list[FedCollector]:
    """Every collector calibration feeds, in the same order on every rank that prepared the same
    program (taps in creation order, each tap's collectors in algorithm order)."""
    found, _ = taps(prepared)
    return [
        FedCollector(tap.site, owner, collector)
        for tap in found
        for collector, owner in zip(tap.collectors, tap.owners)
    ]


def check_mergeable(prepared: nn.Module) -> None:
    """Refuse, before any rank converts with only its own share of the data, a prepared program
    with a fed collector that defines no merge hook (``state()``/``merge_(states)``).

    Raises:
        CollectorMergeError: naming the first such algorithm and collector class, the weights
            concerned and the fix.
    """
    missing: dict[tuple[str, str], list[str]] = {}
    for fed in fed_collectors(prepared):
        if not isinstance(fed.collector, MergeableCollector):
            missing.setdefault((fed.algorithm, class_name(fed.collector)), []).append(fed.site)
    if not missing:
        return
    (algorithm, kind), sites = next(iter(missing.items()))
    more = f" and {len(sites) - 1} more" if len(sites) > 1 else ""
    others = f"; also: {', '.join(f'{a!r} ({k})' for a, k in list(missing)[1:])}" if len(missing) > 1 else ""
    raise CollectorMergeError(
        f"algorithm {algorithm!r} collects with {kind} (weight {sites[0]}{more}), which defines no "
        "state()/merge_(states), so its statistics cannot be combined across processes: each rank "
        "would convert with its own share of the calibration data. Define state() and merge_(states) on "
        f"{kind.rsplit('.', 1)[-1]} (the quantplug.MergeableCollector protocol; see 'Collectors across "
        "processes' in quantplug/algorithms/README.md), or calibrate on one process (no --nproc, no "
        f"torchrun){others}"
    )


def merge_collector(fed: FedCollector, states: Sequence[Any]) -> None:
    """Make ``fed``'s collector the merge of ``states`` (every rank's, in rank order).

    Raises:
        CollectorMergeError: the collector's ``merge_`` failed (states that do not fit together).
    """
    try:
        fed.collector.merge_(list(states))
    except QuantplugError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CollectorMergeError(
            f"merging {fed.describe()} across processes failed: {first}; did every rank prepare the same "
            "program with the same algorithms and options?"
        ) from exc


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a state (what a merge round holds per rank)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def on_cpu(state: Any) -> Any:
    """A state with every tensor on the CPU (what travels to the other ranks)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    if isinstance(state, tuple):
        items = [on_cpu(v) for v in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state
