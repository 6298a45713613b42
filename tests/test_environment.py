"""The test command leaves the user's environment as it found it (issue 12.8): the example vendor
plugin is visible to this session only, from a temporary folder, never installed into the
environment that runs the tests (where it would extend the user's ``reference`` backend)."""

from __future__ import annotations

import os
import sysconfig
from importlib import metadata
from pathlib import Path

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
