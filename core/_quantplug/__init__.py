"""quantplug's implementation: private, may change in any release.

The public modules are ``quantplug`` (users), ``quantplug.backend`` (backend plugins),
``quantplug.debug``, ``quantplug.distributed`` and ``quantplug.conformance``; they re-export names
from here, never the other way round (the conformance kit alone runs backends through the public
calls, as their users do). A folder per responsibility, in layers: a module imports only from its
own folder and from the layers below it, and no module imports another in a cycle
(``tests/core/test_layers.py`` holds every import to :data:`LAYERS`, function-level imports
included; imports for type checking only are exempt).
"""

from __future__ import annotations

#: the layers, lowest first; each entry names the folders (or top-level modules) of one layer
LAYERS: tuple[tuple[str, ...], ...] = (
    # foundations: errors, names, files, the public modules' machinery, deprecations, meta keys
    ("errors", "suggest", "files", "lazy", "deprecated", "meta"),
    # torch.fx facts: copies, attributes, op names, calls, what a program writes, constants
    ("graph",),
    # the vocabulary: specs, grids, annotators; observer sharing over keys
    ("annotation", "sharing"),
    # observers (incl. quantplug's own Q/DQ ops) and the constraint engine
    ("observers", "validation"),
    # what exists only for a peer's speed or defects (torchao, torch's ONNX exporter)
    ("peers",),
    # the program rewrites prepare (and coverage) run before annotation
    ("rewrites",),
    # the plugin contract and registry; the Quantizer built from a backend's hooks
    ("plugins", "quantizer"),
    # accuracy algorithms (given prepare/convert through an interface, never importing them)
    ("algorithms",),
    # prepare, convert, reading programs
    ("flow",),
    # lower(), the artifact, the QDQ ONNX exporter
    ("lowering",),
    # what users run: the one-call API, loading archives, debugging, distributed calibration,
    # the mixed-precision search, reports, the conformance kit, the scaffold, the demo
    (
        "api",
        "archive",
        "debug",
        "distributed",
        "mixed_precision",
        "report",
        "conformance",
        "scaffold",
        "demo",
    ),
    # the command line
    ("cli",),
)
