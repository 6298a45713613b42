"""QAT conv + batch norm, side by side with torchao's prepare_qat_pt2e / convert_pt2e.

torchao rewrites each conv -> batch norm it trains into the weight-folding form
``bn(conv(x, fq(w * sf), 0) / sf + b)`` and folds the batch norm into the conv at convert.
quantplug must train the same numbers (outputs, gradients, running statistics) and convert to the
same program: the batch norm gone, the folded weight quantized with the trained encoding.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import FusedMovingAvgObsFakeQuantize, MovingAveragePerChannelMinMaxObserver
from torchao.quantization.pt2e.fake_quantize import default_fake_quant
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e
from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)
from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
CONVS = {
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
}
BATCH_NORMS = {
    aten.batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default,
}


class ConvBn(nn.Module):
    """conv (or transposed conv) -> batch norm [-> relu | hardtanh]."""

    def __init__(
        self,
        dim: int,
        *,
        transpose: bool = False,
        bias: bool = True,
        tail: str = "",
        out_channels: int = 4,
        eps: float = 1e-5,
        **conv_kwargs: Any,
    ) -> None:
        super().__init__()
        conv = {
            (1, False): nn.Conv1d,
            (2, False): nn.Conv2d,
            (1, True): nn.ConvTranspose1d,
            (2, True): nn.ConvTranspose2d,
        }[(dim, transpose)]
        self.conv = conv(3, out_channels, 3, bias=bias, **conv_kwargs)
        self.bn = (nn.BatchNorm1d if dim == 1 else nn.BatchNorm2d)(out_channels, eps=eps)
        self.tail = {"": nn.Identity(), "relu": nn.ReLU(), "hardtanh": nn.Hardtanh()}[tail]
        with torch.no_grad():  # statistics and affine parameters away from their defaults
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.bn(self.conv(x)))


def _inputs(dim: int, n: int, seed: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, 7) if dim == 1 else (2, 3, 6, 6)
    return [(torch.randn(shape, generator=g),) for _ in range(n)]


def _xnnpack(per_channel: bool) -> XNNPACKQuantizer:
    return XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=per_channel, is_qat=True)
    )


def _train_step(model: GraphModule, x: tuple[torch.Tensor]) -> torch.Tensor:
    """One forward, backward and SGD step (gradients must flow through the folding form)."""
    out = model(*x)
    out.square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
                p.grad = None
    return out.detach()


def _side_by_side(
    model: nn.Module, dim: int, make_quantizer: Any
) -> tuple[GraphModule, GraphModule, list[Any]]:
    """Train torchao's and quantplug's QAT programs on the same batches; outputs must match."""
    torch.manual_seed(0)
    batches = _inputs(dim, 4, seed=1)
    program = torch.export.export(model, batches[0], strict=True)
    float_state = {k: v.clone() for k, v in program.state_dict.items()}
    ao = prepare_qat_pt2e(copy.deepcopy(program.module()), make_quantizer())
    qp = quantplug.prepare(program, make_quantizer(), qat=True)
    for x in batches[:3]:
        torch.testing.assert_close(_train_step(qp, x), _train_step(ao, x))
    for name, value in program.state_dict.items():  # training wrote quantplug's copies only
        assert torch.equal(value, float_state[name]), name
    return ao, qp, batches


def _bn_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in BATCH_NORMS]


def _conv(gm: GraphModule) -> Node:
    (conv,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in CONVS]
    return conv


#: name -> (ConvBn arguments, per-channel weights); each runs torchao's slow QAT prepare once
CASES = {
    "conv1d": (dict(dim=1), True),
    # literal conv arguments, no conv bias, and XNNPACK's shared spec (hardtanh shares its input's)
    "conv2d-no-bias-hardtanh-literal-args": (
        dict(dim=2, bias=False, tail="hardtanh", stride=2, padding=2, dilation=2),
        False,
    ),
    "conv-transpose2d-relu": (dict(dim=2, transpose=True, tail="relu", out_channels=5), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_and_converts_as_torchao(case: str) -> None:
    kwargs, per_channel = CASES[case]
    dim = kwargs["dim"]
    ao, qp, batches = _side_by_side(ConvBn(**kwargs), dim, lambda: _xnnpack(per_channel))
    # the simulated folding: the conv reads fq(w * sf) and the batch norm un-scales its output
    conv = _conv(qp)
    weight_fq = conv.args[1]
    assert isinstance(weight_fq, Node) and weight_fq.op == "call_module"
    product = weight_fq.args[0]
    assert product.target == aten.mul.Tensor and product.args[0].target == "conv.weight"
    assert product.args[1].args[0].target == aten.div.Tensor  # sf = bn.weight / sqrt(var + eps)
    assert conv.args[3:] == _conv(ao).args[3:]  # stride, padding, ... kept
    (bn,) = _bn_nodes(qp)
    assert bn.args[0].target == (aten.add.Tensor if kwargs.get("bias", True) else aten.div.Tensor)

    ao_c, qp_c = convert_pt2e(ao), quantplug.convert(qp)
    assert not _bn_nodes(qp_c) and not _bn_nodes(ao_c)
    conv = _conv(qp_c)
    weight_dq = conv.args[1]
    expected = qd.dequantize_per_channel.default if per_channel else qd.dequantize_per_tensor.default
    assert weight_dq.target == expected and weight_dq.args[0].op == "get_attr"
    assert isinstance(conv.args[2], Node) and conv.args[2].op == "get_attr"  # the folded bias
    assert "source_fn_stack" in conv.args[2].meta
    assert conv.args[2].meta["source_fn_stack"][0][0] == conv.meta["source_fn_stack"][0][0]
    torch.testing.assert_close(qp_c(*batches[3]), ao_c(*batches[3]))
    assert not any(n.target == aten.add_.Tensor for n in qp_c.graph.nodes)  # num_batches_tracked


class DerivedBiasQuantizer(Quantizer):
    """conv input/weight uint8, bias int32 with scale = input scale x weight scale."""

    def __init__(self, per_channel: bool, weight_dtype: torch.dtype = torch.uint8) -> None:
        super().__init__()
        self.per_channel = per_channel
        self.weight_dtype = weight_dtype

    @staticmethod
    def _derive(observers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        act_scale, _ = observers[0].calculate_qparams()
        weight_scale, _ = observers[1].calculate_qparams()
        scale = (act_scale * weight_scale).reshape(-1).float()
        return scale, torch.zeros_like(scale, dtype=torch.int32)

    def annotate(self, model: GraphModule) -> GraphModule:
        conv = next(n for n in model.graph.nodes if n.op == "call_function" and n.target in CONVS)
        (bn,) = _bn_nodes(model)
        act = QuantizationSpec(
            dtype=torch.uint8,
            quant_min=0,
            quant_max=255,
            qscheme=torch.per_tensor_affine,
            observer_or_fake_quant_ctr=default_fake_quant,
        )
        if self.per_channel:
            qscheme = torch.per_channel_symmetric
            weight_fq = FusedMovingAvgObsFakeQuantize.with_args(
                observer=MovingAveragePerChannelMinMaxObserver
            )
        else:
            qscheme, weight_fq = torch.per_tensor_affine, default_fake_quant
        weight = QuantizationSpec(
            dtype=self.weight_dtype,
            quant_min=0,
            quant_max=255 if self.weight_dtype == torch.uint8 else 2**31 - 1,
            qscheme=qscheme,
            # the int32 weight names no axis (as torchao's own QAT tests): the fake-quantize's
            # per-channel observer keeps its default, 0, in torchao's prepare and in quantplug's
            ch_axis=0 if self.per_channel and self.weight_dtype == torch.uint8 else None,
            observer_or_fake_quant_ctr=weight_fq,
        )
        specs: dict[Node, Any] = {conv.args[0]: act, conv.args[1]: weight}
        if self.weight_dtype == torch.uint8:
            specs[conv.args[2]] = DerivedQuantizationSpec(
                derived_from=[(conv.args[0], conv), (conv.args[1], conv)],
                derive_qparams_fn=self._derive,
                dtype=torch.int32,
                quant_min=-(2**31),
                quant_max=2**31 - 1,
                qscheme=qscheme,
                ch_axis=0 if self.per_channel else None,
            )
        conv.meta["quantization_annotation"] = QuantizationAnnotation(input_qspec_map=specs, _annotated=True)
        bn.meta["quantization_annotation"] = QuantizationAnnotation(output_qspec=act, _annotated=True)
        return model

    def validate(self, model: GraphModule) -> None:
        pass


@pytest.mark.parametrize(
    "per_channel,weight_dtype",
    [(True, torch.uint8), (True, torch.int32)],
    ids=["derived-bias-per-channel", "int32-per-channel-weight"],
)
def test_derived_bias_and_custom_weight_specs(per_channel: bool, weight_dtype: torch.dtype) -> None:
    """Specs naming the conv's weight edge follow it onto ``w * sf``; torch's default_fake_quant
    (``reduce_range``: uint8 0..127) converts to the range it trained on, as in torchao."""
    ao, qp, batches = _side_by_side(ConvBn(2), 2, lambda: DerivedBiasQuantizer(per_channel, weight_dtype))
    ao_c, qp_c = convert_pt2e(ao), quantplug.convert(qp)
    conv = _conv(qp_c)
    weight_dq, bias = conv.args[1], conv.args[2]
    dq = qd.dequantize_per_channel.default if per_channel else qd.dequantize_per_tensor.default
    assert weight_dq.target == dq
    assert weight_dq.args[-1] == weight_dtype
    if per_channel:
        assert weight_dq.args[3] == 0  # the axis, given or the observer's default
    if weight_dtype == torch.uint8:  # the folded bias is quantized with the derived encoding
        assert bias.target == dq and bias.args[0].op == "get_attr"
        assert bias.args[-1] == torch.int32
    torch.testing.assert_close(qp_c(*batches[3]), ao_c(*batches[3]))


def test_batch_norm_is_folded_without_training() -> None:
    """Converted straight after prepare (train mode, no step): the batch norm is gone."""
    program = torch.export.export(ConvBn(2, bias=False), _inputs(2, 1, 0)[0], strict=True)
    prepared = quantplug.prepare(program, _xnnpack(False), qat=True)
    prepared(*_inputs(2, 1, 2)[0])
    converted = quantplug.convert(prepared)
    assert not _bn_nodes(converted)
    assert _bn_nodes(prepared)  # convert never rewrites the prepared module


def test_after_move_to_eval() -> None:
    """torchao's move_exported_model_to_eval rewrites the batch norm; convert still folds it."""
    from torchao.quantization.pt2e import move_exported_model_to_eval

    model = ConvBn(2, tail="relu")
    x = _inputs(2, 2, 3)
    program = torch.export.export(model, x[0], strict=True)
    prepared = quantplug.prepare(program, _xnnpack(True), qat=True)
    prepared(*x[0])
    eval_ready = move_exported_model_to_eval(prepared)
    converted = quantplug.convert(eval_ready)
    assert not _bn_nodes(converted)
    assert not any(n.target is operator.getitem for n in converted.graph.nodes)


def test_own_batch_norm_eps_is_kept() -> None:
    """A batch norm with eps=1e-3 folds with 1e-3 (torchao's pattern fixes 1e-5: documented)."""
    model = ConvBn(2, eps=1e-3).eval()
    x = _inputs(2, 2, 4)
    program = torch.export.export(model.train(), x[0], strict=True)
    prepared = quantplug.prepare(program, _xnnpack(False), qat=True)
    (bn,) = _bn_nodes(prepared)
    assert bn.args[7] == 1e-3
    eps_add = next(n for n in prepared.graph.nodes if n.target == aten.sqrt.default).args[0]
    assert eps_add.args[1] == 1e-3
    for fq in prepared.modules():  # no fake-quantize: the folding form must equal the float model
        if isinstance(fq, FusedMovingAvgObsFakeQuantize):
            fq.disable_fake_quant()
    reference = copy.deepcopy(model).train()
    torch.testing.assert_close(prepared(*x[1]), reference(*x[1]))
