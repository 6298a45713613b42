"""Overrides on a qnn_htp quantizer: per-submodule configs, per-node LPBQ block sizes, discarded
nodes/ops (edges float too), custom annotation callbacks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.errors import OptionError

pytest.importorskip("quantplug_qnn_htp")

from quantplug_qnn_htp import make_config, set_block_size_map

from .models import build

qd = torch.ops.quantized_decomposed
Q = (qd.quantize_per_tensor.default,)
DQ = (qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default)


def _quantize(name: str, quantizer: quantplug.Quantizer) -> torch.fx.GraphModule:
    model, example, batches = build(name)
    prepared = quantplug.prepare(torch.export.export(model, example), quantizer)
    for b in batches:
        prepared(*b)
    return quantplug.convert(prepared)


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _is_qdq(n: object) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and "quantize" in str(n.target)


def _out_q(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node | None:
    return next((u for u in _node(gm, name).users if u.target in Q), None)


# --- per-submodule configs ---------------------------------------------------------------------------


def test_module_name_and_type_overrides_mix_precisions() -> None:
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    q.set_module_name("conv3", make_config("16a8w"))  # one submodule at 16 bits
    q.set_module_type(nn.Conv2d, None)  # ... but conv1/conv2 (type rule) float
    q.set_module_name("conv1", make_config("8a8w"))  # a name beats a type
    gm = _quantize("convnet", q)
    assert _out_q(gm, "conv2d_2").args[-1] == torch.uint16  # conv3 at 16 bits
    assert _out_q(gm, "conv2d").args[-1] == torch.uint8  # conv1 by name: 8a8w
    conv2 = _node(gm, "conv2d_1")
    assert not any(_is_qdq(a) for a in conv2.args[:3]) and _out_q(gm, "conv2d_1") is None  # conv2: float
    # 16-bit conv3 reads the 8-bit cat output through a requantization on its input edge
    x_dq = _node(gm, "conv2d_2").args[0]
    assert x_dq.args[-1] == torch.uint16 and x_dq.args[0].args[0].target in DQ


def test_filter_override_with_predicate() -> None:
    q = quantplug.get_quantizer("qnn_htp", precision="16a8w", soc_model="SM8650")
    q.set_filter(lambda n: n.name.startswith("linear"), make_config("8a8w", per_channel_linear=True))
    gm = _quantize("attention", q)
    w = _node(gm, "linear_3").args[1]
    assert w.target == qd.dequantize_per_channel.default and tuple(w.args[4:6]) == (-127, 127)
    assert _out_q(gm, "softmax").args[-1] == torch.uint16


# --- per-node LPBQ block sizes -----------------------------------------------------------------------


def _block_of(gm: torch.fx.GraphModule, name: str) -> tuple[int, ...] | None:
    w = _node(gm, name).args[1]
    return tuple(w.args[3]) if "per_block" in str(w.target) else None


def test_block_size_map_applies_per_node_without_leaking() -> None:
    """ExecuTorch writes each node's block size into one shared observer partial, so the last
    node's size wins for all (anchor 5.3 / P4); here each node keeps its own."""
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w_block", block_size=0)
    set_block_size_map(q, {"linear": (1, 16), "linear_3": 8, "linear_1": "32"})
    gm = _quantize("attention", q)
    assert _block_of(gm, "linear") == (1, 16)
    assert _block_of(gm, "linear_3") == (1, 8)
    assert _block_of(gm, "linear_1") is None  # 32 input channels, block 32: one block = per channel
    assert _block_of(gm, "linear_2") is None  # not in the map, block_size=0
    assert _node(gm, "linear_2").args[1].target == qd.dequantize_per_channel.default


def test_block_size_map_option_text_and_global_default() -> None:
    q = quantplug.get_quantizer(
        "qnn_htp",
        soc_model="SM8650",
        precision="16a4w_block",
        block_size=16,
        block_size_map="linear_2:8,linear:0",
    )
    gm = _quantize("attention", q)
    assert _block_of(gm, "linear_2") == (1, 8)
    assert _block_of(gm, "linear") is None  # 0: kept per channel
    assert _block_of(gm, "linear_1") == (1, 16) == _block_of(gm, "linear_3")  # global block_size


