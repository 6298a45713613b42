"""What the reference backend does only because of ONNX Runtime's defects and kernels, and the
versions each piece was checked on.

The backend's job is to run the Q/DQ program in ONNX Runtime exactly and fast. Three things stand
between the exported QDQ model and that, all ORT's (see each module):

* ``ort_passes``: rewrites of the exported model so that a plain ``InferenceSession`` computes what
  the program computes (ORT's fusions would otherwise change the arithmetic, or fail to load);
* ``accumulation``: which integer products ORT's CPU kernels (MLAS) can saturate, and the check of
  a lowered model against that model of its kernels;
* ``session_probe``: a child process that builds the session first where ORT's optimizer has
  crashed the whole process.

Each rewrites only the backend's own copy of the model into an equivalent one, so each is right
on any ORT version and always runs; :data:`VERIFIED_ON` says where each defect or kernel was
read, so that a new ORT can be checked piece by piece (``tests/reference/test_reference_peers.py``
names the pieces to recheck when the installed ORT is not in the table) and a piece dropped when
ORT no longer needs it.
"""

from __future__ import annotations

from importlib import metadata

#: piece -> (distribution, the version prefixes it was verified on, why it exists)
VERIFIED_ON: dict[str, tuple[str, tuple[str, ...], str]] = {
    "ort_passes": (
        "onnxruntime",
        ("1.32.",),
        "ORT's QDQ fusions: int8 activations fused with a saturating kernel, DequantizeLinear fused "
        "into MatMulNBits at the session's accuracy level, MatMulAddFusion failing on a uint8 zero "
        "point, no bfloat16 CPU kernels",
    ),
    "accumulation": (
        "onnxruntime",
        ("1.32.",),
        "MLAS's 8-bit products pair-summed in 16 bits (AVX2/AVX-512BW VPMADDUBSW saturates, ARMv8.0 "
        "NEON wraps); read in MLAS's kernels of this version",
    ),
    "session_probe": (
        "onnxruntime",
        ("1.32.",),
        "ORT's graph optimizer segfaults on some quantized graphs with a Loop (EmbeddingBag mean "
        "with per-sample offsets)",
    ),
}


def unverified() -> list[str]:
    """The pieces whose peer is installed at a version they were not checked on, with why they
    exist: what to recheck before trusting a new ORT (empty when every piece is verified)."""
    found = []
    for piece, (distribution, prefixes, why) in VERIFIED_ON.items():
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        if not version.startswith(prefixes):
            verified = f"verified on {distribution} {', '.join(prefixes)}; {version} installed"
            found.append(f"{piece} ({verified}): {why}")
    return found
