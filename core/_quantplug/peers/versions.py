"""What quantplug does only because of a peer's speed or defects, and the versions it was checked on.

Everything in this folder exists for another library: torchao's and torch's matching and
observers are slower than they need be, torch's ONNX exporter has defects and a quadratic
optimizer. Each such piece is a module here, with one entry in :data:`PIECES`: the peer and the
versions the piece was verified against (its results compared bit for bit with the peer's own
path, by the tests named in ``verified_by``), and what happens on any other version.

Two kinds:

* ``"replaces"``: the piece stands in for a peer's own code (a faster function bound in the
  peer's modules for the duration of a call, a faster subclass of the peer's class, the
  exporter's private passes). On a version not in the table it stands down and the peer's own
  path runs: the same results, slower. :func:`verified` is the only switch.
* ``"rewrites"``: the piece rewrites quantplug's own copy of a program into an equivalent one
  before handing it to the peer (a decomposition the exporter translates correctly). It is
  right on any version, so it always runs; the versions say where the defect was seen, so a
  newer peer can be checked and the piece dropped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import metadata


@dataclass(frozen=True)
class PeerPiece:
    """One module of this folder: which peer it serves, checked on which versions, and why."""

    module: str
    #: distribution -> version prefixes verified (``"2.13."``)
    verified_on: dict[str, tuple[str, ...]]
    kind: str  # "replaces" or "rewrites"
    why: str
    verified_by: tuple[str, ...] = field(default=())


PIECES: dict[str, PeerPiece] = {
    piece.module: piece
    for piece in (
        PeerPiece(
            "torchao_matching",
            {"torch": ("2.13.",), "torchao": ("0.18.",)},
            "replaces",
            "speed: torch.fx's get_source_partitions rescans the graph per call and torchao's "
            "find_sequential_partitions is quadratic; an index built once gives the same partitions",
            ("tests/core/test_perf_structure.py", "tests/core/test_peers.py"),
        ),
        PeerPiece(
            "torchao_observers",
            {"torchao": ("0.18.",)},
            "replaces",
            "speed: torchao's HistogramObserver bins in scalar code and searches its clipping range "
            "in a Python loop; PerChannelMinMaxObserver's aminmax is 15x slower than amin + amax "
            "(or the native kernels' one pass over the rows). Subclasses with the same float32 "
            "arithmetic (native where built: the search's per-bin error terms, the rows' extremes) "
            "give bit-identical statistics and qparams",
            ("tests/core/test_perf_structure.py", "tests/core/test_peers.py"),
        ),
        PeerPiece(
            "torch_codegen",
            {"torch": ("2.13.",)},
            "replaces",
            "speed: torch.fx's code generation assigns every node a temporary repr function and back, "
            "each assignment re-filing the node in the graph's lookup table under the same key, and "
            "asks pure questions (qualified names, opaque types) again per node; with the table "
            "hidden and the answers memoized while the code is generated, the same code comes out",
            ("tests/core/test_peers.py",),
        ),
        PeerPiece(
            "torch_python_code",
            {"torch": ("2.13.",)},
            "replaces",
            "speed: torch.fx's Graph.python_code is general (annotations, verbose traces, custom "
            "code generators) and pays for it per node; for the graphs quantplug generates code for "
            "(default or pytree code generator, no annotations, no options) one pass writes the same "
            "text, globals and line map, and anything else is left to torch's path",
            ("tests/core/test_peers.py",),
        ),
        PeerPiece(
            "torch_dead_code",
            {"torch": ("2.13.",)},
            "replaces",
            "speed: torch.fx's eliminate_dead_code lints the whole graph first; a rewrite of an "
            "exported program's working copy keeps it sorted, and the pass without the lint removes "
            "the same nodes",
            ("tests/core/test_rewrite_pipeline.py", "tests/core/test_peers.py"),
        ),
        PeerPiece(
            "torch_module_call",
            {"torch": ("2.13.",)},
            "replaces",
            "speed: nn.Module.__call__ is two Python frames before forward, a quarter of a range "
            "observer's call (calibration calls observers a thousand times per forward); where "
            "torch's _call_impl would only call forward (no compiled call, hook or JIT trace) the "
            "observer calls it directly, anything else goes to nn.Module.__call__ as installed",
            ("tests/core/test_observer_call.py", "tests/core/test_peers.py"),
        ),
        PeerPiece(
            "torch_export_save",
            {"torch": ("2.13.",)},
            "replaces",
            "speed: torch.export.save checks the canonical form of the serialized program on a "
            "copy.deepcopy of it (three quarters of saving a converted program) and discards the "
            "result; a pickle round trip makes an equal copy in C, and the file is the same",
            ("tests/core/test_peers.py",),
        ),
        PeerPiece(
            "onnx_translate",
            {"torch": ("2.13.",), "onnxscript": ("0.7.",)},
            "replaces",
            "speed: torch.onnx.export re-traces the program, and onnxscript's optimizer is quadratic "
            "in the graph and folds the Q/DQ nodes away; the exporter's own translation passes run "
            "only where they change something, and its registry of torchlib's functions is built "
            "without compiling each function's IR (a second of every lowering process)",
            ("tests/lowering/test_fast_paths.py", "tests/core/test_peers.py"),
        ),
        PeerPiece(
            "onnx_contiguous",
            {"torch": ("2.13.",)},
            "rewrites",
            "defect: the exporter decomposes contiguous() as a no-op when a dynamic-shape stride test "
            "comes out wrong, and the view after it fails (HF BEiT)",
            ("tests/lowering/test_dynamic_shapes.py",),
        ),
        PeerPiece(
            "onnx_projected_lstm",
            {"torch": ("2.13.",)},
            "rewrites",
            "defect: the exporter writes an LSTM with a projection (proj_size) as ONNX's LSTM, which "
            "has none; ONNX Runtime refuses the model",
            ("tests/lowering/test_projected_lstm.py",),
        ),
        PeerPiece(
            "onnx_in_place_writes",
            {"torch": ("2.13.",)},
            "rewrites",
            "defect: the exporter functionalizes an in-place write into a view as reshapes around the "
            "op, which moves the op's encoding off its output",
            ("tests/core/test_in_place_writes.py",),
        ),
    )
}


def installed_version(distribution: str) -> str | None:
    """The version of ``distribution`` as loaded (its module's ``__version__``), else as installed
    (package metadata, without importing it: importing torchao takes seconds), else None."""
    module = sys.modules.get(distribution)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def verified(module: str, *, peers: tuple[str, ...] | None = None) -> bool:
    """Whether the peers of piece ``module`` (all of them, or those named in ``peers``) are at a
    version the piece was verified on."""
    piece = PIECES[module]
    for distribution, prefixes in piece.verified_on.items():
        if peers is not None and distribution not in peers:
            continue
        version = installed_version(distribution)
        if version is None or not version.startswith(prefixes):
            return False
    return True
