"""The hook specifications as plugin API 1.0 (quantplug 0.1.0) defined them, for 0.1.0's module
path ``quantplug.plugins.hookspecs`` (deprecated, see :mod:`_quantplug.deprecated`).

Plugins written against 0.1.0 read that module to list the hooks (``vars(hookspecs)``) and test
that they implement every one: the hooks plugin API 1.1 added (:data:`ADDED_IN_1_1`) would make
those tests fail although nothing they implement changed. The old path therefore shows the old
contract; every function and object in it is the current module's own (the same specs).
"""

from __future__ import annotations

from typing import Any

from _quantplug.plugins import hookspecs as _current

#: hook specs plugin API 1.1 added (CHANGELOG 0.2.0); ``quantplug.backend`` lists them all
ADDED_IN_1_1 = frozenset({"quantplug_annotation_passes", "quantplug_io_config"})


def _names() -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(_current).items()
        if name not in ADDED_IN_1_1 and not (name.startswith("__") and name.endswith("__"))
    }


globals().update(_names())
