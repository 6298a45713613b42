"""qnn_htp's artifact is the size of what it says (issue 43.2).

On a transformers Llama with a tied embedding / LM-head table (``tie_word_embeddings=True``):

* 4-bit weight codes are ONNX ``INT4`` initializers (two codes a byte), their zero points too, and
  the model stays pure Q/DQ, running as Q/DQ arithmetic within 1 dB of the program;
* a table both uses quantize alike (``per_channel_embedding``: the LM head's 4-bit grid) is one
  initializer, read by both ``DequantizeLinear`` nodes; one they quantize differently (by default
  the embedding's table is on the 16-bit activation grid) is two, which ``artifact.json`` says;
* a model past ``SINGLE_FILE_BYTES`` is written as ``model.onnx`` + ``model.onnx.data``, streamed
  from the program's tensors: loaded with its external data it is the single-file model, byte for
  byte, and runs the same; neither the float model nor the converted program is changed;
* the encodings file writes one tensor per line without spaces: an LPBQ weight's block scales are
  integers, a few bytes each, and the JSON is the document's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import quantplug
from tests.zoo import pure_qdq

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

VOCAB, HIDDEN = 256, 64


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits  # type: ignore[no-any-return]


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=True,
    )  # fmt: skip
    return _Logits(transformers.LlamaForCausalLM(config)).eval()


def _ids(seed: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(seed)),)


def _quantize(model: torch.nn.Module, **options: Any) -> tuple[torch.fx.GraphModule, Any]:
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", **options)
    prepared = quantplug.prepare(torch.export.export(model, _ids(0)), quantizer)
    with torch.no_grad():
        for seed in (1, 2):
            prepared(*_ids(seed))
    return quantplug.convert(prepared), quantizer


def _state(module: torch.nn.Module) -> dict[str, bytes]:
    """Every tensor's bytes (whatever its dtype or rank)."""
    state = module.state_dict()
    return {
        k: v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()
    }


@pytest.fixture(scope="module")
def tied() -> dict[str, Any]:
    model = _llama()
    float_state = _state(model)
    program, quantizer = _quantize(model, precision="16a4w", per_channel_embedding=True)
    program_state = _state(program)
    single = quantplug.lower(program, quantizer)  # small: one model.onnx
    return {
        "model": model,
        "float_state": float_state,
        "program": program,
        "program_state": program_state,
        "quantizer": quantizer,
        "single": single,
    }


