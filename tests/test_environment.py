"""The test command leaves the user's environment as it found it (issue 12.8): the example vendor
plugin is visible to this session only, from a temporary folder, never installed into the
environment that runs the tests (where it would extend the user's ``reference`` backend)."""

from __future__ import annotations

import os
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

import quantplug


def test_example_plugin_comes_from_the_session_folder_only() -> None:
    site = Path(os.environ["QUANTPLUG_TEST_SITE"])
    dist = metadata.distribution("quantplug-example-vendor")
    located = Path(str(dist.locate_file(""))).resolve()
    assert located == site.resolve()
    installed = Path(sysconfig.get_paths()["purelib"])
    assert not list(installed.glob("quantplug_example_vendor*"))
    assert not list(installed.glob("__editable__*example_vendor*"))


def test_the_session_sees_the_plugin_through_its_entry_points() -> None:
    names = {b.name: b for b in quantplug.list_backends()}
    assert names["example_vendor"].distribution == "quantplug-example-vendor"
    from _quantplug.plugins.registry import load_backend

    assert "quantplug_example_vendor.reference_ext" in load_backend("reference").extensions


# -- what .venv imports for a user (issue 45.5) ---------------------------------------------------


def _users_environment() -> dict[str, str]:
    """This process's environment less what the test session added for itself: the example
    plugin's site and folder, and the tests' own torchvision (``.test-packages``). What is left is
    what the user's shell has (here, where quantplug runs from a checkout: its source folders)."""
    from tests.torchvision_compat import TEST_PACKAGES

    session = {os.environ.get("QUANTPLUG_TEST_SITE", ""), str(TEST_PACKAGES)}
    session |= {str(Path(__file__).resolve().parent / "example_plugin")}
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in session]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUANTPLUG_TEST_SITE")}
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


#: run as a user would: no tests/torchvision_compat, nothing declared for torchvision beforehand
_IMPORTS = """
import importlib.util, json
has = importlib.util.find_spec("torchvision") is not None
if has:
    import torchvision  # a build matching torch, or none at all: never half an import
    torchvision.models.resnet18(num_classes=10)
from transformers import BertConfig, BertModel  # transformers imports torchvision where it is found
BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64))
print(json.dumps({"torchvision": has}))
"""


def _imports(tmp_path: Path) -> dict[str, bool]:
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS],
        cwd=tmp_path,
        env=_users_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        "this environment cannot import what it holds without the tests' shim; run "
        f"`bash scripts/setup.sh --test` (it keeps a torchvision that does not match torch out of .venv):\n"
        f"{done.stderr[-2000:]}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def users_imports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bool]:
    """:func:`_imports` once per module: both tests below read it (the second only to know
    whether this environment holds a torchvision)."""
    return _imports(tmp_path_factory.mktemp("imports"))


def test_torchvision_and_transformers_import_as_they_are(users_imports: dict[str, bool]) -> None:
    """``import torchvision`` (where installed) and transformers' BERT work in a fresh interpreter
    of this environment with nothing of the test session's: no shim, no test packages."""
    assert set(users_imports) == {"torchvision"}


def test_a_users_torchvision_factory_quantizes(tmp_path: Path, users_imports: dict[str, bool]) -> None:
    """``quantplug quantize mymodels:factory`` on a factory building a torchvision model, in a
    fresh interpreter without the shim: where this environment holds a torchvision (one matching
    its torch), the user's model quantizes; where it holds none (scripts/setup.sh installs none
    next to a CPU torch, whose matching torchvision build PyPI does not carry), the user is told
    so by Python's own ``No module named 'torchvision'``."""
    import subprocess
    import sys

    has = users_imports["torchvision"]
    (tmp_path / "mymodels.py").write_text(
        "import torch\nimport torchvision\n\n"
        "def factory():\n"
        "    model = torchvision.models.resnet18(num_classes=10).eval()\n"
        "    return model, (torch.randn(1, 3, 32, 32),)\n"
    )
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "quantplug",
            "quantize",
            "mymodels:factory",
            "--out",
            str(out),
            "--random-batches",
            "2",
            "-q",
        ],
        cwd=tmp_path,
        env=_users_environment(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if has:
        assert done.returncode == 0, done.stderr[-2000:]
        assert (out / "report.json").exists()
    else:
        assert done.returncode != 0 and "No module named 'torchvision'" in done.stderr, done.stderr[-2000:]
