"""convert's torchao options, side by side with torchao's convert_pt2e.

``fold_quantize=False`` must keep every constant's quantize op as torchao does and compute what
the default conversion computes; both options' values are checked. (``use_reference_representation``:
``test_reference_representation.py``.)
"""

from __future__ import annotations

from collections import Counter
from operator import attrgetter
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

import quantplug
from quantplug import ConversionError

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

qd = torch.ops.quantized_decomposed
OUT_DTYPE = torch.ops.higher_order.out_dtype


class Add(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class AddRelu(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + y)


class ConvPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.max_pool2d(self.conv(x), 2)


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _inputs(model: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, (Add, AddRelu)):
        return (torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g))
    if isinstance(model, ConvPool):
        return (torch.randn(1, 3, 8, 8, generator=g),)
    return (torch.randn(3, 6, generator=g),)


#: name -> (model, per-channel weights, dynamic activations)
CASES: dict[str, tuple[type[nn.Module], bool, bool]] = {
    "add": (Add, False, False),
    "add-relu": (AddRelu, True, False),
    "conv2d-maxpool": (ConvPool, False, False),
    "linear-per-channel": (Linear, True, False),
    "dynamic-linear": (Linear, False, True),
}


def _both(case: str, **options: Any) -> tuple[GraphModule, GraphModule, tuple[torch.Tensor, ...]]:
    model_cls, per_channel, dynamic = CASES[case]
    torch.manual_seed(0)  # the same weights at every call
    model = model_cls().eval()
    program = torch.export.export(model, _inputs(model, 0), strict=True)

    def quantizer() -> XNNPACKQuantizer:
        config = get_symmetric_quantization_config(is_per_channel=per_channel, is_dynamic=dynamic)
        return XNNPACKQuantizer().set_global(config)

    ao = prepare_pt2e(program.module(), quantizer())
    qp = quantplug.prepare(program, quantizer())
    for seed in (1, 2):
        ao(*_inputs(model, seed))
        qp(*_inputs(model, seed))
    return convert_pt2e(ao, **options), quantplug.convert(qp, **options), _inputs(model, 3)


def _ops(gm: GraphModule) -> Counter[Any]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("case", ["conv2d-maxpool", "linear-per-channel"])
def test_unfolded_quantize_as_torchao(case: str) -> None:
    ao, qp, x = _both(case, fold_quantize=False)
    assert _ops(qp) == _ops(ao)
    quantize = qd.quantize_per_channel.default if "per-channel" in case else qd.quantize_per_tensor.default
    weight_q = [n for n in qp.graph.nodes if n.target == quantize and n.args[0].op == "get_attr"]
    assert len(weight_q) == 1 and weight_q[0].args[0].meta["val"].dtype == torch.float32
    torch.testing.assert_close(qp(*x), ao(*x))
    _, folded, _ = _both(case)
    torch.testing.assert_close(folded(*x), qp(*x), atol=0, rtol=0)


def _integer_constants(gm: GraphModule) -> dict[str, torch.Tensor]:
    """The int8 tensors (the stored weights) the program reads through ``get_attr``, by attribute."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attrgetter(str(node.target))(gm)
            if value.dtype == torch.int8:
                found[str(node.target)] = value
    return found


def test_folded_weights_keep_their_names_and_torchao_s_folding_gives_its_names() -> None:
    """A documented difference (docs/migrating-from-torchao.md): quantplug names a folded weight
    after the weight, torchao ``_frozen_paramN``; the integers are the same, and torchao's own
    constant folding run on ``fold_quantize=False`` gives its names exactly."""
    from torchao.quantization.pt2e.constant_fold import constant_fold

    ao, qp, x = _both("linear-per-channel")
    assert list(_integer_constants(ao)) == ["_frozen_param0"]
    assert list(_integer_constants(qp)) == ["linear_weight_q0"]
    torch.testing.assert_close(qp.linear_weight_q0, ao._frozen_param0, atol=0, rtol=0)
    _, unfolded, _ = _both("linear-per-channel", fold_quantize=False)
    quantize = {qd.quantize_per_channel.default}
    constant_fold(unfolded, lambda n: n.op == "call_function" and n.target in quantize)
    assert list(_integer_constants(unfolded)) == ["_frozen_param0"] and "linear_weight" not in unfolded.code
    torch.testing.assert_close(unfolded(*x), qp(*x), atol=0, rtol=0)


def test_option_values_are_checked() -> None:
    model = Add()
    program = torch.export.export(model, _inputs(model, 0), strict=True)
    prepared = quantplug.prepare(program, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
    prepared(*_inputs(model, 1))
    with pytest.raises(ConversionError, match="fold_quantize"):
        quantplug.convert(prepared, fold_quantize="yes")  # type: ignore[arg-type]
    with pytest.raises(ConversionError, match="use_reference_representation"):
        quantplug.convert(prepared, use_reference_representation=1)  # type: ignore[arg-type]
