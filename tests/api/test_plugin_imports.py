"""Plugins are written against ``quantplug.backend`` and ``quantplug``, nothing else of the core.

Checked on every place a vendor copies plugin code from: our two plugins, the example plugin,
the files ``quantplug new-backend`` writes, and every Python block of the guide. An import of any
other quantplug module (``quantplug.observers.minmax``, ``_quantplug.meta`` ...) ties a plugin to
the core's internals, which may change in any release.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"quantplug", "quantplug.backend"}
#: a plugin's tests may also use the other public modules (the kit, the debugger)
PUBLIC = ALLOWED | {"quantplug.conformance", "quantplug.debug", "quantplug.distributed"}
PLUGIN_DIRS = [
    ROOT / "plugins" / "reference",
    ROOT / "plugins" / "qnn_htp",
    ROOT / "tests" / "example_plugin",
]


def _imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a quantplug module in ``source``, at any depth."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            if node.module == "quantplug":  # `from quantplug import debug` imports a module too
                modules += [f"quantplug.{a.name}" for a in node.names if a.name in _SUBMODULES]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] in ("quantplug", "_quantplug"):
                yield node.lineno, module


#: names ``from quantplug import X`` could use to reach a module other than the SDK
_SUBMODULES = {"debug", "distributed", "conformance", "algorithms", "flow", "observers", "cli", "report"}


def _bad(source: str, allowed: set[str] = ALLOWED) -> list[str]:
    return [f"line {line}: {module}" for line, module in _imports(source) if module not in allowed]


def _plugin_files() -> list[Path]:
    return sorted(p for d in PLUGIN_DIRS for p in d.rglob("*.py") if "tests" not in p.relative_to(d).parts)


@pytest.mark.parametrize("path", _plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugin_modules_import_only_the_sdk(path: Path) -> None:
    assert not _bad(path.read_text(encoding="utf-8")), f"{path.relative_to(ROOT)}: {_bad(path.read_text())}"


def test_the_scaffold_writes_plugins_that_import_only_the_sdk() -> None:
    from _quantplug.scaffold.templates import FILES

    for name, text in FILES.items():
        if not name.endswith(".py"):
            continue
        source = re.sub(r"\{\{\w+\}\}", "pkg", text)
        bad = [b for b in _bad(source) if "tests/" not in name]
        assert not bad, f"scaffold {name}: {bad}"


def test_the_guides_code_imports_only_the_sdk() -> None:
    text = (ROOT / "docs" / "writing-a-backend.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    bad = [f"block {i}: {b}" for i, block in enumerate(blocks) for b in _bad(block, PUBLIC)]
    assert not bad, "docs/writing-a-backend.md: " + "; ".join(bad)


def test_the_check_catches_a_private_import() -> None:
    assert _bad("from quantplug.observers.minmax import MinMaxObserver") == [
        "line 1: quantplug.observers.minmax"
    ]
    assert _bad("def f():\n    import _quantplug.meta\n") == ["line 2: _quantplug.meta"]
    assert _bad("from quantplug import debug") == ["line 1: quantplug.debug"]
    assert not _bad("import quantplug\nfrom quantplug.backend import hookimpl\nfrom quantplug import prepare")


#: a dotted name below ``quantplug`` in text (``quantplug.flow.inspect.encodings``)
_DOTTED = re.compile(r"\bquantplug(?:\.[A-Za-z_]\w*)+")


def _old_paths(text: str) -> list[str]:
    """Every dotted name in ``text`` that reaches into a 0.1.0 module path (deprecated since 0.2.0)."""
    from _quantplug.deprecated import MODULES

    found = []
    for match in _DOTTED.finditer(text):
        parts = match.group().split(".")
        if any(".".join(parts[:n]) in MODULES for n in range(2, len(parts) + 1)):
            found.append(match.group())
    return found


def test_the_guide_sends_vendors_to_no_deprecated_module_path() -> None:
    """Prose too: the guide names the SDK's functions (``prepared_state(prepared)``), never the
    0.1.0 paths (``quantplug.flow.prepare.STATE_KEY``) that work only until their removal."""
    text = (ROOT / "docs" / "writing-a-backend.md").read_text(encoding="utf-8")
    assert not _old_paths(text), f"docs/writing-a-backend.md names deprecated paths: {_old_paths(text)}"


def test_the_check_catches_a_deprecated_path_in_prose() -> None:
    assert _old_paths("read `prepared.meta[quantplug.flow.prepare.STATE_KEY]` or quantplug.observers") == [
        "quantplug.flow.prepare.STATE_KEY",
        "quantplug.observers",
    ]
    assert not _old_paths("`quantplug.backend.encodings`, quantplug.get_quantizer, `quantplug.conformance`")
