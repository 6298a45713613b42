"""What lowering writes, as digests: a speed-up of ``quantplug.lower`` must leave them unchanged.

    python -m bench.lowering_identity --write    # record bench/results/lowering_identity.json
    python -m bench.lowering_identity            # lower again and compare (exit status 1 on a change)

Each case is a model (the lowering bench's MLP, a conv net, a group-norm net, an LSTM, a
transformer block) lowered by a backend preset (``qnn_htp`` 8a8w, 16a8w, 16a16w; ``reference``
int8). Recorded per case: the SHA-256 of every text or bytes file of the artifact
(``model.onnx``, ``model.encodings`` / ``encodings.json``) and of its metadata. Equal digests
mean byte-identical files, which is stricter than "semantically identical"; when a digest
differs, ``--dump DIR`` writes the files to compare them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quantplug
from bench.lowering import MLP

RESULTS = Path(__file__).resolve().parent / "results" / "lowering_identity.json"

Inputs = tuple[torch.Tensor, ...]
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qnn_htp-8a8w": ("qnn_htp", {"precision": "8a8w"}),
    "qnn_htp-16a8w": ("qnn_htp", {"precision": "16a8w"}),
    "qnn_htp-16a16w": ("qnn_htp", {"precision": "16a16w"}),
    "reference-int8": ("reference", {"preset": "int8"}),
}


def _models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    from tests.lowering import models as lowering_models
    from tests.qnn_htp import models as qnn_models

    return {
        "mlp-16": (lambda: MLP(16), (8, 64)),
        "convnet": (qnn_models.ConvNet, (1, 3, 16, 16)),
        "group_norm": (qnn_models.GroupNormNet, (1, 3, 8, 8)),
        "lstm": (lambda: lowering_models.Recurrent(nn.LSTM), (2, 8, 16)),
        "transformer_block": (lowering_models.TransformerBlock, (2, 8, lowering_models.D)),
    }


def lower_case(make: Callable[[], nn.Module], shape: tuple[int, ...], preset: str) -> quantplug.Artifact:
    """Seeded model, 3 seeded calibration batches, prepare/convert/lower with ``preset``."""
    backend, options = PRESETS[preset]
    torch.manual_seed(0)
    model = make().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(shape, generator=gen) for _ in range(3)]
    program = torch.export.export(model, (batches[0],))
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for x in batches:
            prepared(x)
    return quantplug.lower(quantplug.convert(prepared), quantizer)


def digests(artifact: quantplug.Artifact) -> dict[str, str]:
    """SHA-256 of each in-memory file and of the metadata (files written by callables skipped:
    ``reference``'s ``model.pt2``, torch's own serialization)."""
    out = {}
    for name, content in sorted(artifact.files.items()):
        if isinstance(content, (str, bytes)):
            data = content.encode() if isinstance(content, str) else content
            out[name] = hashlib.sha256(data).hexdigest()
    metadata = json.dumps(artifact.metadata, sort_keys=True, default=str).encode()
    out["metadata"] = hashlib.sha256(metadata).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help=f"record the digests in {RESULTS.name}")
    parser.add_argument("--dump", type=Path, help="also write each artifact's files under this folder")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    found: dict[str, dict[str, str]] = {}
    for model, (make, shape) in _models().items():
        for preset in PRESETS:
            case = f"{model}/{preset}"
            artifact = lower_case(make, shape, preset)
            found[case] = digests(artifact)
            if args.dump is not None:
                artifact.save(args.dump / model / preset)
    if args.write:
        RESULTS.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"{len(found)} cases -> {RESULTS}")
        return 0
    recorded = json.loads(RESULTS.read_text())
    changed = [case for case in sorted(set(found) | set(recorded)) if found.get(case) != recorded.get(case)]
    for case in changed:
        print(f"changed: {case}: {recorded.get(case)} -> {found.get(case)}")
    print(f"{len(found)} cases, {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
