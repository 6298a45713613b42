"""``.train()``/``.eval()`` on prepared and converted modules, as torchao treats them (issue 44.4).

An exported program's dropout and batch norm are fixed at export; torch refuses ``train()`` and
``eval()`` on ``ep.module()``, torchao on what prepare_pt2e/convert_pt2e return. The ways out,
``move_exported_model_to_eval/_train`` and ``allow_exported_model_train_eval``, must work on
quantplug's modules as on torchao's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

from .flows import FLOWS, batches, calibrated, convert, x86

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import (
    allow_exported_model_train_eval,
    move_exported_model_to_eval,
    move_exported_model_to_train,
)

pytestmark = [pytest.mark.torchao]

aten = torch.ops.aten
SHAPE = (2, 3, 6, 6)


class ConvBnDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.relu(self.bn(self.conv(x))))


def _qat_program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(ConvBnDropout().train(), batches(SHAPE, 1)[0])


def _qat_x86() -> object:
    return x86(is_qat=True)


def _modes(gm: GraphModule) -> tuple[bool, bool]:
    """(dropout in train mode, batch norm in train mode) as the graph's ops say."""
    dropout = next(n for n in gm.graph.nodes if n.target == aten.dropout.default)
    bn_train = any(n.target == aten._native_batch_norm_legit.default for n in gm.graph.nodes) or any(
        n.target == aten.batch_norm.default and n.args[5] for n in gm.graph.nodes
    )
    return bool(dropout.args[2]), bn_train


@pytest.mark.parametrize("flow", FLOWS)
def test_train_and_eval_are_refused_after_prepare_and_convert(flow: str) -> None:
    prepared = calibrated(flow, _qat_program(), _qat_x86, batches(SHAPE, 2), qat=True)
    for call in (prepared.train, prepared.eval):
        with pytest.raises(NotImplementedError, match="move_exported_model_to_train"):
            call()
    converted = convert(flow, prepared)
    for call in (converted.train, converted.eval):
        with pytest.raises(NotImplementedError):
            call()


def test_allowed_train_eval_switch_dropout_and_batch_norm() -> None:
    flow = "quantplug"  # torchao's own modes: test_both_flows_agree_on_the_modes_they_leave
    prepared = calibrated(flow, _qat_program(), _qat_x86, batches(SHAPE, 2), qat=True)
    assert _modes(prepared) == (True, True)
    allow_exported_model_train_eval(prepared)
    prepared.eval()
    assert _modes(prepared) == (False, False)
    prepared.train()
    assert _modes(prepared) == (True, True)
    move_exported_model_to_eval(prepared)
    assert _modes(prepared) == (False, False)
    with torch.no_grad():  # still a working prepared module, which converts
        prepared(*batches(SHAPE, 1, seed=3)[0])
    convert(flow, prepared)


def test_both_flows_agree_on_the_modes_they_leave() -> None:
    found = {}
    for flow in FLOWS:
        prepared = calibrated(flow, _qat_program(), _qat_x86, batches(SHAPE, 2), qat=True)
        move_exported_model_to_eval(prepared)
        eval_modes = _modes(prepared)
        move_exported_model_to_train(prepared)
        found[flow] = (eval_modes, _modes(prepared))
    assert found["quantplug"] == found["torchao"] == ((False, False), (True, True))
