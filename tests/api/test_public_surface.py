"""The compatibility promise, checked: the public surface changes only with a record and a path.

* ``api/surface.json`` is the surface as it stands (``python -m tests.api.surface --write``
  regenerates it): a change to a public name, a signature, a hook spec or what plugins read of
  ``Quantizer`` fails here until the snapshot is updated, which a reviewer sees in the diff;
* every difference from the last release (``api/releases/VERSION.json``) is named in this
  version's section of ``CHANGELOG.md``;
* a name the release had and this version lacks still works from its old place, with a
  ``DeprecationWarning`` (for at least one minor version), and so does every module path and
  name the release's plugins, scaffold and guide imported (``vendor_imports``).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.api.surface import RELEASES, ROOT, SNAPSHOT, dumps, surface

CHANGELOG = ROOT / "CHANGELOG.md"


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in path.stem.split("."))


def _last_release() -> dict[str, Any]:
    releases = sorted(RELEASES.glob("*.json"), key=_version_key)
    assert releases, f"no release snapshot in {RELEASES}"
    return json.loads(releases[-1].read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def current() -> dict[str, Any]:
    return surface()


def _section(version: str) -> str:
    """This version's part of the changelog (from its heading to the next version's)."""
    text = CHANGELOG.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(version)}\b.*?(?=^## \d)", text, re.M | re.S)
    assert match, f"CHANGELOG.md has no section '## {version}'"
    return match.group(0)


def _flat(data: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Every surface entry by a qualified name, with the names a changelog line may use for it."""
    out: dict[str, tuple[str, Any]] = {}
    for module, names in data["modules"].items():
        for name, shape in names.items():
            out[f"{module}.{name}"] = (module, shape)
    for hook, spec in data["hookspecs"].items():
        out[f"hook {hook}"] = ("hookspecs", spec)
    for cls, members in data["read_by_plugins"].items():
        for member, shape in members.items():
            out[f"{cls}.{member}"] = (cls, shape)
    return out


def _recorded(key: str, module: str, text: str, new_modules: set[str]) -> bool:
    """Whether a changelog section names an entry: qualified, by its last part, or (an entry of a
    module new in this release) by the module."""
    last = key.rsplit(" ", 1)[-1].rsplit(".", 1)[-1]
    candidates = [key.removeprefix("hook "), last, key.split(".", 1)[-1] if "." in key else key]
    if module in new_modules:
        candidates.append(module)
    return any(re.search(rf"(?<![\w.]){re.escape(c)}(?![\w])", text) for c in candidates)


def test_the_surface_matches_its_snapshot(current: dict[str, Any]) -> None:
    stored = SNAPSHOT.read_text(encoding="utf-8") if SNAPSHOT.exists() else ""
    assert dumps(current) == stored, (
        "the public surface changed: record the change in CHANGELOG.md (with a deprecation path for "
        "anything removed or renamed), then run `python -m tests.api.surface --write` and commit "
        "api/surface.json"
    )


def test_every_change_since_the_last_release_is_in_the_changelog(current: dict[str, Any]) -> None:
    release = _last_release()
    text = _section(current["version"])
    before, after = _flat(release), _flat(current)
    new_modules = set(current["modules"]) - set(release["modules"])
    missing = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old is not None and new is not None and old[1] == new[1]:
            continue
        module = (new or old)[0]  # type: ignore[index]
        if not _recorded(key, module, text, new_modules):
            kind = "added" if old is None else "removed" if new is None else "changed"
            missing.append(f"{key} ({kind})")
    assert not missing, f"CHANGELOG.md's {current['version']} section does not name: " + ", ".join(missing)
    if current["plugin_api"] != release["plugin_api"]:
        assert f"plugin API {current['plugin_api']}" in text


def test_names_the_release_had_keep_working_with_a_deprecation_warning(current: dict[str, Any]) -> None:
    release = _last_release()
    for module, names in release["modules"].items():
        now = current["modules"].get(module, {})
        for name in names:
            if name in now:
                continue
            with pytest.warns(DeprecationWarning):
                value = getattr(importlib.import_module(module), name)
            assert value is not None, f"{module}.{name}"


