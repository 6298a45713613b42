"""A rules package's index: the ops each module covers, declared once (``register_annotator``),
read without importing any module (``rules_from_index``), written and checked by ``quantplug
metadata`` as a vendor runs it (and, for this repository, by ``scripts/generate.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _quantplug.quantizer.rules_index import (
    RulesIndexError,
    drift,
    expected_index,
    packages_read_by,
    registered_ops,
)
from quantplug.backend import rules_from_index
from tests.cli.conftest import clean_env

PLUGIN = """\
import quantplug
from quantplug.backend import BackendInfo, BackendOption, rules_from_index


@quantplug.hookimpl
def quantplug_backend_info():
    return BackendInfo("idx", "an indexed vendor", options=(BackendOption("level", int, 2),))


@quantplug.hookimpl
def quantplug_annotation_rules(context):
    return rules_from_index("idx_vendor.rules")
"""

RULES = {
    "act_rules.py": """\
from quantplug.backend import annotate_single_in_single_out, register_annotator


@register_annotator(["aten.relu.default", "aten.sigmoid.default"])
def annotate_act(node, config):
    annotate_single_in_single_out(node, config)
""",
    "binary_rules.py": """\
import torch

from quantplug.backend import annotate_binary, register_annotator


@register_annotator([torch.ops.aten.add.Tensor])
def annotate_add(node, config):
    annotate_binary(node, config)
""",
    "common.py": "SHARED = 1  # no rules: not indexed\n",
}


def _vendor(site: Path) -> Path:
    """An installed distribution ``idx-vendor`` (backend ``idx``) whose rules package has no index yet."""
    package = site / "idx_vendor"
    (package / "rules").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text(PLUGIN)
    (package / "rules" / "__init__.py").write_text("")
    for name, text in RULES.items():
        (package / "rules" / name).write_text(text)
    info = site / "idx_vendor-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: idx-vendor\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[quantplug.backends]\nidx = idx_vendor.plugin\n")
    return package


@pytest.fixture
def vendor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    package = _vendor(site)
    monkeypatch.syspath_prepend(str(site))
    yield package
    for name in [m for m in sys.modules if m.split(".")[0] == "idx_vendor"]:
        del sys.modules[name]


def _cli(site: Path, *args: str, module: str = "quantplug") -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_index_is_what_the_modules_register(vendor: Path) -> None:
    assert registered_ops("idx_vendor.rules") == {
        "act_rules": ("aten.relu.default", "aten.sigmoid.default"),
        "binary_rules": ("aten.add.Tensor",),
    }
    path, text = expected_index("idx_vendor.rules")
    assert path == vendor / "rules" / "rules.json"
    assert json.loads(text)["modules"]["binary_rules"] == ["aten.add.Tensor"]


def test_reading_the_index_imports_no_rules_module(vendor: Path) -> None:
    path, text = expected_index("idx_vendor.rules")
    path.write_text(text)
    for name in [m for m in sys.modules if m.startswith("idx_vendor.rules.")]:
        del sys.modules[name]
    modules = rules_from_index("idx_vendor.rules")
    assert [(m.module, m.ops) for m in modules] == [
        ("idx_vendor.rules.act_rules", frozenset({"aten.relu.default", "aten.sigmoid.default"})),
        ("idx_vendor.rules.binary_rules", frozenset({"aten.add.Tensor"})),
    ]
    assert not [m for m in sys.modules if m.startswith("idx_vendor.rules.")]
    assert rules_from_index("idx_vendor.rules", ["binary_rules"]) == modules[1:]
    with pytest.raises(RulesIndexError, match=r"no module 'comon'.*lists act_rules, binary_rules"):
        rules_from_index("idx_vendor.rules", ["comon"])


def test_a_missing_index_names_the_command(vendor: Path) -> None:
    with pytest.raises(RulesIndexError, match=r"ships no rules index .*`quantplug metadata BACKEND`"):
        rules_from_index("idx_vendor.rules")
    assert drift("idx_vendor.rules") == [
        f"rules package 'idx_vendor.rules' ships no rules index ({vendor / 'rules' / 'rules.json'}): "
        "reinstall its distribution; its author generates the index with `quantplug metadata BACKEND` "
        "and ships it as package data"
    ]


def test_drift_names_each_op_either_side_lacks(vendor: Path) -> None:
    path, text = expected_index("idx_vendor.rules")
    index = json.loads(text)
    index["modules"]["act_rules"] = [
        "aten.relu.default",
        "aten.tanh.default",
    ]  # sigmoid lost, tanh not a rule
    path.write_text(json.dumps(index))
    assert drift("idx_vendor.rules") == [
        "idx_vendor.rules.act_rules registers aten.sigmoid.default, which its rules index lacks",
        "the rules index lists aten.tanh.default for idx_vendor.rules.act_rules, which has no rule for it",
    ]
    path.write_text(json.dumps(json.loads(text)))  # the right ops, written by hand
    assert drift("idx_vendor.rules") == [f"{path} lists the right ops, but not in the form generated"]
    path.write_text(text)
    assert drift("idx_vendor.rules") == []


def test_the_packages_a_backend_reads_are_found_before_any_index_exists(vendor: Path) -> None:
    from _quantplug.plugins.registry import reset_cache

    reset_cache()
    try:
        assert packages_read_by("idx") == ["idx_vendor.rules"]
    finally:
        reset_cache()
    assert not (vendor / "rules" / "rules.json").exists()  # it is only written on request


def test_quantplug_metadata_writes_and_checks_a_vendors_files(tmp_path: Path) -> None:
    site = tmp_path / "site"
    package = _vendor(site)
    done = _cli(site, "metadata", "idx", "--check")
    assert done.returncode == 1, done.stderr
    problems = done.stderr.strip().splitlines()
    assert len(problems) == 2 and all("`quantplug metadata idx`" in line for line in problems), problems

    done = _cli(site, "metadata", "idx")  # a new vendor's first run: no file exists yet
    assert done.returncode == 0, done.stderr
    assert json.loads((package / "idx.backend.json").read_text())["options"][0]["name"] == "level"
    assert json.loads((package / "rules" / "rules.json").read_text())["modules"]["binary_rules"] == [
        "aten.add.Tensor"
    ]
    assert _cli(site, "metadata", "idx", "--check").returncode == 0
    old = _cli(site, "--check", "idx", module="quantplug.plugins.metadata")  # 0.1.0's spelling, kept
    assert old.returncode == 0 and "is up to date" in old.stdout, old.stderr

    rules = package / "rules" / "binary_rules.py"
    rules.write_text(
        rules.read_text().replace("[torch.ops.aten.add.Tensor]", '["aten.add.Tensor", "aten.mul.Tensor"]')
    )
    done = _cli(site, "metadata", "--check", "idx")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "quantplug: error: idx_vendor.rules.binary_rules registers aten.mul.Tensor, which its rules index "
        "lacks; regenerate it with `quantplug metadata idx`"
    ]


def test_quantplug_metadata_refuses_an_unknown_backend_in_one_line(tmp_path: Path) -> None:
    done = _cli(tmp_path, "metadata", "nosuch")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("quantplug: error: unknown backend 'nosuch'"), line
