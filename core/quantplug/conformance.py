"""The backend conformance kit: what every quantplug backend must do for its users.

Run it from the command line (``quantplug conformance NAME [--json]``), from pytest
(``pytest --quantplug-conformance=NAME``, or the ``quantplug_conformance`` ini option; the plugin
ships with quantplug), or from Python::

    from quantplug.conformance import run_conformance

    report = run_conformance("my_chip")
    assert report.ok, report.format()

The kit judges the backend as installed: its own plugin and the extensions installed for it.
An installed backend is checked in a fresh interpreter of the kit's own, started from the
environment (for the pytest plugin: the one pytest was started in), so nothing the caller or a
test session registers in-process, puts on ``sys.path`` or sets in ``os.environ`` plays a part;
a backend registered in-process (``quantplug.registered_backend``) exists only in the calling
process and is checked there (its report says ``(in-process)``). Plugin code that raises, calls
``sys.exit``, raises KeyboardInterrupt, ends its process or runs past ``timeout`` seconds fails
the check it ran in, naming the hook and the line; only the user's Ctrl-C stops the run.

A backend states what it does not support, and what its artifact contains, in a
:class:`ConformanceProfile` returned from its ``quantplug_conformance_profile`` hook.
"""

from __future__ import annotations

from _quantplug import lazy as _lazy

_DECLARATION: dict[str, tuple[str, ...]] = {
    "_quantplug.conformance.profile": ("CAPABILITIES", "ConformanceProfile"),
    "_quantplug.conformance.runner": ("run_conformance",),
    "_quantplug.conformance.checks": ("CHECKS",),
    "_quantplug.conformance.report": ("ConformanceReport",),
}

__path__: list[str] = []  # the 0.1.0 submodules (quantplug.conformance.profile ...) resolve, deprecated
__all__ = _lazy.install(__name__, _DECLARATION)
