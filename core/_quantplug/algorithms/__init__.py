"""Accuracy algorithms as plugins (issue 15): the protocol, the registry, the built-ins.

* :mod:`_quantplug.algorithms.spec` -- the algorithm protocol (hooks, sites, grids, choices);
* :mod:`_quantplug.algorithms.registry` -- discovery by name (entry-point group
  ``quantplug.algorithms``), listing without importing, lazy loading;
* :mod:`_quantplug.algorithms.config` -- ``Algorithms``: what prepare runs, with its data and guard;
* where prepare and convert call the hooks, by phase: :mod:`~_quantplug.algorithms.transforms`
  (before annotation), :mod:`~_quantplug.algorithms.taps` (the collectors' taps),
  :mod:`~_quantplug.algorithms.weight_choice` (convert), over the weight sites of
  :mod:`~_quantplug.algorithms.sites`; :mod:`~_quantplug.algorithms.guard` judges them;
* :mod:`_quantplug.algorithms.merge` -- collectors combined across processes (distributed calibration);
* one module per built-in algorithm (``cle``, ``bias_correction``, ``smoothquant``, ...).

Importing this package imports neither torch nor any algorithm.
"""
