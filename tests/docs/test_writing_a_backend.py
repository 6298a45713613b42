"""Every code block of ``docs/writing-a-backend.md`` runs, so the guide cannot drift.

Blocks are classified by language and by what precedes them:

* ``python`` blocks preceded by *(example plugin, `path`)* are quotes: they must appear verbatim
  in that file of ``tests/example_plugin`` and they are executed in (a copy of) that module's
  namespace;
* ``python`` blocks made only of definitions with ``...`` bodies are listings of the real API:
  each listed dataclass must have the real one's fields and defaults, each listed method or
  property must exist, each listed function or hook spec must have the real signature (and hook
  options);
* every other ``python`` block is an example: all run in order in one namespace, in a scratch
  working folder, after the shell blocks before them;
* ``bash`` blocks run in the same scratch folder, with ``quantplug`` and ``python`` from this
  environment and ``pip install`` redirected to a throwaway ``--target`` on ``PYTHONPATH``
  (nothing is installed into the test environment);
* ``toml`` blocks parse, and quotes equal their file (the whole file) or appear in it verbatim.

Any other language fails: a block this test cannot run must not be in the guide.
"""

from __future__ import annotations
import __future__

import ast
import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

import quantplug
from _quantplug.plugins import hookspecs, registry
from _quantplug.scaffold import render

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "writing-a-backend.md"
EXAMPLE = REPO / "tests" / "example_plugin"
LANGUAGES = {"python", "bash", "toml"}

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"\*\((?P<kind>example plugin|scaffold), `(?P<path>[^`]+)`")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    quote: tuple[str, str] | None  # (kind, path)

    def where(self) -> str:
        return f"{GUIDE.name}:{self.line}"


def blocks() -> list[Block]:
    lines = GUIDE.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if start is None or not start["lang"]:
            i += 1
            continue
        indent = start["indent"]
        body: list[str] = []
        j = i + 1
        while lines[j].strip() != "```":
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append(Block(start["lang"], "\n".join(body) + "\n", i + 1, _marker(lines, i)))
        i = j + 1
    return found


def _marker(lines: list[str], fence: int) -> tuple[str, str] | None:
    """The *(example plugin, `path`)* marker of the paragraph right above a fence, if any."""
    k = fence - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    paragraph: list[str] = []
    while k >= 0 and lines[k].strip() and not lines[k].strip().startswith("```"):
        paragraph.insert(0, lines[k])
        k -= 1
    match = MARKER.search(" ".join(paragraph))
    return (match["kind"], match["path"]) if match else None


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines())


def _quoted_file(block: Block) -> str:
    assert block.quote is not None
    kind, path = block.quote
    if kind == "scaffold":
        return render("my_npu")[path]
    return (EXAMPLE / path).read_text()


def _module_of(path: str) -> Any:
    return importlib.import_module(path.removesuffix(".py").replace("/", ".").removesuffix(".__init__"))


def _is_listing(code: str) -> bool:
    """Only class and function definitions, every function body ``...``: an API listing."""
    tree = ast.parse(code)
    if not tree.body or not all(isinstance(n, (ast.ClassDef, ast.FunctionDef)) for n in tree.body):
        return False
    return all(
        len(f.body) == 1
        and isinstance(f.body[0], ast.Expr)
        and isinstance(f.body[0].value, ast.Constant)
        and f.body[0].value.value is Ellipsis
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
    )


GUIDE_BLOCKS = blocks()


