"""The version of the plugin contract, and what a backend may require of it.

The contract is what ``quantplug.backend`` exports and the hook specifications. Its version is
``MAJOR.MINOR``: a minor release adds (hooks, arguments a hook may take, SDK names, optional
fields); only a major release removes, and only what was deprecated for at least one minor
release before (``CHANGELOG.md``, ``_quantplug.deprecated``). A backend states the version it was
written against with ``BackendInfo(requires_api="1.1")`` or in its metadata file; an older
quantplug then refuses to load it with a message saying which version to install, instead of
failing on a missing name somewhere in the middle of a run.

Versions: 1.0 (quantplug 0.1.0), 1.1 (quantplug 0.2.0: ``quantplug.backend``, the whole-graph
annotation hook, backend node data, conditional fusion, input/output specs).
"""

from __future__ import annotations

from _quantplug.errors import OptionError

PLUGIN_API_VERSION = "1.1"


def parse_version(text: str) -> tuple[int, int]:
    """``"1.1"`` -> ``(1, 1)``; ``"1"`` means ``1.0``."""
    parts = str(text).strip().split(".")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise OptionError(f"a plugin API version is MAJOR or MAJOR.MINOR (e.g. '1.1'), got {text!r}")
    major, minor = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    return major, minor


def api_problem(required: str | None, *, provided: str = PLUGIN_API_VERSION) -> str | None:
    """Why ``provided`` does not satisfy a backend requiring ``required`` (None: it does).

    Same major version, and a minor version at least the required one: minor releases only add.
    """
    if not required:
        return None
    want, have = parse_version(required), parse_version(provided)
    if want[0] != have[0]:
        return (
            f"it was written for plugin API {required} and this quantplug provides {provided} "
            f"(a different major version): install a quantplug whose PLUGIN_API_VERSION is {want[0]}.x"
        )
    if want[1] > have[1]:
        return (
            f"it needs plugin API {required} and this quantplug provides {provided}: upgrade quantplug "
            "(pip install -U quantplug)"
        )
    return None


def require_api(version: str) -> None:
    """Raise ``OptionError`` unless this quantplug provides plugin API ``version`` (or a later minor).

    For a plugin module that needs a name added in a minor release, at its top, so an old
    quantplug fails at once with the fix in the message::

        from quantplug.backend import require_api
        require_api("1.1")
    """
    problem = api_problem(version)
    if problem is not None:
        raise OptionError(f"this plugin cannot run here: {problem}")
