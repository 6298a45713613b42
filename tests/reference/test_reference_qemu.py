"""The ``reference`` artifact on a real AVX2 CPU without VNNI, emulated by QEMU.

``qemu-x86_64 -cpu Haswell`` (QEMU >= 7.2 emulates AVX2 under TCG; Debian: ``apt-get install
qemu-user``, installed by ``scripts/setup.sh --test`` where it can) runs ONNX Runtime's real
AVX2 kernels, whose U8S8 products add pairs in a saturating int16 (VPMADDUBSW). A control model
stored the way quantplug stored weights before (int8 on [-127, 127]) must show the saturation
there; every preset's artifact must match the Q/DQ program. The structural proof, which needs no
emulator and covers every CPU, is ``test_reference_exactness.py``; this is its empirical check.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.reference.test_reference_exactness import (
    MODELS,
    _store_uint8_weights_as_int8,
    inputs,
    lowered,
    output_step,
    sqnr,
)

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

QEMU = shutil.which("qemu-x86_64")
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="emulates x86-64 user space"),
    pytest.mark.skipif(
        QEMU is None,
        reason="qemu-x86_64 not installed (Debian: apt-get install qemu-user; scripts/setup.sh --test "
        "installs it as root); the structural proof is test_reference_exactness.py",
    ),
]
RUNNER = Path(__file__).with_name("qemu_ort_runner.py")
#: (model, options) whose artifacts run on the emulated AVX2 CPU
CASES: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "mlp_int8": ("mlp", (("preset", "int8"),)),
    "mlp_int8_w8": ("mlp", (("preset", "int8"), ("weight_bits", 8))),
    "mlp_per_tensor": ("mlp", (("preset", "int8_per_tensor"),)),
    "mlp_dynamic": ("mlp", (("preset", "dynamic_int8"),)),
    "mlp_dynamic_w8": ("mlp", (("preset", "dynamic_int8"), ("weight_bits", 8))),
    "conv_int8": ("conv", (("preset", "int8"),)),
    "conv_int8_w8": ("conv", (("preset", "int8"), ("weight_bits", 8))),
    "attention_int8_acts": ("attention", (("activation_dtype", "int8"), ("preset", "int8"))),
}


def test_artifacts_match_the_program_on_an_avx2_cpu_without_vnni(tmp_path: Path) -> None:
    feeds: dict[str, np.ndarray] = {}
    expected: dict[str, tuple[torch.Tensor, float | None]] = {}
    for label, (name, options) in CASES.items():
        _, converted, artifact = lowered(name, options)
        (tmp_path / f"{label}.onnx").write_bytes(artifact.onnx_model)
        x = inputs(MODELS[name][1], 99, gain=3.0)
        feeds[label] = x.numpy()
        expected[label] = (converted(x).detach(), output_step(artifact))
    # the control: 8-bit weights stored as int8, as before
    _, converted, artifact = lowered("mlp", (("preset", "int8"), ("weight_bits", 8)))
    old = onnx.load_from_string(artifact.onnx_model)
    assert _store_uint8_weights_as_int8(old)
    onnx.save(old, str(tmp_path / "control_old_scheme.onnx"))
    feeds["control_old_scheme"] = feeds["mlp_int8_w8"]
    expected["control_old_scheme"] = expected["mlp_int8_w8"]
    np.savez(tmp_path / "inputs.npz", **feeds)

    command = [str(QEMU), "-cpu", "Haswell", sys.executable, str(RUNNER), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = np.load(tmp_path / "outputs.npz")

    def error_steps(label: str) -> float:
        ref, step = expected[label]
        assert step is not None
        return float(np.abs(outputs[label] - ref.numpy()).max()) / step

    # the emulated CPU saturates: quantplug's previous artifact is many steps off there
    assert error_steps("control_old_scheme") > 3, "the emulated CPU does not saturate VPMADDUBSW"
    for label in CASES:
        ref, step = expected[label]
        if step is None:  # dynamic: float output
            assert sqnr(ref, torch.from_numpy(outputs[label])) > 50, label
        else:
            assert error_steps(label) <= 1.001, label
