"""Lowering never loses a tensor (issue 11.4): every Q/DQ node of the converted program has exactly
one ONNX node, with the program's qparams, on the models where name-based mapping failed
(identical LayerNorms, TransformerEncoder, LSTM/GRU, SDPA, decomposed ops, folded constants,
narrowed ranges), for every preset of both backends."""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.fx import GraphModule

import _quantplug.observers.block_ops
import quantplug
from _quantplug.flow.inspect import encodings as program_encodings

from .models import MODELS, PRESETS, batches, build, preset_id, quantize

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("quantplug_qnn_htp")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

qd = torch.ops.quantized_decomposed
QUANTIZE = {
    qd.quantize_per_tensor.default,
    qd.quantize_per_channel.default,
    _quantplug.observers.block_ops.quantize_per_block,
}
DEQUANTIZE = {
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_channel.default,
    _quantplug.observers.block_ops.dequantize_per_block,
}


@functools.cache
def converted(model: str, backend: str, options_key: str) -> tuple[Any, GraphModule]:
    options = dict(json.loads(options_key))
    net, shape = build(model)
    program = torch.export.export(net, batches(shape, 1, seed=0)[0])
    return quantize(program, backend, options, batches(shape, 4, seed=1))


def _converted(model: str, backend: str, options: dict[str, Any]) -> tuple[Any, GraphModule]:
    return converted(model, backend, json.dumps(sorted(options.items())))


def _initializers(model: Any) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def check_exact(program: GraphModule, model: Any, entries: list[dict[str, Any]]) -> None:
    """Each Q/DQ node of ``program`` is one ONNX node carrying its qparams; each encoding names it."""
    targets = Counter(n.target for n in program.graph.nodes if n.op == "call_function")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["QuantizeLinear"] == sum(targets[t] for t in QUANTIZE)
    assert ops["DequantizeLinear"] == sum(targets[t] for t in DEQUANTIZE)
    nodes = {n.name: n for n in model.graph.node}
    assert len(nodes) == len(model.graph.node), "node names are unique"
    consumers: dict[str, list[Any]] = {}
    producers = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = _initializers(model)
    for entry in entries:
        info = entry["onnx"]
        assert info is not None, entry["node"]
        node = nodes[info["node"]]
        scale = inits[info["scale"]]
        if entry["kind"] == "activation":
            assert node.op_type == "QuantizeLinear" and node.input[0] == info["tensor"]
            if producers.get(info["tensor"]) is not None and producers[info["tensor"]].op_type == "Cast":
                pass  # a float16/bfloat16 activation, cast to float32 for QuantizeLinear
            narrowed = consumers[node.output[0]][0] if info["quantized"] != node.output[0] else None
            if narrowed is not None:  # a narrowed range: QuantizeLinear -> Clip
                assert narrowed.op_type == "Clip" and narrowed.output[0] == info["quantized"]
                lo, hi = inits[narrowed.input[1]], inits[narrowed.input[2]]
                assert (int(lo), int(hi)) == (entry["quant_min"], entry["quant_max"])
            for dq in info["dequantized"]:
                reader = producers[dq]
                if reader.op_type == "Cast":  # to the program's float type (bfloat16...)
                    reader = producers[reader.input[0]]
                assert reader.op_type == "DequantizeLinear" and reader.input[0] == info["quantized"]
        else:
            assert node.op_type == "DequantizeLinear" and node.input[0] == info["quantized"]
            assert info["quantized"] in inits
            tensor = producers[info["tensor"]]
            assert tensor is node or (tensor.op_type == "Cast" and tensor.input[0] == node.output[0])
        if entry["granularity"] == "tensor":
            assert scale.shape == () and float(scale) == np.float32(entry["scale"])
            assert int(inits[info["zero_point"]]) == entry["zero_point"]
        elif entry["granularity"] == "channel":
            np.testing.assert_array_equal(scale, np.float32(entry["scale"]))