def test_4bit_weights_are_int4_and_the_tied_table_is_stored_once(
    tied: dict[str, Any], tmp_path: Path
) -> None:
    tied["single"].save(tmp_path)
    model = onnx.load(str(tmp_path / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    read_by_dq: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            read_by_dq.setdefault(node.input[0], []).append(node)
    weights = [name for name in read_by_dq if len(inits[name].dims) == 2]
    assert weights, "no quantized weight in the model: the test tests nothing"
    for name in weights:  # every 2-D weight is on the 4-bit grid at 16a4w
        tensor = inits[name]
        assert tensor.data_type == onnx.TensorProto.INT4, name
        assert len(tensor.raw_data) == (tensor.dims[0] * tensor.dims[1] + 1) // 2, name
        for node in read_by_dq[name]:
            assert inits[node.input[2]].data_type == onnx.TensorProto.INT4  # its zero point
    tables = [name for name in weights if tuple(inits[name].dims) == (VOCAB, HIDDEN)]
    assert len(tables) == 1, f"the tied table is stored {len(tables)} times: {tables}"
    assert len(read_by_dq[tables[0]]) == 2  # the embedding's DequantizeLinear and the LM head's
    encodings = json.loads((tmp_path / "model.encodings").read_text())
    named = {e["name"] for e in encodings["param_encodings"]}
    assert {n.output[0] for n in read_by_dq[tables[0]]} <= named
    assert tied["single"].metadata["parameters_stored_twice"] == []


def test_external_data_is_the_single_file_model_and_runs_the_same(
    tied: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantplug_qnn_htp import lowering

    program, quantizer, single = tied["program"], tied["quantizer"], tied["single"]
    single.save(tmp_path / "single")
    monkeypatch.setattr(lowering, "SINGLE_FILE_BYTES", 0)
    split = quantplug.lower(program, quantizer)
    assert callable(split.files["model.onnx"])
    assert split.metadata["onnx_external_data"] == "model.onnx.data"
    split.save(tmp_path / "split")
    names = {p.name for p in (tmp_path / "split").iterdir()}
    assert names == {"model.onnx", "model.onnx.data", "model.encodings", "artifact.json"}
    shell = onnx.load(str(tmp_path / "split" / "model.onnx"), load_external_data=False)
    external = [t for t in shell.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and not any(t.raw_data for t in external)  # the weights are in model.onnx.data
    lengths = [int(e.value) for t in external for e in t.external_data if e.key == "length"]
    assert len(lengths) == len(external)
    assert sum(lengths) <= (tmp_path / "split" / "model.onnx.data").stat().st_size
    loaded = onnx.load(str(tmp_path / "split" / "model.onnx"))  # reads model.onnx.data beside it
    assert loaded.SerializeToString() == (tmp_path / "single" / "model.onnx").read_bytes()
    assert (tmp_path / "split" / "model.encodings").read_text() == (
        tmp_path / "single" / "model.encodings"
    ).read_text()
    # run from the file (ONNX Runtime reads the external data itself), Q/DQ arithmetic only
    held_out = [_ids(seed) for seed in (3, 4)]
    from_file = pure_qdq.run_without_optimizations(str(tmp_path / "split" / "model.onnx"), held_out)  # type: ignore[arg-type]
    from_bytes = pure_qdq.run_without_optimizations(single.files["model.onnx"], held_out)  # type: ignore[arg-type]
    for a, b in zip(from_file, from_bytes, strict=True):
        assert (a == b).all()
    assert pure_qdq.integer_domain_ops(loaded) == []
    with torch.no_grad():
        reference = [tied["model"](*batch) for batch in held_out]
        quantized = [program(*batch) for batch in held_out]
    assert pure_qdq.decibels_below(reference, quantized, from_file) <= 1.0
    assert _state(program) == tied["program_state"] and _state(tied["model"]) == tied["float_state"]


def test_lpbq_encodings_are_compact_and_say_the_same(tmp_path: Path) -> None:
    from quantplug_qnn_htp import encodings as enc

    program, quantizer = _quantize(_llama(), precision="16a4w_block", block_size=16)
    artifact = quantplug.lower(program, quantizer)
    # the tied table's uses quantize it differently here (16-bit table, LPBQ head): two tables, said so
    (twice,) = artifact.metadata["parameters_stored_twice"]
    assert len(twice["initializers"]) == 2 and "lm_head" in twice["parameter"]
    text = artifact.files["model.encodings"]
    assert isinstance(text, str)
    document = json.loads(text)
    pytest.importorskip("jsonschema").validate(document, enc.schema("1.0.0"))
    lpbq = [e for e in document["param_encodings"] if e["enc_type"] == "LPBQ"]
    assert lpbq, "no LPBQ weight: the test tests nothing"
    for entry in lpbq:
        scales = entry["per_block_int_scale"]
        assert all(type(s) is int and 1 <= s <= 16 for s in scales)
        blocks, rest = divmod(len(scales), len(entry["scale"]))  # per channel: input channels / block
        assert rest == 0 and blocks * entry["block_size"] in (HIDDEN, 128)
    # the text is the document, one tensor a line, no space inside an entry
    lines = text.splitlines()
    tensors = len(document["activation_encodings"]) + len(document["param_encodings"])
    assert sum(1 for line in lines if line.startswith('    {"name":')) == tensors
    compact = json.dumps(document, separators=(",", ":"))
    assert len(text) <= len(compact) + 8 * (tensors + len(document) + 4)
