"""Observers as PT2E code finds them, and the prepared module through a PT2E user's rewrites.

Issue 44, kinds 1 and 2 (and 10): torchao's ``move_exported_model_to_eval`` rewrites dropout and batch norm
with ``torch.fx.subgraph_rewriter``, which ends with ``delete_all_unused_submodules()``; quantplug's
observers of weights had no graph node, were deleted, and convert failed (``no attribute 'g1'``).
And code written for torchao reads ``getattr(prepared, node.target)`` on observer nodes and checks
their ``activation_post_process_`` prefix, and a layer's weight argument is its weight observer's node
(``linear(x, activation_post_process_1(weight), bias)``). Each test runs torchao's flow beside quantplug's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

from .flows import FLOWS, batches, calibrated, qdq_counts, run_flow, x86

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import move_exported_model_to_eval
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

import quantplug

pytestmark = [pytest.mark.torchao]


class ConvDropoutLinear(nn.Module):
    """conv -> relu -> dropout -> pool -> linear: weights of two kinds, a dropout to rewrite."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(torch.relu(self.conv(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


SHAPE = (2, 3, 10, 10)


def _program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(ConvDropoutLinear().eval(), batches(SHAPE, 1)[0])


def _dead_code_and_unused_submodules(gm: GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()


REWRITES: dict[str, Callable[[GraphModule], Any]] = {
    "move_exported_model_to_eval": move_exported_model_to_eval,
    "delete_all_unused_submodules": lambda gm: gm.delete_all_unused_submodules(),
    "eliminate_dead_code": _dead_code_and_unused_submodules,
}


@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_prepared_module_survives_a_pt2e_rewrite_as_torchao_s_does(rewrite: str) -> None:
    program = _program()
    data = batches(SHAPE, 3, seed=1)
    converted = {f: run_flow(f, program, x86, data, between=REWRITES[rewrite]) for f in FLOWS}
    assert qdq_counts(converted["quantplug"]) == qdq_counts(converted["torchao"])
    assert qdq_counts(converted["quantplug"])["quantized_decomposed.dequantize_per_channel.default"] == 2
    x = batches(SHAPE, 1, seed=2)[0]
    with torch.no_grad():
        torch.testing.assert_close(converted["quantplug"](*x), converted["torchao"](*x), rtol=0, atol=1e-5)


def _observer_nodes(gm: GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) != "_guards_fn"]


def test_getattr_of_an_observer_node_target_is_its_observer() -> None:
    program = _program()
    prepared = {f: calibrated(f, program, x86, batches(SHAPE, 1)) for f in FLOWS}
    for flow, gm in prepared.items():
        nodes = _observer_nodes(gm)
        assert nodes, flow
        for node in nodes:
            assert str(node.target).startswith("activation_post_process_"), (flow, node.target)
            observer = getattr(gm, str(node.target))
            assert callable(getattr(observer, "calculate_qparams", None)), (flow, node.target)
            assert getattr(gm, node.name) is observer, (flow, node.name)
    # the same activation observer classes and schemes at the same places (conv's, linear's input)
    placed = {
        flow: sorted(
            (
                str(user.target),
                type(getattr(gm, str(n.target))).__name__,
                str(getattr(gm, str(n.target)).qscheme),
            )
            for n in _observer_nodes(gm)
            if n.args[0].op != "get_attr"
            for user in n.users
        )
        for flow, gm in prepared.items()
    }
    assert placed["quantplug"] == placed["torchao"]