@pytest.mark.parametrize("backend,options", PRESETS, ids=[preset_id(*p) for p in PRESETS])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_encoding_has_its_onnx_tensors(
    model: str, backend: str, options: dict[str, Any], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    quantizer, program = _converted(model, backend, options)
    artifact = quantplug.lower(program, quantizer)
    artifact.save(tmp_path)
    onnx_model = onnx.load(str(tmp_path / "model.onnx"))
    names = {v for n in onnx_model.graph.node for v in (*n.input, *n.output)} | set(_initializers(onnx_model))
    if backend == "reference":
        doc = json.loads((tmp_path / "encodings.json").read_text())
        assert len(doc["encodings"]) == len(program_encodings(program))
        mapped = [e for e in doc["encodings"] if e["onnx"] is not None]
        # the rewrites for ORT (dynamic linears, MatMulNBits, weights spelled Cast * scale) change
        # the graph on purpose
        fused = [
            e for e in doc["encodings"] if e["onnx"] and {"transposed", "spelled", "layout"} & set(e["onnx"])
        ]
        assert len(mapped) == len(doc["encodings"]), [e["node"] for e in doc["encodings"] if not e["onnx"]]
        for entry in mapped:
            info = entry["onnx"]
            assert {info["quantized"], *info["dequantized"]} - {None} <= names, entry["node"]
        if not fused:
            check_exact(program, onnx_model, doc["encodings"])
    else:
        doc = json.loads((tmp_path / "model.encodings").read_text())
        encoded = [e["name"] for e in doc["activation_encodings"]] + [
            e["name"] for e in doc["param_encodings"]
        ]
        assert set(encoded) <= names
        assert artifact.metadata["encoding_conflicts"] == []
        # as many encodings as distinct quantized tensors in the program
        from _quantplug.lowering.onnx.export import export_qdq_onnx

        result = export_qdq_onnx(program)
        assert result.unmapped == []
        assert len(encoded) == len({e["onnx"]["tensor"] for e in result.encodings})
        check_exact(program, result.model, result.encodings)


def test_identical_layernorms_keep_their_own_dequantize_nodes() -> None:
    """The failure of issue 11: ln1 and ln2 (fresh: equal weights) each keep a DequantizeLinear,
    whose encodings name their own tensors."""
    from _quantplug.lowering.onnx.export import export_qdq_onnx

    _, program = _converted("transformer_block", "qnn_htp", {"precision": "16a8w"})
    result = export_qdq_onnx(program)
    weights = [e for e in result.encodings if e["kind"] == "constant" and e["tensor"].startswith("ln")]
    assert len(weights) == 4  # ln1/ln2 weight and bias
    tensors = {e["onnx"]["tensor"] for e in weights}
    assert len(tensors) == 4
    nodes = {n.name: n for n in result.model.graph.node}
    assert {nodes[e["onnx"]["node"]].op_type for e in weights} == {"DequantizeLinear"}


@pytest.mark.parametrize("clip", [False, True], ids=["encodings", "clip"])
def test_narrowed_range_is_in_the_encodings_or_a_clip(clip: bool) -> None:
    """An activation quantized to int8 [-127, 127] (QuantizeLinear saturates to [-128, 127]): by
    default the range lives in the encodings only (pure Q/DQ); asked for, a Clip after each
    QuantizeLinear makes the ONNX arithmetic the program's."""
    from _quantplug.lowering.onnx.export import export_qdq_onnx
    from quantplug import QuantizationConfig, QuantizationSpec

    act = QuantizationSpec(
        dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric
    )
    reference = quantplug.get_quantizer("reference")
    config = QuantizationConfig(
        input_activation=act, output_activation=act, weight=reference.global_config.weight, bias=None
    )
    quantizer = quantplug.get_quantizer("reference").set_global(config)
    net, shape = build("sdpa")
    prepared = quantplug.prepare(torch.export.export(net, batches(shape, 1, seed=0)[0]), quantizer)
    for batch in batches(shape, 2, seed=1):
        prepared(*batch)
    program = quantplug.convert(prepared)
    result = export_qdq_onnx(program, clip_narrowed_ranges=clip)
    check_exact(program, result.model, result.encodings)
    clips = [n for n in result.model.graph.node if n.op_type == "Clip"]
    activations = [e for e in result.encodings if e["kind"] == "activation"]
    assert activations and len(clips) == (len(activations) if clip else 0)
    assert {(e["quant_min"], e["quant_max"]) for e in activations} == {(-127, 127)}
    # the construction is exact: ONNX Runtime without its graph rewrites gives the program's values
    # (with them, ORT 1.32 rejects int8 activations behind a Clip: a bug of its QDQ transformers)
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(result.model_bytes(), options, providers=["CPUExecutionProvider"])
    (x,) = batches(shape, 1, seed=9)[0]
    (out,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_array_equal(out, program(x).numpy())


def _transformers_model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    if name == "llama":  # rotary embeddings under no_grad: a higher-order op with a submodule
        config = transformers.LlamaConfig(**small, num_key_value_heads=2, vocab_size=100, use_cache=False)
        model = transformers.LlamaModel(config)
    else:
        model = transformers.BertModel(transformers.BertConfig(**small, vocab_size=100))

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).last_hidden_state

    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    return Hidden().eval(), (ids,)


@functools.cache
def _transformers_program(name: str) -> tuple[torch.export.ExportedProgram, tuple[torch.Tensor, ...]]:
    """Built and exported once for both backends; :func:`test_transformers_models_lower_exactly`
    quantizes a copy."""
    model, args = _transformers_model(name)
    return torch.export.export(model, args), args


@pytest.mark.parametrize("backend,options", [("reference", {}), ("qnn_htp", {"precision": "16a8w"})])
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_transformers_models_lower_exactly(name: str, backend: str, options: dict[str, Any]) -> None:
    from _quantplug.lowering.onnx.export import export_qdq_onnx

    program, args = copy.deepcopy(_transformers_program(name))
    quantizer, program = quantize(program, backend, options, [args])
    result = export_qdq_onnx(program)
    check_exact(program, result.model, result.encodings)
    artifact = quantplug.lower(program, quantizer)
    if backend == "reference":
        with torch.no_grad():
            expected = program(*args)
        step = max(e["scale"] for e in result.encodings if e["kind"] == "activation")
        assert float((artifact.run(*args) - expected).abs().max()) <= step * 1.001
