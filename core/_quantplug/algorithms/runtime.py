"""The 0.1.0 module ``quantplug.algorithms.runtime``, split by phase in 0.2.0: its names, kept for
that deprecated path (:mod:`_quantplug.deprecated`) until 0.4.0. quantplug itself imports the
phase modules:

* :mod:`_quantplug.algorithms.sites` -- the weight sites both phases find on the prepared graph;
* :mod:`_quantplug.algorithms.transforms` -- prepare, before annotation: ``transform_program``;
* :mod:`_quantplug.algorithms.taps` -- prepare, after the observers: the collectors' taps;
* :mod:`_quantplug.algorithms.weight_choice` -- convert: ``choose_weight``, checked and guarded.
"""

from __future__ import annotations

from _quantplug.algorithms.guard import flat_batches
from _quantplug.algorithms.sites import weight_sites
from _quantplug.algorithms.spec import algorithm_name, is_sequential
from _quantplug.algorithms.taps import (
    AlgorithmRun,
    ExpertsTap,
    RecurrentFeeds,
    RecurrentTap,
    Tap,
    install_collectors,
    is_tap,
    taps,
)
from _quantplug.algorithms.transforms import run_transforms
from _quantplug.algorithms.weight_choice import (
    WeightOverrides,
    choose_weights,
    underdetermined_layers,
    warn_ignored,
    warn_underdetermined,
)
from _quantplug.graph.op_names import LAYER_OPS
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from _quantplug.meta import TAPS

__all__ = [
    "LAYER_OPS",
    "RUN_KEY",
    "TAPS",
    "AlgorithmRun",
    "ExpertsTap",
    "RecurrentFeeds",
    "RecurrentTap",
    "Tap",
    "WeightOverrides",
    "algorithm_name",
    "choose_weights",
    "flat_batches",
    "install_collectors",
    "is_sequential",
    "is_tap",
    "run_transforms",
    "taps",
    "underdetermined_layers",
    "warn_ignored",
    "warn_underdetermined",
    "weight_sites",
]
