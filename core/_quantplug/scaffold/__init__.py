"""``quantplug new-backend NAME``: a complete, installable backend distribution to start from.

The generated distribution passes ``quantplug conformance NAME`` as soon as it is installed:
an entry point, a plugin module implementing the hooks a backend needs, presets and configs
(uint8 activations, int8 per-channel weights, int32 derived bias), one rules module (linear,
conv2d, relu, add), a constraint table (with "add inputs share one scale"), a fusion pattern,
an artifact writer, a conformance profile, tests and a README. ``docs/writing-a-backend.md``
walks through each file.
"""

from __future__ import annotations

import re
from pathlib import Path

from _quantplug.errors import QuantplugError
from _quantplug.scaffold.templates import FILES, RULES_INDEX_TEMPLATE

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


class ScaffoldError(QuantplugError, ValueError):
    """A backend name or target directory ``new-backend`` cannot use."""


def names(name: str) -> dict[str, str]:
    """The names derived from a backend name: distribution, import package, title."""
    if not NAME_PATTERN.match(name) or name.endswith("_") or "__" in name:
        raise ScaffoldError(
            f"backend name {name!r} must be a lowercase identifier ([a-z][a-z0-9_]*, e.g. 'my_npu'); "
            "it is what users type in get_quantizer(name)"
        )
    return {
        "name": name,
        "dist": "quantplug-" + name.replace("_", "-"),
        "package": "quantplug_" + name,
        "title": " ".join(part.upper() if len(part) <= 3 else part.capitalize() for part in name.split("_")),
    }


def render(name: str) -> dict[str, str]:
    """Relative path -> content of every file of the distribution for backend ``name``."""
    values = names(name)
    rendered: dict[str, str] = {}
    for path, text in FILES.items():
        for key, value in values.items():
            path = path.replace("{{" + key + "}}", value)
            text = text.replace("{{" + key + "}}", value)
        rendered[path] = text
    return rendered


def create_backend(name: str, directory: str | Path = ".") -> Path:
    """Write the distribution of backend ``name`` into ``directory/quantplug-<name>/``.

    Raises:
        ScaffoldError: the name is not a lowercase identifier, or the target exists and is not
            empty (nothing is overwritten).
    """
    files = render(name)
    root = Path(directory) / names(name)["dist"]
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ScaffoldError(f"{root} already exists and is not empty; choose another --dir or remove it")
    for rel, text in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def expected_files() -> list[tuple[Path, str]]:
    """The template of the rules index a generated distribution ships, and the text it must hold.

    It is the index of the generated rules module's declarations, found as a vendor's is: the
    distribution is written into a scratch folder and its rules package imported from there.
    """
    import sys
    import tempfile

    from _quantplug.quantizer.rules_index import expected_index

    probe = names("scaffold_probe")
    with tempfile.TemporaryDirectory() as scratch:
        root = str(create_backend(probe["name"], scratch))
        sys.path.insert(0, root)
        try:
            _, text = expected_index(f"{probe['package']}.rules")
        finally:
            sys.path.remove(root)
            for module in [m for m in sys.modules if m.split(".")[0] == probe["package"]]:
                del sys.modules[module]
    return [(RULES_INDEX_TEMPLATE, text.replace(probe["package"], "{{package}}"))]
