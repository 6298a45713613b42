"""Nothing of the caller's changes (issue 12.4): calibrating a program whose forward writes its own
state (batch norm in training mode, a counter buffer) leaves the caller's module and program as
they were, through prepare, calibration, convert, compare and lower; and repeated prepare and
convert release torch.fx's generated code (issue 12.9)."""

from __future__ import annotations

import gc
import linecache
from typing import Any

import pytest
import torch
from torch import nn

import quantplug


class Stateful(nn.Module):
    """Batch norm (trained: running statistics update) and a buffer the forward increments."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.norm = nn.InstanceNorm2d(8, track_running_stats=True)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc(torch.relu(self.norm(self.bn(self.conv(x)))).mean((2, 3)))


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def _same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in before if not torch.equal(before[k], after[k])]


@pytest.mark.parametrize("given", ["program", "graph_module"])
@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
def test_calibration_writes_nothing_of_the_callers(given: str, qat: bool) -> None:
    torch.manual_seed(0)
    model = Stateful().train()
    ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
    module_state = _snapshot(dict(model.state_dict(keep_vars=True)))
    program_state = _snapshot(
        {**ep.state_dict, **{k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}}
    )
    program: Any = ep if given == "program" else ep.module()
    graph_state = _snapshot(dict(program.state_dict())) if given == "graph_module" else {}

    quantizer = quantplug.get_quantizer("qnn_htp", qat=True) if qat else quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(program, quantizer, qat=qat)
    for _ in range(3):
        prepared(torch.randn(2, 3, 8, 8))
    quantized = quantplug.convert(prepared)
    quantplug.debug.compare(ep, quantized, [(torch.randn(2, 3, 8, 8),)])

    assert _same(module_state, dict(model.state_dict(keep_vars=True))) == []
    assert _same(program_state, {**ep.state_dict, **ep.constants}) == []
    if given == "graph_module":
        assert _same(graph_state, dict(program.state_dict())) == []


def test_the_prepared_module_keeps_the_programs_semantics() -> None:
    """The prepared copy still updates its own statistics, as the float program would."""
    torch.manual_seed(0)
    model = Stateful().train()
    ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference"))
    before = prepared.get_buffer("bn.running_mean").clone()
    prepared(torch.randn(2, 3, 8, 8))
    assert not torch.equal(before, prepared.get_buffer("bn.running_mean"))
    assert int(prepared.get_buffer("calls")) == 1


class RescaledOnFirstCall(nn.Module):
    """transformers' RWKV: the first forward divides weights in place under ``torch.no_grad()``
    (torch.export records a ``wrap_with_set_grad_enabled`` region whose subgraph writes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.rescaled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rescaled:
            with torch.no_grad():
                self.fc.weight.div_(2)
            self.rescaled = True
        return self.fc(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("preset", ["int8", "weight_only_int8"])
def test_a_parameter_written_inside_a_no_grad_region_is_the_working_copys(preset: str) -> None:
    """The writes are in the region's subgraph, not in the program's graph: the working copy
    shared the parameter, and every calibration batch halved the caller's weight."""
    x = torch.randn(4, 8)
    ep = torch.export.export(RescaledOnFirstCall().eval(), (x,))
    assert any("wrap_with_set_grad_enabled" in str(n.target) for n in ep.graph.nodes)
    before = _snapshot(ep.state_dict)
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference", preset=preset))
    for _ in range(3):
        prepared(x)
    quantplug.convert(prepared)(x)
    assert _same(before, ep.state_dict) == []


def test_inference_programs_share_the_callers_tensors() -> None:
    """Only written state is copied: an eval-mode program costs no copy of its weights."""
    model = Stateful().eval()
    ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
    from _quantplug.graph.working_copy import working_copy

    copy = working_copy(ep)
    assert copy.get_parameter("fc.weight") is ep.state_dict["fc.weight"]
    assert copy.get_buffer("calls") is not ep.state_dict["calls"]  # the forward writes it


def _generated_sources() -> int:
    loader = getattr(torch.fx.graph_module, "_loader", None)
    return len(getattr(loader, "eval_cache", {})) + sum(
        1 for k in linecache.cache if k.startswith("<eval_with_key>")
    )


def test_repeated_prepare_and_convert_release_generated_code() -> None:
    torch.manual_seed(0)
    ep = torch.export.export(Stateful().eval(), (torch.randn(2, 3, 8, 8),))
    quantizer = quantplug.get_quantizer("reference")

    def cycle() -> None:
        prepared = quantplug.prepare(ep, quantizer)
        prepared(torch.randn(2, 3, 8, 8))
        quantized = quantplug.convert(prepared)
        quantized(torch.randn(2, 3, 8, 8))

    cycle()
    gc.collect()
    start = _generated_sources()
    for _ in range(20):
        cycle()
    gc.collect()
    assert _generated_sources() - start <= 2  # not 2 (or more) per cycle


def test_repeated_cycles_do_not_grow_python_memory() -> None:
    import tracemalloc

    torch.manual_seed(0)
    ep = torch.export.export(Stateful().eval(), (torch.randn(2, 3, 8, 8),))
    quantizer = quantplug.get_quantizer("reference")

    def cycle() -> None:
        prepared = quantplug.prepare(ep, quantizer)
        prepared(torch.randn(2, 3, 8, 8))
        quantplug.convert(prepared)

    for _ in range(3):
        cycle()
    gc.collect()
    tracemalloc.start()
    try:
        cycle()
        gc.collect()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(15):
            cycle()
        gc.collect()
        last, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (last - first) / 15 < 8 * 1024  # bytes per cycle (was 65-78 KiB, all generated code)


def test_quantize_leaves_the_callers_train_flags() -> None:
    torch.manual_seed(0)
    model = Stateful().train()
    model.fc.eval()
    state = _snapshot(dict(model.state_dict(keep_vars=True)))
    quantplug.quantize(model, (torch.randn(2, 3, 8, 8),), backend="reference")
    assert model.training and model.bn.training and not model.fc.training
    assert _same(state, dict(model.state_dict(keep_vars=True))) == []
