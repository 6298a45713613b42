"""The test session's own environment: the example vendor plugin is visible to the tests only.

``tests/example_plugin`` is a third-party plugin distribution (a backend, ``example_vendor``, and
an extension of ``reference``). Installing it into the user's environment would change what the
user's ``reference`` backend does there, so the tests never install it: for the session they put
its package and a ``.dist-info`` folder (entry points and metadata generated from its
``pyproject.toml``, as pip would write them) on ``sys.path`` and on the ``PYTHONPATH`` of the
processes they start. Entry-point discovery then finds it through the very mechanism that finds
installed plugins, and nothing remains once the session ends.

The session, and every process it starts, runs torch on one intra-op thread (``OMP_NUM_THREADS``,
unless the caller set it). The tests' tensors are small, and on a loaded machine (CI's 2 busy
cores) each parallel op waits for a thread the scheduler has not run yet: ``torch.round`` of 130k
floats took 35 ms on 2 threads and 20 us on one at load 10; tests/lowering/test_exact_mapping.py
took 257 s on 2 threads and 98 s on one at load 5-8 (CPU time 120 s and 74 s). Results do not
depend on it: the product promises the same numbers on any thread count.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLE_PLUGIN = Path(__file__).resolve().parent / "example_plugin"

_site: Path | None = None


def _load_toml(path: Path) -> dict:  # type: ignore[type-arg]
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with path.open("rb") as f:
        return tomllib.load(f)


def make_dist_info(project_dir: Path, site: Path) -> Path:
    """Write ``<name>-<version>.dist-info`` for a project into ``site`` (what pip installs)."""
    project = _load_toml(project_dir / "pyproject.toml")["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    summary = project.get("description", "")
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n", encoding="utf-8"
    )
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines), encoding="utf-8")
    (info / "top_level.txt").write_text("quantplug_example_vendor\n", encoding="utf-8")
    return info


def pytest_configure(config: pytest.Config) -> None:
    global _site
    # ``import quantplug`` no longer imports torch, so it no longer registers the standard Q/DQ
    # ops as a side effect; test modules read them (torch.ops.quantized_decomposed) at import
    import torch
    import torch.ao.quantization.fx._decomposed

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the CLI and worker processes
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from tests.torchvision_compat import TEST_PACKAGES, ensure_importable

    if TEST_PACKAGES.is_dir():  # the tests' torchvision where .venv has none (scripts/setup.sh)
        sys.path.append(str(TEST_PACKAGES))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH", ""), str(TEST_PACKAGES)) if p
        )
    ensure_importable()  # torchvision (and transformers, which imports it) next to CPU torch

    if os.environ.get("QUANTPLUG_TEST_SITE"):  # a nested pytest: the outer session set it up
        return
    _site = Path(tempfile.mkdtemp(prefix="quantplug-test-site-"))
    make_dist_info(EXAMPLE_PLUGIN, _site)
    for entry in (str(EXAMPLE_PLUGIN), str(_site)):
        sys.path.insert(0, entry)
    paths = [str(_site), str(EXAMPLE_PLUGIN), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    os.environ["QUANTPLUG_TEST_SITE"] = str(_site)
    from _quantplug.plugins.registry import reset_cache

    reset_cache()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _site is not None:
        shutil.rmtree(_site, ignore_errors=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Keep pytest's log capture off torch's structured-trace logger.

    pytest attaches its capture handlers to every logger that does not propagate, and
    ``torch.__trace`` does not. torch treats any handler there as ``TORCH_TRACE`` being on: each
    export and fake-tensor conversion then builds trace records that pytest keeps for the rest of
    the test. That cost time in every test and, on CI, made the memory-growth test see the kept
    records (12 KiB per cycle). Letting the logger propagate (its records have no handler of their
    own then, so torch skips building them) keeps pytest off it; set before every test because
    torch's ``set_logs`` resets it.
    """
    import logging

    _seed_global_generators(item.nodeid)
    trace = logging.getLogger("torch.__trace")
    trace.propagate = True
    trace.handlers = [h for h in trace.handlers if not type(h).__module__.startswith("_pytest")]


def _seed_global_generators(nodeid: str) -> None:
    """Start every test from the same global RNG state, whatever ran before it.

    A test that builds a layer without a generator (``nn.Linear`` draws its weights and bias from
    torch's global RNG) otherwise gets a model that depends on the tests run before it in the
    process and on PYTHONHASHSEED, so it can pass or fail by run (a grouped-convolution test did).
    The seed comes from the test's id through a stable hash, so a test sees the same numbers
    alone, in the whole suite and in any order; hypothesis manages its own randomness.
    """
    import random
    import zlib

    import torch

    seed = zlib.crc32(nodeid.encode("utf-8"))
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is not a dependency of the product
        return
    np.random.seed(seed)
