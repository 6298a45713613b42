"""Run saved ONNX models in plain ONNX Runtime sessions; used by ``test_reference_qemu.py`` under
``qemu-x86_64 -cpu Haswell`` (an AVX2 CPU without VNNI). Imports numpy and onnxruntime only.

    python qemu_ort_runner.py FOLDER     # FOLDER/<name>.onnx + FOLDER/inputs.npz -> FOLDER/outputs.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


def main(folder: str) -> int:
    root = Path(folder)
    feeds = np.load(root / "inputs.npz")
    outputs = {}
    for model in sorted(root.glob("*.onnx")):
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        (x,) = session.get_inputs()
        outputs[model.stem] = session.run(None, {x.name: feeds[model.stem]})[0]
    np.savez(root / "outputs.npz", **outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