def test_module_paths_and_names_the_releases_plugins_imported_still_resolve() -> None:
    """The 0.1.0 guide sent vendors to core modules; each keeps working, deprecated, until its
    removal release, and gives the very objects the public modules give."""
    import quantplug.backend as sdk
    from _quantplug import deprecated

    release = _last_release()
    for module, names in release["vendor_imports"].items():
        sys.modules.pop(module, None)
        if module in deprecated.MODULES:
            with pytest.warns(DeprecationWarning, match=re.escape(module)):
                mod = importlib.import_module(module)
        else:
            mod = importlib.import_module(module)
        for name in names:
            value = getattr(mod, name)
            if name in sdk.__all__:
                assert value is getattr(sdk, name), f"{module}.{name} is not quantplug.backend.{name}"


def _torchao_observers_loaded() -> None:
    """The accelerated torchao observers' module is made only once torchao's observers are loaded
    (torchao is no dependency); the test environment has torchao, so load them first."""
    pytest.importorskip("torchao.quantization.pt2e.observer")


def test_every_old_module_path_resolves_to_the_module_holding_its_code() -> None:
    from _quantplug import deprecated

    _torchao_observers_loaded()
    for old, new in deprecated.MODULES.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught), old
        if old in deprecated.PACKAGE_VIEWS:  # a view of the package: its attributes, but for some
            real = importlib.import_module(new)
            shown = [n for n in dir(real) if not n.startswith("__") and n not in module._views]
            assert all(getattr(module, n) is getattr(real, n) for n in shown), old
            continue
        assert module is importlib.import_module(new), old
        assert module.__spec__.name == new  # the real module keeps its own identity


def test_every_name_the_releases_modules_defined_is_still_there() -> None:
    """Beyond the documented ones: any public name a 0.1.0 core module defined (a function, a
    class, a module constant) still resolves from that module's old path."""
    _torchao_observers_loaded()
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for module, names in _last_release()["legacy_names"].items():
            mod = importlib.import_module(module)
            missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    assert not missing, "gone without a deprecation path: " + ", ".join(missing)


def test_an_old_submodule_path_does_not_hide_a_public_function() -> None:
    """``quantplug.distributed.shard`` is a function; the 0.1.0 module of that name, imported by
    its old path, must not replace it on the public module."""
    import quantplug.debug
    import quantplug.distributed

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("quantplug.distributed.shard")
        importlib.import_module("quantplug.debug.compare")
    assert callable(quantplug.distributed.shard) and not isinstance(quantplug.distributed.shard, type(sys))
    assert callable(quantplug.debug.compare) and not isinstance(quantplug.debug.compare, type(sys))


def test_python_dash_m_runs_the_command_by_its_old_and_new_paths(tmp_path: Path) -> None:
    import subprocess

    for module in ("quantplug", "quantplug.cli.main"):
        done = subprocess.run(
            [sys.executable, "-W", "ignore::DeprecationWarning", "-m", module, "--version"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 0 and "quantplug" in done.stdout, (module, done.stdout, done.stderr)


def test_the_old_hookspecs_path_shows_plugin_api_1_0s_hooks() -> None:
    """A plugin written against 0.1.0 tests that it implements every hook of
    ``quantplug.plugins.hookspecs``; the hooks 1.1 added must not break that test (found by the
    compatibility oracle: two vendor plugins' suites failed on 0.2.0 until the old path showed
    the old contract)."""
    import warnings

    from _quantplug.plugins import hookspecs as current
    from _quantplug.plugins.hookspecs_1_0 import ADDED_IN_1_1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import quantplug.plugins.hookspecs as imported  # type: ignore[import-not-found]
        from quantplug.plugins import hookspecs as imported_from  # type: ignore[attr-defined]

    def hooks(module: object) -> set[str]:
        return {n for n in vars(module) if n.startswith("quantplug_")}

    assert hooks(imported_from) == hooks(imported) == hooks(current) - ADDED_IN_1_1
    assert ADDED_IN_1_1 <= hooks(current)
    assert imported.quantplug_backend_info is current.quantplug_backend_info  # the same specs
