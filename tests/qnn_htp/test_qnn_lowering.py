"""Lowering: QDQ ONNX model + QNN/AIMET encodings (0.6.1, 1.0.0, 2.0.0), checked against a JSON
schema per version, against the ONNX graph's tensor names and against ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import quantplug
from _quantplug.errors import LoweringError
from _quantplug.flow.inspect import encodings as program_encodings

pytest.importorskip("quantplug_qnn_htp")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


def _jsonschema():  # type: ignore[no-untyped-def]
    """Only the schema checks need jsonschema; the other lowering tests run without it."""
    return pytest.importorskip("jsonschema")


from quantplug_qnn_htp import encodings as enc  # noqa: E402

from .models import build  # noqa: E402

VERSIONS = ("0.6.1", "1.0.0", "2.0.0")


def _quantized(name: str, **options: Any) -> tuple[torch.fx.GraphModule, quantplug.Quantizer, tuple]:
    model, example, batches = build(name)
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", **options)
    prepared = quantplug.prepare(torch.export.export(model, example), q)
    for b in batches:
        prepared(*b)
    return quantplug.convert(prepared), q, example


@pytest.fixture(scope="module")
def lowered(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], tuple[Path, Any]]:
    """Each (model, precision) lowered once per encodings version."""
    out: dict[tuple[str, str, str], tuple[Path, Any]] = {}
    for name, precision in (("convnet", "16a4w_block"), ("attention", "16a8w"), ("embedding", "8a8w")):
        quantized, _, example = _quantized(
            name, precision=precision, block_size=16, per_channel_linear=precision == "8a8w"
        )
        for version in VERSIONS:
            if version == "0.6.1" and precision == "16a4w_block":
                continue  # LPBQ cannot be written as 0.6.1 (tested below)
            q = quantplug.get_quantizer(
                "qnn_htp", soc_model="SM8650", precision=precision, block_size=16, encodings_version=version
            )
            directory = tmp_path_factory.mktemp(f"{name}-{version}")
            artifact = quantplug.lower(quantized, q)
            artifact.save(directory)
            out[(name, precision, version)] = (directory, (quantized, example, artifact))
    return out


def _entries(doc: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(name, kind, entry) for every encoding of a document of any version."""
    if doc["version"] == "2.0.0":
        return [(e["name"], "any", e) for e in doc["encodings"]]
    acts, params = doc["activation_encodings"], doc["param_encodings"]
    if doc["version"] == "0.6.1":
        return [(n, "activation", e) for n, e in acts.items()] + [(n, "param", e) for n, e in params.items()]
    return [(e["name"], "activation", e) for e in acts] + [(e["name"], "param", e) for e in params]


@pytest.mark.parametrize("version", VERSIONS)
def test_artifact_files_validate_against_the_schema(lowered: dict, version: str) -> None:
    cases = [k for k in lowered if k[2] == version]
    assert cases
    for key in cases:
        directory, _ = lowered[key]
        assert {p.name for p in directory.iterdir()} == {"model.onnx", "model.encodings", "artifact.json"}
        doc = json.loads((directory / "model.encodings").read_text())
        _jsonschema().validate(doc, enc.schema(version))
        meta = json.loads((directory / "artifact.json").read_text())
        assert meta["encodings_version"] == version and meta["htp_arch"] == "V75"
        assert meta["quantized_tensors"] == len(_entries(doc))


@pytest.mark.parametrize("version", VERSIONS)
def test_encoding_names_are_onnx_tensor_names(lowered: dict, version: str) -> None:
    for key in [k for k in lowered if k[2] == version]:
        directory, _ = lowered[key]
        model = onnx.load(str(directory / "model.onnx"))
        doc = json.loads((directory / "model.encodings").read_text())
        q_inputs = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
        dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
        initializers = {i.name for i in model.graph.initializer}
        names = [name for name, _, _ in _entries(doc)]
        assert len(names) == len(set(names)), "one encoding per tensor"
        for name, kind, _ in _entries(doc):
            if kind == "activation":
                assert name in q_inputs, (key, name)
            elif kind == "param":
                assert name in dq_outputs or name in initializers, (key, name)
            else:
                assert name in q_inputs | dq_outputs | initializers, (key, name)
        # weights get readable names: the float tensor their DequantizeLinear produces
        if version != "2.0.0":
            params = [n for n, kind, _ in _entries(doc) if kind == "param"]
            assert any(p.endswith("_weight") for p in params), params