def test_node_names_resolve_once_the_graph_changes_and_misses_keep_the_name_table() -> None:
    """Names of call_module nodes resolve to their observers; a miss on an unchanged graph reuses
    the table (convert probes one free name per constant it adds: rebuilding per miss was
    quadratic), and a node added afterwards resolves."""
    gm = calibrated("quantplug", _program(), x86, batches(SHAPE, 1))
    assert not hasattr(gm, "no_such_observer_call")
    table = gm.__dict__["_quantplug_call_module_names"]
    assert not hasattr(gm, "no_such_observer_call_either")
    assert gm.__dict__["_quantplug_call_module_names"] is table
    observer = _observer_nodes(gm)[0]
    with gm.graph.inserting_after(observer):
        extra = gm.graph.create_node(
            "call_module", str(observer.target), (observer,), name="no_such_observer_call"
        )
    assert extra.name == "no_such_observer_call"
    assert gm.no_such_observer_call is getattr(gm, str(observer.target))
    gm.graph.erase_node(extra)
    assert not hasattr(gm, "no_such_observer_call")


def _weight_arguments(gm: GraphModule) -> list[tuple[str, str, str]]:
    """Per conv/linear, in graph order: what its weight argument is (op, the constant behind an
    observer node), and the observer's class and scheme."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
            torch.ops.aten.conv2d.default,
            torch.ops.aten.linear.default,
        ):
            weight = node.args[1]
            observer = getattr(gm, str(weight.target)) if weight.op == "call_module" else None
            behind = weight.args[0] if weight.op == "call_module" else weight
            found.append(
                (
                    weight.op,
                    str(behind.target),
                    f"{type(observer).__name__} {getattr(observer, 'qscheme', '')}",
                )
            )
    return found


def _fc_only() -> X86InductorQuantizer:
    return X86InductorQuantizer().set_module_name_qconfig(
        "fc", get_default_x86_inductor_quantization_config()
    )


@pytest.mark.parametrize("quantizer", [x86, _fc_only], ids=["global", "module_name"])
def test_a_weight_is_read_through_its_observer_node_as_in_torchao(quantizer: Callable[[], Any]) -> None:
    program = _program()
    prepared = {f: calibrated(f, program, quantizer, []) for f in FLOWS}
    found = _weight_arguments(prepared["quantplug"])
    assert found == _weight_arguments(prepared["torchao"])
    expected = ["call_module", "call_module"] if quantizer is x86 else ["get_attr", "call_module"]
    assert [op for op, _, _ in found] == expected
    assert "PerChannelMinMaxObserver torch.per_channel_symmetric" in {kind for _, _, kind in found}


def test_weight_observers_are_reachable_from_the_graph_and_idle_in_calibration() -> None:
    program = _program()
    prepared = calibrated("quantplug", program, x86, [])
    torchao_prepared = calibrated("torchao", program, x86, batches(SHAPE, 1))
    weights = {n.name for n in prepared.graph.nodes if n.op == "get_attr" and n.name.endswith("weight")}
    parked = [n for n in _observer_nodes(prepared) if n.args[0].name in weights]
    assert {n.args[0].name for n in parked} == weights  # one node per weight, read by its layer
    assert all(len(n.users) == 1 for n in parked)
    # torchao's weight observers sit on the weight edge; same class and scheme
    torchao_weight_observers = sorted(
        type(getattr(torchao_prepared, str(n.target))).__name__
        for n in _observer_nodes(torchao_prepared)
        if n.args[0].op == "get_attr"
    )
    assert sorted(type(getattr(prepared, str(n.target))).__name__ for n in parked) == torchao_weight_observers
    states = {n.name: getattr(prepared, str(n.target)).state_dict() for n in parked}
    with torch.no_grad():
        prepared(*batches(SHAPE, 1)[0])
    for n in parked:  # observed once, at convert, into a copy: calibration leaves them alone
        for key, value in getattr(prepared, str(n.target)).state_dict().items():
            torch.testing.assert_close(value, states[n.name][key], rtol=0, atol=0, equal_nan=True)


def test_a_program_prepared_by_torchao_is_refused() -> None:
    program = _program()
    torchao_prepared = calibrated("torchao", program, x86, batches(SHAPE, 1))

    with pytest.raises(quantplug.QuantplugError, match="already prepared"):
        quantplug.prepare(torchao_prepared, x86())
