"""datasette's rule for plugin hooks: every hook is tested, and documented argument by argument.

For every hook specification in ``_quantplug.plugins.hookspecs`` (each function pluggy reads as a
spec: named ``quantplug_*``, carrying the ``quantplug_spec`` marker):

(a) a test function somewhere under ``tests/`` has the hook's name in its own name, with or
    without the ``quantplug_`` prefix (``test_io_config_...`` for ``quantplug_io_config``);
(b) ``docs/writing-a-backend.md`` has a heading naming the hook (in backquotes), and the text under
    that heading (down to the next heading of the same or a higher level, code blocks left out)
    names each argument of the hook in backquotes (`` `context` ``).

A hook added without either fails here, naming what is missing.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from _quantplug.plugins import hookspecs

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "writing-a-backend.md"
PREFIX = "quantplug_"


def hook_specs() -> dict[str, list[str]]:
    """Hook name -> its arguments, for every spec pluggy registers from the module."""
    marker = f"{hookspecs.PROJECT}_spec"
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in sorted(vars(hookspecs).items())
        if name.startswith(PREFIX) and callable(fn) and hasattr(fn, marker)
    }


HOOKS = hook_specs()


@cache
def names_of_tests() -> frozenset[str]:
    """The name of every test function (module level or in a class) of every test file under tests/."""
    names: set[str] = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                names.add(node.name)
    return frozenset(names)


def untested(hook: str, names: frozenset[str]) -> bool:
    """No test function's name contains the hook's name (the ``quantplug_`` prefix optional)."""
    return not any(hook.removeprefix(PREFIX) in name for name in names)


@dataclass(frozen=True)
class Section:
    """A heading of the guide and the prose under it (code blocks left out)."""

    heading: str
    prose: str


HEADING = re.compile(r"^(?P<level>#{1,6})\s+(?P<text>.+?)\s*$")
FENCE = re.compile(r"^\s*```")


def sections(markdown: str) -> list[Section]:
    """Every heading with the prose down to the next heading of the same or a higher level."""
    lines = markdown.splitlines()
    headings: list[tuple[int, int, str]] = []  # (line index, level, text)
    prose: list[str] = []  # each line, or "" inside a code block
    in_code = False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            in_code = not in_code
            prose.append("")
            continue
        prose.append("" if in_code else line)
        match = None if in_code else HEADING.match(line)
        if match:
            headings.append((i, len(match["level"]), match["text"]))
    found = []
    for k, (start, level, text) in enumerate(headings):
        end = next((i for i, lv, _ in headings[k + 1 :] if lv <= level), len(lines))
        found.append(Section(text, "\n".join(prose[start + 1 : end])))
    return found


def documentation_problem(hook: str, arguments: list[str], guide: list[Section]) -> str | None:
    """Why the guide does not document ``hook`` by datasette's rule, or None when it does."""
    named = [s for s in guide if re.search(rf"`{hook}\b", s.heading)]
    if not named:
        return f"no heading of {GUIDE.name} names `{hook}`"
    for section in named:
        missing = [a for a in arguments if not re.search(rf"`{a}`", section.prose)]
        if not missing:
            return None
    return f"under the heading {named[0].heading!r}, {GUIDE.name} does not name argument(s) " + ", ".join(
        f"`{a}`" for a in missing
    )


def test_the_hook_specs_are_found() -> None:
    assert {"quantplug_backend_info", "quantplug_annotation_passes", "quantplug_io_config"} <= set(HOOKS)
    assert HOOKS["quantplug_resolve_sharing"] == ["problem", "resolve", "context"]


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test_named_after_it(hook: str) -> None:
    assert not untested(hook, names_of_tests()), (
        f"no test under tests/ has {hook.removeprefix(PREFIX)!r} in its name: write one that runs {hook} "
        "on a real program (see tests/core/test_hook_contract.py)"
    )


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_heading_in_the_guide_naming_each_argument(hook: str) -> None:
    problem = documentation_problem(hook, HOOKS[hook], sections(GUIDE.read_text(encoding="utf-8")))
    assert problem is None, problem


def test_the_rule_catches_a_hook_without_a_test_or_documentation() -> None:
    assert untested("quantplug_made_up", frozenset({"test_made_down", "test_io_config_x"}))
    assert not untested("quantplug_made_up", frozenset({"test_made_up_works"}))
    guide = sections(
        "## 1. Hooks\n\n### `quantplug_made_up(problem, context)`\n\n- `problem`: what to solve\n"
        "```python\ncontext = 1  # `context` in code does not count\n```\n"
        "### Next\n\n`context` is named under another heading\n"
    )
    assert documentation_problem("quantplug_made_up", ["problem", "context"], guide) == (
        "under the heading '`quantplug_made_up(problem, context)`', writing-a-backend.md does not "
        "name argument(s) `context`"
    )
    assert documentation_problem("quantplug_other", [], guide) == (
        "no heading of writing-a-backend.md names `quantplug_other`"
    )
    assert documentation_problem("quantplug_made_up", ["problem"], guide) is None