def test_onnx_model_runs_like_the_quantized_program(lowered: dict) -> None:
    ort = pytest.importorskip("onnxruntime")
    # the 16-bit attention model is left out: ONNX Runtime 1.31 refuses to load it ("Could not find
    # an implementation for Where(16)"), with the core exporter alone too (see the qnn_htp README)
    for key in [k for k in lowered if k[2] == "1.0.0" and k[0] != "attention"]:
        directory, (quantized, example, _) = lowered[key]
        # The HTP computes qnn_htp's numbers, not ORT's integer kernels: ORT runs the QDQ graph as
        # written (DequantizeLinear -> float op -> QuantizeLinear), which is CPU-independent. Its
        # fused U8S8 kernels would saturate 8-bit weights' pair sums on AVX2 CPUs without VNNI
        # (see quantplug_reference.peers.accumulation) and test ORT's CPU rather than the file.
        options = ort.SessionOptions()
        options.add_session_config_entry("session.disable_quant_qdq", "1")
        options.optimized_model_filepath = str(directory / "optimized.onnx")
        sess = ort.InferenceSession(
            str(directory / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        ran = {n.op_type for n in onnx.load(str(directory / "optimized.onnx")).graph.node}
        assert not {
            op for op in ran if op.startswith(("QLinear", "QGemm", "MatMulInteger", "ConvInteger"))
        }, ran
        (directory / "optimized.onnx").unlink()
        feeds = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), example)}
        (out,) = sess.run(None, feeds)
        with torch.no_grad():
            ref = quantized(*example)
        assert float(abs(out - ref.numpy()).max()) < 1e-3 * float(ref.abs().max() + 1), key


def _doc(lowered: dict, name: str, version: str) -> dict[str, Any]:
    key = next(k for k in lowered if k[0] == name and k[2] == version)
    return json.loads((lowered[key][0] / "model.encodings").read_text())


def test_qnn_conventions_in_1_0_0(lowered: dict) -> None:
    doc = _doc(lowered, "convnet", "1.0.0")
    acts = {e["name"]: e for e in doc["activation_encodings"]}
    params = {e["name"]: e for e in doc["param_encodings"]}
    quantized = next(v[1][0] for k, v in lowered.items() if k == ("convnet", "16a4w_block", "1.0.0"))
    table = {e["tensor"]: e for e in program_encodings(quantized) if e["kind"] == "activation"}
    # activations: uint16, offset = -zero_point on the unsigned grid
    x = acts["x"]
    assert (x["bw"], x["is_sym"], x["enc_type"]) == (16, False, "PER_TENSOR")
    assert x["offset"] == [-table["x"]["zero_point"]] and x["scale"] == [pytest.approx(table["x"]["scale"])]
    assert acts["sigmoid"]["scale"] == [1 / 65536] and acts["sigmoid"]["offset"] == [0]
    # 4-bit per-channel conv weights: symmetric, offset -2^(bw-1) = -8 on the unsigned grid
    w = params["conv1_weight"]
    assert (w["enc_type"], w["bw"], w["is_sym"]) == ("PER_CHANNEL", 4, True)
    assert set(w["offset"]) == {-8} and len(w["scale"]) == 16
    # int32 biases: symmetric, offset -2^31
    b = params["conv1_bias"]
    assert (b["bw"], set(b["offset"])) == (32, {-(2**31)})
    # LPBQ: bw 8 decompressed, 4-bit compressed, per-channel float scales and 4-bit block ints
    lp = params["conv3_weight"]
    assert (lp["enc_type"], lp["bw"], lp["compressed_bw"], lp["block_size"]) == ("LPBQ", 8, 4, 16)
    assert len(lp["scale"]) == 32 and set(lp["offset"]) == {-128}
    assert len(lp["per_block_int_scale"]) == 32 * 2 and max(lp["per_block_int_scale"]) == 16
    assert min(lp["per_block_int_scale"]) >= 1