def test_the_guide_has_only_blocks_this_test_runs() -> None:
    assert GUIDE_BLOCKS, "no code blocks found"
    unknown = [f"{b.where()} ({b.lang})" for b in GUIDE_BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"blocks no test runs: {unknown}"


@pytest.mark.parametrize("block", [b for b in GUIDE_BLOCKS if b.quote], ids=lambda b: b.where())
def test_quoted_blocks_match_their_files(block: Block) -> None:
    source = _quoted_file(block)
    if block.lang == "toml" and block.quote and block.quote[0] == "example plugin":
        assert tomllib.loads(block.code) == tomllib.loads(source), (
            f"{block.where()} differs from {block.quote[1]}"
        )
        return
    assert _normalized(block.code).strip() in _normalized(source), (
        f"{block.where()} is not (any more) in {block.quote}: update the guide"
    )
    if block.lang == "toml":
        tomllib.loads(block.code)


LISTING_NAMESPACE: dict[str, Any] = {
    "dataclass": dataclasses.dataclass,
    "field": dataclasses.field,
    "hookspec": hookspecs.hookspec,
    "QuantizationSpecBase": object,
}


def _real(name: str) -> Any:
    if name.startswith("quantplug_"):
        return getattr(hookspecs, name)
    return getattr(quantplug, name)


def _fields(cls: type) -> list[tuple[str, Any]]:
    result = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = ("factory", f.default_factory())
        else:
            default = "required"
        result.append((f.name, default))
    return result


def _compare_listing(name: str, listed: Any, block: Block) -> None:
    real = _real(name)
    where = f"{block.where()}: {name}"
    if inspect.isclass(listed):
        assert _fields(listed) == _fields(real), f"{where}: fields differ from the real dataclass"
        for attr, value in vars(listed).items():
            if attr.startswith("__") or attr in {f.name for f in dataclasses.fields(listed)}:
                continue
            if callable(value) or isinstance(value, property):
                assert hasattr(real, attr), f"{where}: the real class has no {attr!r}"
                if callable(value) and not isinstance(value, property):
                    listed_params = list(inspect.signature(value).parameters)
                    assert listed_params == list(inspect.signature(getattr(real, attr)).parameters), (
                        f"{where}.{attr}: parameters differ"
                    )
        return
    listed_sig, real_sig = inspect.signature(listed), inspect.signature(real)
    assert [(p.name, p.kind, repr(p.default)) for p in listed_sig.parameters.values()] == [
        (p.name, p.kind, repr(p.default)) for p in real_sig.parameters.values()
    ], f"{where}: signature differs"
    spec = getattr(listed, "quantplug_spec", None)
    if spec is not None:
        assert spec == real.quantplug_spec, f"{where}: hook options differ"


@pytest.mark.parametrize(
    "block",
    [b for b in GUIDE_BLOCKS if b.lang == "python" and not b.quote and _is_listing(b.code)],
    ids=lambda b: b.where(),
)
def test_listings_match_the_code(block: Block) -> None:
    namespace = dict(LISTING_NAMESPACE)
    flags = __future__.annotations.compiler_flag
    exec(compile(block.code, block.where(), "exec", flags=flags, dont_inherit=True), namespace)
    names = [n.name for n in ast.parse(block.code).body]  # type: ignore[attr-defined]
    for name in names:
        _compare_listing(name, namespace[name], block)


def _shell_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    env["QP_SITE"] = str(site)
    return env


#: ``pip install [-e] X`` installs X without dependencies into the throwaway ``$QP_SITE``
PIP_SHIM = textwrap.dedent(
    """
    pip() {
      if [ "$1" = install ]; then
        shift
        args=()
        for a in "$@"; do [ "$a" = -e ] || args+=("$a"); done
        command python -m pip install -q --no-deps --no-build-isolation --target "$QP_SITE" "${args[@]}"
      else
        command python -m pip "$@"
      fi
    }
    """
)


def test_the_guide_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shell and example blocks in order (one Python namespace), quotes in their modules."""
    work = tmp_path / "work"
    site = tmp_path / "site"
    work.mkdir()
    site.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(site))
    for key in [k for k in os.environ if k.startswith("QUANTPLUG_")]:
        monkeypatch.delenv(key)
    registry.reset_cache()
    namespace: dict[str, Any] = {"__name__": "guide"}
    scaffolded = ""
    try:
        for block in GUIDE_BLOCKS:
            if block.lang == "bash":
                done = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", PIP_SHIM + block.code],
                    cwd=work,
                    env=_shell_env(site),
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    check=False,
                )
                assert done.returncode == 0, (
                    f"{block.where()} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
                )
                registry.reset_cache()  # it installed something: re-read the entry points
                if "quantplug new-backend" in block.code:
                    scaffolded = done.stdout
            elif block.lang == "python" and block.quote:
                module = _module_of(block.quote[1])
                exec(compile(block.code, block.where(), "exec"), dict(vars(module)))
            elif block.lang == "python" and not _is_listing(block.code):
                exec(compile(block.code, block.where(), "exec", dont_inherit=True), namespace)
    finally:
        registry.reset_cache()
    assert (work / "out" / "example_vendor_encodings.json").is_file()
    assert (work / "quantplug-my-npu" / "quantplug_my_npu" / "constraints.py").is_file()
    _check_the_scaffold_as_installed(scaffolded, site)


def _check_the_scaffold_as_installed(stdout: str, site: Path) -> None:
    """The guide's first steps are the scaffold's promise (tests/conformance/test_scaffold.py
    leaves it here rather than run it twice): ``quantplug new-backend``'s distribution installs,
    conforms as generated (every check passes: none skipped) and passes its own tests, three
    end-to-end tests and one per check of the kit (its pytest plugin)."""
    assert stdout, "the guide no longer scaffolds, installs and checks a backend in one shell block"
    assert (site / "quantplug_my_npu" / "plugin.py").is_file()
    assert "backend 'my_npu' (quantplug-my-npu 0.1.0)" in stdout, stdout
    summary = re.search(r"^(\d+) checks: (\d+) passed, 0 failed, 0 skipped -> CONFORMS$", stdout, re.M)
    assert summary and summary[1] == summary[2], stdout
    assert re.search(r"^16 passed", stdout, re.M), stdout
