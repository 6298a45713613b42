"""quantplug's programs deploy where PT2E users deploy: ExecuTorch, lowered to XNNPACK (issue 45.1).

A CNN is quantized with ExecuTorch's own ``XNNPACKQuantizer`` through ``quantplug.prepare`` /
``convert``; the program ``quantplug.backend.to_exported_program`` makes of it goes to
``to_edge_transform_and_lower`` as it is (no second ``torch.export``), is lowered with the
XNNPACK partitioner, and the ``.pte`` runs in ExecuTorch's Python runtime. Its outputs are
compared with the Q/DQ program's (XNNPACK computes in integers: within one step of the output's
grid) and with the ``.pte`` torchao's ``prepare_pt2e``/``convert_pt2e`` flow gives (bit-equal).

ExecuTorch is an optional test dependency (``scripts/setup.sh --test`` installs it): the tests
skip when it is not installed at all; an installed ExecuTorch whose runtime or XNNPACK
bindings fail to load fails them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from quantplug.backend import to_exported_program

if importlib.util.find_spec("executorch") is None:
    pytest.skip("ExecuTorch is not installed (scripts/setup.sh --test installs it)", allow_module_level=True)
if importlib.util.find_spec("torchao") is None:
    pytest.skip("torchao is not installed (scripts/setup.sh --test installs it)", allow_module_level=True)

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime

qd = torch.ops.quantized_decomposed


class SmallCnn(nn.Module):
    """conv-bn-relu, a residual add, max pooling, global average pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 1))
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.body(x))
        x = self.down(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, 16, 16, generator=gen),) for _ in range(count)]


def _model() -> tuple[nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = SmallCnn().eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        bn = model.stem[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return model, torch.export.export(model, _batches(1, 0)[0])


def _xnnpack_quantizer() -> XNNPACKQuantizer:
    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))


class Pte:
    """A program lowered (to XNNPACK, or to ExecuTorch's own kernels), loaded into its runtime."""

    def __init__(self, program: torch.export.ExportedProgram, *, xnnpack: bool = True) -> None:
        partitioner = [XnnpackPartitioner()] if xnnpack else []
        edge = to_edge_transform_and_lower(program, partitioner=partitioner)
        self.graph = edge.exported_program().graph_module.graph
        self.buffer = edge.to_executorch().buffer
        # the loaded program must outlive its method (the method reads the program's memory)
        self.program = Runtime.get().load_program(self.buffer)
        self.method = self.program.load_method("forward")

    def run(self, batches: list[tuple[torch.Tensor]]) -> list[torch.Tensor]:
        return [self.method.execute(list(batch))[0] for batch in batches]


def _delegates(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.target is torch.ops.higher_order.executorch_call_delegate)


def _output_step(program: torch.fx.GraphModule) -> float:
    """The scale of the dequantize that produces the program's output."""
    out = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    (dq,) = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    assert dq.target is qd.dequantize_per_tensor.default, dq.format_node()
    return float(dq.args[1])


@pytest.fixture(scope="module")
def flows() -> dict[str, Any]:
    """quantplug's and torchao's converted programs, from the same calibration."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model, program = _model()
    calibration = _batches(3, 1)
    prepared = quantplug.prepare(program, _xnnpack_quantizer())
    theirs = prepare_pt2e(program.module(), _xnnpack_quantizer())
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
            theirs(*batch)
    return {"model": model, "ours": quantplug.convert(prepared), "torchao": convert_pt2e(theirs)}


@pytest.mark.executorch
def test_to_exported_program_lowers_to_xnnpack_and_runs_in_the_runtime(flows: dict[str, Any]) -> None:
    ours = flows["ours"]
    held_out = _batches(4, 2)
    pte = Pte(to_exported_program(ours))  # as it is: no second torch.export
    # every conv, the add and the classifier run in XNNPACK; only what the quantizer left
    # float (the global average pooling between them) stays outside
    assert _delegates(pte.graph) >= 1
    left = {
        str(n.target) for n in pte.graph.nodes if n.op == "call_function" and "delegate" not in str(n.target)
    }
    assert not any("convolution" in t or "addmm" in t or "linear" in t for t in left), left
    with torch.no_grad():
        expected = [ours(*batch) for batch in held_out]
    got = pte.run(held_out)
    step = _output_step(ours)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert float((g - e).abs().max()) <= step * 1.001, "the .pte is more than one output step off"
    # and it is not the float model passed through: the outputs lie on the program's grid
    assert all(torch.allclose(g / step, (g / step).round(), atol=1e-3) for g in got)


@pytest.mark.executorch
@pytest.mark.torchao
def test_pte_is_bit_equal_to_torchao_flow(flows: dict[str, Any]) -> None:
    held_out = _batches(4, 2)
    ours = Pte(to_exported_program(flows["ours"]))
    # torchao's converted module is a GraphModule: exported again, as its users deploy it
    theirs_program = torch.export.export(flows["torchao"], held_out[0])
    theirs = Pte(theirs_program)
    assert _delegates(ours.graph) == _delegates(theirs.graph)
    for mine, their in zip(ours.run(held_out), theirs.run(held_out), strict=True):
        assert torch.equal(mine, their)


@pytest.mark.executorch
def test_saved_model_pt2_of_an_artifact_goes_to_executorch(tmp_path: Path) -> None:
    """The ``model.pt2`` the reference backend writes, loaded back, is accepted by ExecuTorch as
    it is and computes the program's outputs with ExecuTorch's quantized kernels (XNNPACK's
    delegate takes int8 activations with float biases, not the reference preset's uint8
    activations and int32 biases: ``bench/results/executorch_speed.md``)."""
    import executorch.kernels.quantized  # noqa: F401  (the out variants of the Q/DQ ops)

    _, program = _model()
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for batch in _batches(3, 1):
            prepared(*batch)
    converted = quantplug.convert(prepared)
    quantplug.lower(converted, quantizer).save(tmp_path)
    loaded = torch.export.load(tmp_path / "model.pt2")
    pte = Pte(loaded, xnnpack=False)
    held_out = _batches(2, 2)
    with torch.no_grad():
        expected = [converted(*batch) for batch in held_out]
    step = _output_step(converted)
    for e, g in zip(expected, pte.run(held_out), strict=True):
        assert float((g - e).abs().max()) <= step * 1.001