def test_qnn_conventions_in_0_6_1_and_2_0_0(lowered: dict) -> None:
    old = _doc(lowered, "attention", "0.6.1")
    new = _doc(lowered, "attention", "2.0.0")
    by_name = {e["name"]: e for e in new["encodings"]}
    # 16a8w per-tensor weights: uint8 symmetric with zero point 128
    w_old = old["param_encodings"]["q_weight"]
    assert len(w_old) == 1 and w_old[0]["offset"] == -128 and w_old[0]["is_symmetric"] == "True"
    assert w_old[0]["min"] == pytest.approx(-128 * w_old[0]["scale"])
    assert w_old[0]["max"] == pytest.approx(127 * w_old[0]["scale"])
    assert by_name["q_weight"]["output_dtype"] == "uint8" and by_name["q_weight"]["y_zero_point"] == 128
    # MatMul input 1: int16 symmetric (a requantized tensor): no zero point in 2.0.0, -32768 in 0.6.1
    int16 = [e for e in new["encodings"] if e["output_dtype"] == "int16" and e["name"] != "ln_weight"]
    assert len(int16) == 2 and all("y_zero_point" not in e for e in int16)
    for e in int16:
        assert old["activation_encodings"][e["name"]][0]["offset"] == -32768
    # -inf mask constant: shares the masked output's 16-bit encoding
    mask_out = by_name["masked_fill"]
    assert mask_out["output_dtype"] == "uint16"
    const = next(e for e in new["encodings"] if e["name"].startswith("_tensor_constant_1"))
    assert (const["y_scale"], const["y_zero_point"]) == (mask_out["y_scale"], mask_out["y_zero_point"])
    # biases in 2.0.0: int32, zero points omitted
    assert by_name["q_bias"]["output_dtype"] == "int32" and "y_zero_point" not in by_name["q_bias"]


def test_embedding_8a8w_per_channel_linear(lowered: dict) -> None:
    doc = _doc(lowered, "embedding", "2.0.0")
    by_name = {e["name"]: e for e in doc["encodings"]}
    # the table is quantized with the activation grid and the lookup shares it (QNN Gather)
    assert by_name["emb_weight"]["y_scale"] == by_name["embedding"]["y_scale"]
    assert by_name["fc1_weight"]["axis"] == 0 and len(by_name["fc1_weight"]["y_scale"]) == 16
    old = _doc(lowered, "embedding", "0.6.1")
    assert len(old["param_encodings"]["fc1_weight"]) == 16  # 0.6.1: a list per channel
    assert "emb_weight" in old["param_encodings"]  # an integer initializer: a parameter


def test_lpbq_needs_1_0_0_or_later() -> None:
    quantized, _, _ = _quantized("convnet", precision="16a4w_block", block_size=16)
    q = quantplug.get_quantizer("qnn_htp", precision="16a4w_block", encodings_version="0.6.1")
    with pytest.raises(LoweringError, match=r"conv3_weight.*1\.0\.0 or 2\.0\.0"):
        quantplug.lower(quantized, q)


def test_unencodable_tensors_are_reported_before_export() -> None:
    """A per-tensor 2-bit weight (ExecuTorch fails late, in its QNN builder: P7)."""
    from quantplug import QuantizationConfig, QuantizationSpec

    model, example, batches = build("embedding")
    act = quantplug.get_quantizer("qnn_htp", precision="16a2w").global_config.input_activation
    two_bit = QuantizationConfig(
        input_activation=act,
        output_activation=act,
        weight=QuantizationSpec(
            dtype=torch.int2, quant_min=-2, quant_max=1, qscheme=torch.per_tensor_symmetric
        ),
        bias=None,
    )
    q = quantplug.get_quantizer("qnn_htp", precision="16a2w", soc_model="SM8650", strict=False)
    q.set_node_name("linear_1", two_bit)
    prepared = quantplug.prepare(torch.export.export(model, example), q)
    for b in batches:
        prepared(*b)
    quantized = quantplug.convert(prepared)
    with pytest.raises(LoweringError) as err:
        quantplug.lower(quantized, q)
    assert (
        "fc2_weight" in str(err.value) and "2-bit" in str(err.value) and "per-channel only" in str(err.value)
    )


# --- the pure functions ---------------------------------------------------------------------------


def test_offsets_datatypes_and_axes() -> None:
    assert enc.bitwidth(-7, 7) == 4 and enc.bitwidth(-127, 127) == 8 and enc.bitwidth(0, 65535) == 16
    assert enc.bitwidth(-2, 1) == 2 and enc.bitwidth(-(2**31), 2**31 - 1) == 32
    assert enc.qnn_offset(133) == -133
    assert enc.aimet_offset(133, 8, signed=False) == -133
    assert enc.aimet_offset(0, 8, signed=True) == -128 and enc.aimet_offset(0, 4, signed=True) == -8
    assert enc.qnn_datatype(16, False) == "QNN_DATATYPE_UFIXED_POINT_16"
    assert enc.qnn_datatype(4, True) == "QNN_DATATYPE_SFIXED_POINT_8"  # 4-bit in an 8-bit container
    assert enc.qnn_datatype(32, True) == "QNN_DATATYPE_SFIXED_POINT_32"
    assert enc.qnn_axis(0, 4, "Conv2d") == 3 and enc.qnn_axis(1, 4, "TransposeConv2d") == 3
    assert enc.qnn_axis(0, 2, "FullyConnected") == 0
    assert enc.onnx_dtype_name(4, True) == "int4" and enc.onnx_dtype_name(16, False) == "uint16"


