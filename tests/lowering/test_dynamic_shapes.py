"""Dynamic shapes through lowering (issue 11.6): a program exported with ``torch.export.Dim`` for
batch and sequence length keeps those dimensions dynamic in the saved artifact, named as the user
named them, for every preset of both backends."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _quantplug.observers.block_ops
import quantplug

from .models import PRESETS, preset_id, quantize

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("quantplug_qnn_htp")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BATCH = torch.export.Dim("batch", min=1, max=64)
SEQ = torch.export.Dim("seq", min=2, max=128)
SHAPES = [(1, 5), (7, 5), (1, 12), (7, 12)]  # (batch, sequence length) at run time


class Tagger(nn.Module):
    """Embedding + LayerNorm + attention + MLP over (batch, seq) token ids and features: every
    shape-dependent op (reshape from sizes, sdpa, mean over the sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.ln = nn.LayerNorm(32)
        self.qkv = nn.Linear(32, 96)
        self.fc = nn.Linear(32, 16)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        x = self.ln(self.emb(tokens) + features)
        q, k, v = (y.reshape(b, t, 4, 8).transpose(1, 2) for y in self.qkv(x).split(32, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 32)
        return self.fc(F.relu(x + y)) + y.mean(dim=1, keepdim=True)[..., :16]


def inputs(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (batch, seq), generator=gen), torch.randn(batch, seq, 32, generator=gen)


def export(dynamic: bool) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    shapes = ({0: BATCH, 1: SEQ}, {0: BATCH, 1: SEQ}) if dynamic else None
    return torch.export.export(Tagger().eval(), inputs(2, 8, seed=0), dynamic_shapes=shapes)


def calibration() -> list[tuple[torch.Tensor, ...]]:
    return [inputs(b, t, seed=s) for s, (b, t) in enumerate([(2, 8), (3, 6), (1, 10)])]


def _dims(values: Any) -> dict[str, list[Any]]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


@pytest.fixture(scope="module")
def dynamic_program() -> torch.export.ExportedProgram:
    return export(dynamic=True)


@pytest.mark.parametrize("backend,options", PRESETS, ids=[preset_id(*p) for p in PRESETS])
def test_saved_artifact_runs_any_batch_and_sequence_length(
    dynamic_program: torch.export.ExportedProgram, backend: str, options: dict[str, Any], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    quantizer, program = quantize(dynamic_program, backend, options, calibration())
    artifact = quantplug.lower(program, quantizer)
    artifact.save(tmp_path)
    model = onnx.load(str(tmp_path / "model.onnx"))
    assert _dims(model.graph.input) == {"tokens": ["batch", "seq"], "features": ["batch", "seq", 32]}
    (out,) = _dims(model.graph.output).values()
    assert out == ["batch", "seq", 16]
    if backend == "qnn_htp":
        # every intermediate shape is spelled in the user's names (no exporter symbols)
        symbols = {
            word
            for dims in _dims(model.graph.value_info).values()
            for dim in dims
            if isinstance(dim, str)
            for word in re.findall(r"[A-Za-z_]\w*", dim)
        }
        assert symbols == {"batch", "seq"}
    session = _session(tmp_path / "model.onnx", backend, options)
    for seed, (b, t) in enumerate(SHAPES):
        args = inputs(b, t, seed=10 + seed)
        with torch.no_grad():
            expected = program(*args)
        feeds = {"tokens": args[0].numpy(), "features": args[1].numpy()}
        (got,) = session.run(None, feeds)
        assert got.shape == (b, t, 16)
        _close(got, expected.numpy(), backend, options)
        if backend == "reference":
            _close(artifact.run(*args).numpy(), expected.numpy(), backend, options)
            # model.pt2 (the Q/DQ program) takes the same shapes
            loaded = torch.export.load(str(tmp_path / "model.pt2")).module()
            torch.testing.assert_close(loaded(*args), expected, rtol=0, atol=1e-6)


def _session(path: Any, backend: str, options: dict[str, Any]) -> Any:
    """A plain ONNX Runtime session on the saved file (for qnn_htp's models, without graph
    rewrites: Q/DQ arithmetic, each op as the model spells it; the QNN converter reads the
    model, not ORT, and ORT 1.32 lacks kernels for some of its 16-bit QDQ fusions)."""
    so = ort.SessionOptions()
    if backend == "qnn_htp":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _bits(options: dict[str, Any]) -> int:
    """The activation bit width of a preset."""
    return 8 if "8a" in str(options.get("precision", "")) or options.get("preset") == "int8" else 16


def _close(got: np.ndarray, expected: np.ndarray, backend: str, options: dict[str, Any]) -> None:
    """Within one quantization step of the output (a 16-bit step where the output is 16-bit)."""
    scale = float(np.abs(expected).max()) + 1e-6
    bits = _bits(options)
    if options.get("preset") in ("dynamic_int8", "weight_only_int4"):  # float outputs: float rounding
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * scale)
        return
    step = 2 * scale / (2**bits - 1)
    # a 16-bit grid resolves the last bits in which ORT's and torch's float kernels (LayerNorm,
    # softmax, GELU) differ: a few intermediate codes flip and carry through to the output
    steps = 2 if bits == 8 else 8
    assert float(np.abs(got - expected).max()) <= steps * step * 1.001


@pytest.mark.parametrize("precision", ["8a8w", "16a4w_block"])
def test_qnn_encodings_do_not_depend_on_shapes(precision: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same model and calibration, exported with static or dynamic shapes: the same encodings."""
    docs = []
    for dynamic in (False, True):
        quantizer, program = quantize(
            export(dynamic), "qnn_htp", {"precision": precision, "block_size": 16}, calibration()[:1]
        )
        artifact = quantplug.lower(program, quantizer)
        artifact.save(tmp_path / str(dynamic))
        docs.append(json.loads((tmp_path / str(dynamic) / "model.encodings").read_text()))
    static, dynamic = ({e["name"]: e for e in d["activation_encodings"] + d["param_encodings"]} for d in docs)
    assert static == dynamic


def test_lowering_leaves_the_users_program_dynamic(dynamic_program: torch.export.ExportedProgram) -> None:
    """Lowering used to re-trace the program with static example inputs, writing those shapes
    into the nodes it shared with the caller's ExportedProgram."""

    def user_shapes() -> list[str]:
        sig = dynamic_program.graph_signature
        return [
            str(list(n.meta["val"].shape)) for n in dynamic_program.graph.nodes if n.name in sig.user_inputs
        ]

    before = user_shapes()  # symbols (as text: a specialised SymInt prints its value)
    assert all(
        isinstance(d, torch.SymInt)
        for n in dynamic_program.graph.nodes
        if n.op == "placeholder" and n.name in dynamic_program.graph_signature.user_inputs
        for d in n.meta["val"].shape[:2]
    )
    quantizer, program = quantize(dynamic_program, "reference", {}, calibration()[:1])
    quantplug.lower(program, quantizer)
    assert user_shapes() == before


def test_artifact_run_checks_the_static_dimensions(dynamic_program: torch.export.ExportedProgram) -> None:
    from quantplug_reference.lowering import ArtifactInputError

    quantizer, program = quantize(dynamic_program, "reference", {}, calibration()[:1])
    artifact = quantplug.lower(program, quantizer)
    assert [i.shape for i in artifact.inputs] == [("batch", "seq"), ("batch", "seq", 32)]
    tokens, features = inputs(3, 9, seed=1)
    artifact.run(tokens, features)  # any batch and length
    with pytest.raises(ArtifactInputError, match=r"shape \[3, 9, 31\].*\['batch', 'seq', 32\]"):
        artifact.run(tokens, features[..., :31])
    with pytest.raises(ArtifactInputError, match="shape"):
        artifact.run(tokens, features[0])


class RuntimeWeight(nn.Module):
    """A linear whose weight is an input: weight-only presets quantize it per block at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(self.fc(x), w)


def test_a_weight_quantized_per_block_at_run_time_lowers() -> None:
    """Its dequantize reads convert's quantize, which has no recorded value: lowering took the
    weight's (static) shape for unknown and refused it as dynamic."""
    torch.manual_seed(0)
    model, x, w = RuntimeWeight().eval(), torch.randn(3, 64), torch.randn(8, 64)
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(torch.export.export(model, (x, w)), quantizer)
    prepared(x, w)
    converted = quantplug.convert(prepared)
    assert any(n.target == _quantplug.observers.block_ops.quantize_per_block for n in converted.graph.nodes)
    artifact = quantplug.lower(converted, quantizer)
    np.testing.assert_allclose(np.asarray(artifact.run(x, w)), converted(x, w).detach().numpy(), atol=1e-5)
