"""An op the ONNX translator expands into a computation and data movement after it gets its
encoding on the computed tensor too (``adaptive_avg_pool2d`` on a permuted tensor became
``ReduceMean -> Reshape -> Gather`` with the quantize after the Gather: convnext's lowering was
refused as incomplete)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("quantplug_qnn_htp")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from quantplug_qnn_htp.encodings import QnnEncoding  # noqa: E402
from quantplug_qnn_htp.lowering import _carry_back_over_moves  # noqa: E402

OUT = QnnEncoding("pooled", "activation", 16, False, False, (0.01,), (32768,), 0, 65535)


def _model(extra_reader: bool) -> Any:
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "s", "z"], ["x_dq"]),
        helper.make_node("ReduceMean", ["x_dq", "axes"], ["mean"]),
        helper.make_node("Reshape", ["mean", "shape"], ["flat"]),
        helper.make_node("Gather", ["flat", "index"], ["pooled"]),
        helper.make_node("QuantizeLinear", ["pooled", "s", "z"], ["pooled_q"]),
        helper.make_node("DequantizeLinear", ["pooled_q", "s", "z"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:  # the computed tensor is read elsewhere too: its range is its own
        nodes.append(helper.make_node("Relu", ["mean"], ["other"]))
        outputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, None))
    inits = {
        "s": np.array(0.01, np.float32),
        "z": np.array(32768, np.uint16),
        "axes": np.array([2, 3], np.int64),
        "shape": np.array([2, 4], np.int64),
        "index": np.array([0, 1, 2, 3], np.int64),
    }
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3, 3])],
        outputs,
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_the_computed_tensor_takes_the_encoding_after_the_moves() -> None:
    names = {"x": dataclasses.replace(OUT, name="x"), "pooled": OUT}
    _carry_back_over_moves(_model(extra_reader=False), names)
    assert {"flat", "mean"} <= set(names)
    assert names["mean"].scale == OUT.scale and names["mean"].name == "mean"
    assert "x_dq" not in names  # a dequantized tensor is already encoded through its pair


def test_a_tensor_read_elsewhere_keeps_no_borrowed_encoding() -> None:
    names = {"pooled": OUT}
    _carry_back_over_moves(_model(extra_reader=True), names)
    assert "flat" in names and "mean" not in names
