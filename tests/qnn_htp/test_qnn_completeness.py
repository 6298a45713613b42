"""The completeness check of model.encodings (issue 17.2): every tensor of an op HTP runs
quantized has an encoding; what stays float is listed with its reason; strict refuses the rest."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import quantplug

pytest.importorskip("quantplug_qnn_htp")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from quantplug_qnn_htp.completeness import IncompleteEncodingsError, check  # noqa: E402

F32, U8 = TensorProto.FLOAT, TensorProto.UINT8


def _model(nodes: list[Any], inits: dict[str, Any], inputs: list[str], outputs: list[str]) -> Any:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F32, [2, 4]) for n in inputs],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _qdq(src: str, dst: str) -> list[Any]:
    return [
        helper.make_node("QuantizeLinear", [src, "s", "z"], [src + "_q"]),
        helper.make_node("DequantizeLinear", [src + "_q", "s", "z"], [dst]),
    ]


INITS: dict[str, Any] = {
    "s": __import__("numpy").array(0.1, dtype="float32"),
    "z": __import__("numpy").array(128, dtype="uint8"),
    "lo": __import__("numpy").array(-1.0, dtype="float32"),
    "hi": __import__("numpy").array(1.0, dtype="float32"),
    "shape": __import__("numpy").array([4, 2], dtype="int64"),
}


def test_qdq_pairs_data_movement_and_parameters_count_as_encoded() -> None:
    nodes = [
        *_qdq("x", "x_dq"),
        helper.make_node("Reshape", ["x_dq", "shape"], ["r"]),  # inherits x's encoding
        helper.make_node("Clip", ["r", "lo", "hi"], ["c"]),  # lo/hi: op parameters
        *_qdq("c", "c_dq"),
        helper.make_node("Relu", ["c_dq"], ["y"]),
        *_qdq("y", "out"),
    ]
    report = check(_model(nodes, INITS, ["x"], ["out"]), ["x", "c", "y"])
    assert report.complete and report.fraction == 1.0
    assert report.quantized_ops == 3 and report.inherited == 1
    assert report.tensors == 5  # x_dq, r, c, c_dq, y (the Clip bounds are not tensors QNN encodes)


def test_clip_bounds_cast_like_their_input_are_constants() -> None:
    """ReLU6 / hardtanh export as ``CastLike(min_val, x) -> Clip``: the cast reads only x's type,
    so its output is a constant bound, not a tensor of a quantized op (mobilenet_v2 once failed
    strict lowering on it)."""
    nodes = [
        *_qdq("x", "x_dq"),
        helper.make_node("CastLike", ["lo", "x_dq"], ["lo_cast"]),
        helper.make_node("CastLike", ["hi", "x_dq"], ["hi_cast"]),
        helper.make_node("Clip", ["x_dq", "lo_cast", "hi_cast"], ["c"]),
        *_qdq("c", "out"),
    ]
    report = check(_model(nodes, INITS, ["x"], ["out"]), ["x", "c"])
    assert report.complete, report.missing
    assert report.float_ops == 0 and report.quantized_ops == 1


def test_an_expanded_op_leaves_its_intermediates_missing() -> None:
    nodes = [
        *_qdq("x", "x_dq"),
        helper.make_node("Mul", ["x_dq", "x_dq"], ["sq"]),  # no Q/DQ between Mul and Sqrt
        helper.make_node("Sqrt", ["sq"], ["y"]),
        *_qdq("y", "out"),
    ]
    model = _model(nodes, INITS, ["x"], ["out"])
    report = check(model, ["x", "y"])
    assert not report.complete and [t.tensor for t in report.missing] == ["sq"]
    assert report.encoded == 2 and report.tensors == 3
    assert "sq" in report.warnings()[0]
    with pytest.raises(IncompleteEncodingsError) as err:
        from quantplug_qnn_htp.completeness import check_completeness

        check_completeness(model, ["x", "y"], strict=True)
    assert "'sq'" in str(err.value) and "strict=False" in str(err.value)
    assert isinstance(err.value, quantplug.QuantplugError)


def test_float_ops_are_listed_not_missing() -> None:
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Neg", ["e"], ["out"])]
    report = check(_model(nodes, INITS, ["x"], ["out"]), [])
    assert report.complete and report.float_ops == 2 and report.tensors == 0
    assert {t.tensor for t in report.float_tensors} == {"x", "e", "out"}


def test_tensors_computed_from_shapes_are_constants() -> None:
    """``Shape`` reads no values: QNN graphs have static shapes, so the converter folds what is
    computed from shapes as from constants. A dynamic-batch ``torch.zeros`` exports as
    ``Expand(0.0, Shape...)``, whose ``0.0`` once counted as a tensor of a quantized op without an
    encoding; a float tensor computed from values still counts."""
    nodes = [
        *_qdq("x", "x_dq"),
        helper.make_node("Shape", ["x"], ["dims"]),
        helper.make_node("Expand", ["lo", "dims"], ["zeros"]),
        *_qdq("zeros", "zeros_dq"),
        helper.make_node("Add", ["x_dq", "zeros_dq"], ["y"]),
        helper.make_node("Expand", ["x_dq", "dims"], ["wide"]),  # from x's values: inherits
        helper.make_node("Mul", ["wide", "x_dq"], ["sq"]),  # from x's values: missing
        helper.make_node("Sqrt", ["sq"], ["r"]),
        *_qdq("y", "out"),
        *_qdq("r", "out2"),
    ]
    report = check(_model(nodes, INITS, ["x"], ["out", "out2"]), ["x", "zeros", "y", "r"])
    assert [t.tensor for t in report.missing] == ["sq"]
    assert report.inherited == 1  # the Expand of x


class ZeroInitialState(nn.Module):
    """A recurrent step from a zero state sized by the batch, as ``nn.LSTM`` with ``proj_size``
    and Mamba make it: ``torch.zeros(batch, n)`` exports as ``Expand(0.0, Concat(Shape(x)...))``
    (its ``0.0`` once counted as a tensor missing an encoding, and strict lowering refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.rec = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros(x.shape[0], 8)
        return torch.tanh(self.inp(x) + self.rec(state))


def test_a_zero_state_sized_by_a_dynamic_batch_lowers(tmp_path: Any) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(ZeroInitialState().eval(), (x,), dynamic_shapes=({0: batch},))
    quantizer = quantplug.get_quantizer("qnn_htp", precision="8a8w")
    prepared = quantplug.prepare(program, quantizer)
    prepared(torch.randn(4, 8))
    artifact = quantplug.lower(quantplug.convert(prepared), quantizer)  # strict
    artifact.save(tmp_path)
    report = json.loads((tmp_path / "artifact.json").read_text())["encoding_completeness"]
    assert report["complete"] and report["fraction"] == 1.0


class HalfCast(nn.Module):
    """A linear, then a round trip through float16: ONNX Cast ops the HTP quantized graph does
    not encode (the fp16 tensor has no Q/DQ)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x).to(torch.float16).to(torch.float32))


def _lower(model: nn.Module, **options: Any) -> Any:
    x = torch.randn(2, 8)
    quantizer = quantplug.get_quantizer("qnn_htp", precision="8a8w", **options)
    prepared = quantplug.prepare(torch.export.export(model.eval(), (x,)), quantizer)
    prepared(x)
    return quantplug.lower(quantplug.convert(prepared), quantizer)


def test_strict_lowering_refuses_an_incomplete_file_and_lenient_lists_it(tmp_path: Any) -> None:
    with pytest.raises(IncompleteEncodingsError) as err:
        _lower(HalfCast())  # strict=True is the default
    assert err.value.missing and all(t.onnx_op == "Cast" for t in err.value.missing)
    artifact = _lower(HalfCast(), strict=False)
    artifact.save(tmp_path)
    meta = json.loads((tmp_path / "artifact.json").read_text())
    report = meta["encoding_completeness"]
    assert not report["complete"] and report["missing"] and report["fraction"] < 1.0
    assert any("no encoding" in w for w in meta["warnings"])
    assert (tmp_path / "model.encodings").exists()


def test_discarded_ops_are_float_with_their_reason() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    x = torch.randn(2, 8)
    quantizer = quantplug.get_quantizer("qnn_htp", precision="8a8w", strict=False)
    quantizer.discard(ops=[torch.ops.aten.tanh.default])
    prepared = quantplug.prepare(torch.export.export(Net().eval(), (x,)), quantizer)
    prepared(x)
    quantized = quantplug.convert(prepared)
    artifact = quantplug.lower(quantized, quantizer)
    report = artifact.metadata["encoding_completeness"]
    tanh = [t for t in report["float_tensors"] if t["onnx_op"] == "Tanh"]
    assert tanh and all("discarded" in t["reason"] for t in tanh)
    assert any("left float" in w and "discarded" in w for w in artifact.metadata["warnings"])
    # the linears around it keep quantized weights with float activations: half-quantized ops,
    # listed as missing with the discarded neighbour as the reason (strict lowering refuses them)
    missing = {t["tensor"]: t["reason"] for t in report["missing"]}
    assert "'tanh'" in missing["linear"] and "'tanh'" in missing["tanh"]
    assert "bias of a layer whose input has no encoding" in missing["b.bias"]
    quantizer.strict = True
    with pytest.raises(IncompleteEncodingsError, match="tanh"):
        quantplug.lower(quantized, quantizer)


def test_quantizer_strict_reaches_the_backend_context() -> None:
    quantizer = quantplug.get_quantizer("qnn_htp")
    assert quantizer.strict and quantizer.context.strict
    quantizer.strict = False
    assert not quantizer.context.strict
    assert not quantplug.get_quantizer("qnn_htp", strict=False).context.strict


class PermutedPool(nn.Module):
    """ConvNeXt's tail: a block computed channels-last, permuted back, then a global average pool
    on a tensor whose strides are channels-last (torch's ONNX translator expands that pool into
    ReduceMean, Reshape and a stride-restoring Gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = self.fc(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + y  # strides of the first operand
        return nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)


@pytest.mark.parametrize("precision", ["8a8w", "16a16w"])
def test_global_pool_of_a_channels_last_tensor_is_encoded(precision: str) -> None:
    model = PermutedPool().eval()
    x = torch.randn(2, 4, 6, 6)
    program = torch.export.export(model, (x,))
    quantizer = quantplug.get_quantizer("qnn_htp", precision=precision)  # strict
    prepared = quantplug.prepare(program, quantizer)
    assert torch.equal(prepared(x), model(x))  # the rewrite into mean changes no value
    artifact = quantplug.lower(quantplug.convert(prepared), quantizer)
    report = artifact.metadata["encoding_completeness"]
    assert report["complete"] and report["fraction"] == 1.0
    ops = [n.op_type for n in onnx.load_from_string(artifact.files["model.onnx"]).graph.node]
    assert "ReduceMean" in ops and "Gather" not in ops


class PlainNorms(nn.Module):
    """Norms without affine parameters: InstanceNorm2d's default, GroupNorm(affine=False),
    LayerNorm(elementwise_affine=False) (the ONNX exporter makes their missing scale and bias with
    Expand/CastLike after the last quantize/dequantize)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.instance = nn.InstanceNorm2d(8)
        self.group = nn.GroupNorm(2, 8, affine=False)
        self.layer = nn.LayerNorm(4, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.instance(self.conv(x)))
        return self.layer(torch.relu(self.group(y)))


@pytest.mark.parametrize("precision", ["8a8w", "16a8w"])
def test_norms_without_affine_parameters_are_encoded(precision: str) -> None:
    model = PlainNorms().eval()
    x = torch.randn(2, 3, 6, 6)
    quantizer = quantplug.get_quantizer("qnn_htp", precision=precision)  # strict
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    prepared(x)
    quantized = quantplug.convert(prepared)
    artifact = quantplug.lower(quantized, quantizer)
    report = artifact.metadata["encoding_completeness"]
    assert report["complete"] and report["fraction"] == 1.0
    ops = {n.op_type for n in onnx.load_from_string(artifact.files["model.onnx"]).graph.node}
    assert {"InstanceNormalization", "GroupNormalization", "LayerNormalization"} <= ops
    assert "Expand" not in ops  # no scale made by the exporter
    with torch.no_grad():
        out, ref = quantized(x), model(x)
    assert float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 0.05  # unit weights, as the model


class PreActivation(nn.Module):
    """DenseNet's layer: batch norm and ReLU before a bias-less conv (no norm after it to fold a
    bias into), its output concatenated with its input; and a bias-less Conv1d."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.conv1d = nn.Conv1d(8, 8, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([x, self.conv(torch.relu(self.norm(x)))], dim=1)
        return self.conv1d(y.flatten(2))  # type: ignore[no-any-return]


@pytest.mark.parametrize("precision", ["8a8w", "16a4w_block"])
def test_convs_without_bias_are_encoded(precision: str) -> None:
    model = PreActivation().eval()
    x = torch.randn(2, 4, 6, 6)
    quantizer = quantplug.get_quantizer("qnn_htp", precision=precision)  # strict
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    assert torch.allclose(prepared(x), model(x), atol=1e-6)  # a zero bias changes nothing
    artifact = quantplug.lower(quantplug.convert(prepared), quantizer)
    report = artifact.metadata["encoding_completeness"]
    assert report["complete"] and report["fraction"] == 1.0
    ops = [n.op_type for n in onnx.load_from_string(artifact.files["model.onnx"]).graph.node]
    assert ops.count("Conv") == 2 and "Expand" not in ops
