"""Accuracy algorithms as plugins (issue 15): the protocol, the registry, the built-ins.

* :mod:`_quantplug.algorithms.spec` -- the algorithm protocol (hooks, sites, grids, choices);
* :mod:`_quantplug.algorithms.registry` -- discovery by name (entry-point group
  ``quantplug.algorithms``), listing without importing, lazy loading;
* :mod:`_quantplug.algorithms.runtime` -- where prepare/convert call the hooks;
* :mod:`_quantplug.algorithms.merge` -- collectors combined across processes (distributed calibration);
* one module per built-in algorithm (``cle``, ``bias_correction``, ``smoothquant``, ...).

Importing this package imports neither torch nor any algorithm.
"""