def test_block_size_map_rejects_unknown_nodes_and_bad_values() -> None:
    q = quantplug.get_quantizer("qnn_htp", precision="16a4w_block", soc_model="SM8650")
    set_block_size_map(q, {"lienar": 16})
    model, example, _ = build("attention")
    with pytest.raises(OptionError) as err:
        quantplug.prepare(torch.export.export(model, example), q)
    assert "lienar" in str(err.value) and "linear_3" in str(err.value)
    with pytest.raises(OptionError, match="input channels"):
        set_block_size_map(q, {"linear": (2, 16)})
    with pytest.raises(OptionError, match="node_name:block_size"):
        quantplug.get_quantizer("qnn_htp", precision="16a4w_block", block_size_map="linear=16")
    with pytest.raises(OptionError, match="qnn_htp"):
        set_block_size_map(quantplug.get_quantizer("reference"), {"linear": 16})


# --- discard -----------------------------------------------------------------------------------------


def test_discarded_nodes_and_ops_keep_their_edges_float() -> None:
    """ExecuTorch still puts Q/DQ on a discarded node's edges from its neighbours' specs (P10)."""
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    q.discard(nodes=["relu"], ops=[torch.ops.aten.sigmoid.default])
    gm = _quantize("convnet", q)
    relu, sigmoid, maxpool = _node(gm, "relu"), _node(gm, "sigmoid"), _node(gm, "max_pool2d")
    assert relu.args[0].name == "conv2d"  # conv output -> relu: no Q/DQ
    assert _out_q(gm, "conv2d") is None and _out_q(gm, "relu") is None
    assert maxpool.args[0] is relu  # relu -> maxpool: float edge
    assert _out_q(gm, "max_pool2d") is not None  # the float region ends at maxpool's output
    assert sigmoid.args[0].name == "conv2d_1" and _out_q(gm, "sigmoid") is None
    cat = _node(gm, "cat")
    assert cat.args[0][1] is sigmoid  # the concat reads the float sigmoid output
    cov = q.coverage(torch.export.export(*build("convnet")[:2]))
    assert {n.node for n in cov.float_nodes} == {"relu", "sigmoid"}


def test_discarding_a_conv_input_keeps_the_bias_float_too() -> None:
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    q.discard(nodes=["cat"])
    gm = _quantize("convnet", q)
    conv3 = _node(gm, "conv2d_2")
    assert not _is_qdq(conv3.args[0])  # float input from the discarded cat
    assert not _is_qdq(conv3.args[2])  # a derived bias without an input scale stays float
    assert _is_qdq(conv3.args[1])  # the weight is still quantized


# --- custom annotation callbacks ---------------------------------------------------------------------


def test_annotation_callback_overrides_rules() -> None:
    """Like ExecuTorch's custom annotations: softmax at 16 bits inside an 8-bit model."""
    from _quantplug.annotation.specs import annotate_node

    sixteen = make_config("16a8w")
    seen = []

    def softmax_16bit(gm: torch.fx.GraphModule, context: quantplug.BackendContext) -> None:
        seen.append(context.backend)
        for node in gm.graph.nodes:
            if node.target == torch.ops.aten.softmax.int:
                node.meta.pop("quantization_annotation", None)
                # its input carries the causal -inf mask: observed mask-aware, as the rules do
                # (a plain observer's range would be infinite: prepare rejects it as NaN/inf data)
                masked_input = sixteen.masked(sixteen.input_activation)
                annotate_node(node, {node.args[0]: masked_input}, sixteen.output_activation)

    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w").add_annotation_callback(
        softmax_16bit
    )
    gm = _quantize("attention", q)
    assert seen == ["qnn_htp"]
    assert _out_q(gm, "softmax").args[-1] == torch.uint16
    assert _out_q(gm, "matmul").args[-1] == torch.uint8
    # matmul_1 reads the 16-bit softmax output through a requantization to 8 bits
    in0 = _node(gm, "matmul_1").args[0]
    assert in0.args[-1] == torch.uint8 and in0.args[0].args[0].args[-1] == torch.uint16


def test_make_config_is_a_per_module_precision() -> None:
    cfg = make_config("16a4w", per_channel_linear=True, act_observer="minmax")
    assert cfg.precision == "16a4w" and cfg.linear_weight is not None
    assert cfg.input_activation.dtype == torch.uint16
    with pytest.raises(OptionError):
        make_config("3a3w")