def test_qnn_tensor_views() -> None:
    act = enc.from_entry(
        {
            "granularity": "tensor",
            "scale": 0.5,
            "zero_point": 10,
            "quant_min": 0,
            "quant_max": 255,
            "tensor": "a",
        }
    )
    assert act.qnn_tensor() == {
        "datatype": "QNN_DATATYPE_UFIXED_POINT_8",
        "encoding": "QNN_QUANTIZATION_ENCODING_SCALE_OFFSET",
        "bitwidth": 8,
        "scale": 0.5,
        "offset": -10,
    }
    w4 = enc.from_entry(
        {
            "granularity": "channel",
            "scale": [0.1, 0.2],
            "zero_point": [0, 0],
            "axis": 0,
            "quant_min": -7,
            "quant_max": 7,
            "kind": "constant",
            "tensor": "w",
        }
    )
    view = w4.qnn_tensor(rank=4, consumer="Conv2d")
    assert view["encoding"] == "QNN_QUANTIZATION_ENCODING_BW_AXIS_SCALE_OFFSET" and view["axis"] == 3
    assert view["scale_offsets"] == [(0.1, 0), (0.2, 0)] and w4.symmetric and w4.kind == "param"
    scales = torch.tensor([[16.0, 3.0], [16.0, 16.0]]) * 0.01
    lp = enc.from_entry(
        {
            "granularity": "block",
            "scale": scales.tolist(),
            "zero_point": [[0, 0], [0, 0]],
            "block_size": [1, 16],
            "quant_min": -7,
            "quant_max": 7,
            "kind": "constant",
            "tensor": "fc",
        },
        shape=(2, 32),
    )
    lv = lp.qnn_tensor(rank=2, consumer="FullyConnected")
    assert lv["encoding"] == "QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION"
    assert lv["block_scales"] == [16, 3, 16, 16] and lv["num_blocks_per_axis"] == 2
    assert lv["scale_offsets"] == [(pytest.approx(0.01), 0), (pytest.approx(0.01), 0)]


def test_non_lpbq_blocks_and_2bit_per_tensor_are_rejected() -> None:
    with pytest.raises(enc.EncodingError, match="4-bit multiples"):
        enc.lpbq_parts(torch.tensor([[0.016, 0.0031]]), [1, 16], (1, 32))
    with pytest.raises(enc.EncodingError, match="kernel window"):
        enc.lpbq_parts(torch.full((2, 2, 3, 3), 0.1), [1, 16, 1, 1], (2, 32, 3, 3))
    with pytest.raises(enc.EncodingError, match="2-bit"):
        enc.from_entry(
            {
                "granularity": "tensor",
                "scale": 0.1,
                "zero_point": 0,
                "quant_min": -2,
                "quant_max": 1,
                "tensor": "w",
            }
        )
    with pytest.raises(enc.EncodingError, match="valid values"):
        enc.to_aimet([], "3.0.0")


def test_schemas_reject_malformed_documents() -> None:
    jsonschema = _jsonschema()
    bad_offset = {
        "version": "1.0.0",
        "activation_encodings": [
            {
                "name": "x",
                "dtype": "INT",
                "enc_type": "PER_TENSOR",
                "bw": 8,
                "is_sym": False,
                "scale": [0.1],
                "offset": [5],
            }
        ],
        "param_encodings": [],
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_offset, enc.schema("1.0.0"))  # offsets are <= 0 on the unsigned grid
    string_bool = {
        "version": "0.6.1",
        "activation_encodings": {
            "x": [
                {
                    "bitwidth": 8,
                    "dtype": "int",
                    "is_symmetric": False,
                    "min": 0,
                    "max": 1,
                    "scale": 0.1,
                    "offset": 0,
                }
            ]
        },
        "param_encodings": {},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(string_bool, enc.schema("0.6.1"))  # 0.6.1 booleans are strings
    lpbq_bad = {
        "version": "2.0.0",
        "encodings": [
            {
                "name": "w",
                "output_dtype": "int4",
                "axis": 1,
                "block_size": 16,
                "per_channel_float_scale": [[0.1]],
                "per_block_int_scale": [[17]],
            }
        ],
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lpbq_bad, enc.schema("2.0.0"))  # 4-bit block scales are 1..16
