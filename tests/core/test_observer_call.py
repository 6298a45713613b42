"""An observer's ``module(x)`` skips ``nn.Module.__call__``'s two frames only where torch's call
would run nothing but ``forward`` (``_quantplug.peers.torch_module_call``): hooks on the
observer or global ones, a compiled call, a JIT trace and torch.fx's tracer (which patches
``Module.__call__``) see every call as with torch's own; calibration ends in the same state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.meta import observer_children
from _quantplug.observers.minmax import MinMaxObserver, MovingAverageMinMaxObserver
from _quantplug.peers import torch_module_call


@pytest.fixture(params=[True, False], ids=["one-frame", "torch"])
def active(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """The piece in use, or stood down (as on a torch version it was not verified on)."""
    monkeypatch.setattr(torch_module_call, "ACTIVE", request.param)
    yield request.param


def test_the_installed_torch_is_verified() -> None:
    assert torch_module_call.ACTIVE
    assert type(MinMaxObserver()).__call__ is torch_module_call.observer_call


def test_hooks_on_the_observer_run_as_with_torchs_call(active: bool) -> None:
    obs = MinMaxObserver()
    seen: list[str] = []
    x = torch.tensor([1.0, -2.0])
    handles = [
        obs.register_forward_pre_hook(lambda m, args: seen.append("pre") or (args[0] * 2,)),
        obs.register_forward_hook(lambda m, args, out: seen.append("post") or out + 1),
    ]
    out = obs(x)
    assert seen == ["pre", "post"] and torch.equal(out, x * 2 + 1)
    assert (float(obs.min_val), float(obs.max_val)) == (-4.0, 2.0)  # forward saw the pre-hook's input
    for handle in handles:
        handle.remove()
    assert obs(x) is x and seen == ["pre", "post"]  # removed: forward alone


HOOKS = {
    "forward_pre": lambda obs, seen: obs.register_forward_pre_hook(lambda m, args: seen.append(1)),
    "forward_pre_kwargs": lambda obs, seen: obs.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(1), with_kwargs=True
    ),
    "forward": lambda obs, seen: obs.register_forward_hook(lambda m, args, out: seen.append(1)),
    "backward_pre": lambda obs, seen: obs.register_full_backward_pre_hook(lambda m, grad: seen.append(1)),
    "backward": lambda obs, seen: obs.register_full_backward_hook(lambda m, gin, gout: seen.append(1)),
}


@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_each_kind_of_hook_runs_alone(kind: str, active: bool) -> None:
    obs = MinMaxObserver()
    seen: list[int] = []
    HOOKS[kind](obs, seen)
    x = torch.tensor([1.0, 3.0], requires_grad=True)
    obs(x).sum().backward()
    assert seen == [1] and int(obs.num_batches) == 1


_module = nn.modules.module
GLOBAL_HOOKS = {
    "forward_pre": lambda seen: _module.register_module_forward_pre_hook(lambda m, args: seen.append(1)),
    "forward": lambda seen: _module.register_module_forward_hook(lambda m, args, out: seen.append(1)),
    "backward_pre": lambda seen: _module.register_module_full_backward_pre_hook(
        lambda m, grad: seen.append(1)
    ),
    "backward": lambda seen: _module.register_module_full_backward_hook(lambda m, gin, gout: seen.append(1)),
}


@pytest.mark.parametrize("kind", sorted(GLOBAL_HOOKS))
def test_global_module_hooks_see_observer_calls(kind: str, active: bool) -> None:
    seen: list[int] = []
    handle = GLOBAL_HOOKS[kind](seen)
    try:
        obs = MovingAverageMinMaxObserver()
        obs(torch.tensor([1.0, 3.0], requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    assert seen == [1] and int(obs.num_batches) == 1


@pytest.mark.parametrize("method", ["_call_impl", "_wrapped_call_impl"])
def test_a_subclass_with_its_own_call_path_keeps_it(method: str, active: bool) -> None:
    calls: list[str] = []

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        return getattr(MinMaxObserver, method)(self, *args, **kwargs)

    Counted = type("Counted", (MinMaxObserver,), {method: counted})
    Counted()(torch.ones(2))
    observer_calls = list(calls)
    calls.clear()
    type("Plain", (nn.Identity,), {method: counted})()(torch.ones(2))  # torch's own call
    # torch's __call__ is the function _wrapped_call_impl was: a subclass's own is never called
    assert observer_calls == calls == ([method] if method == "_call_impl" else [])


def test_a_compiled_call_is_used() -> None:
    obs = MinMaxObserver()
    obs._compiled_call_impl = lambda x: "compiled"  # what Module.compile() installs
    assert obs(torch.ones(2)) == "compiled" and int(obs.num_batches) == 0


def test_a_jit_trace_records_through_slow_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    obs = MinMaxObserver()
    slow: list[bool] = []
    monkeypatch.setattr(obs, "_slow_forward", lambda *a, **k: slow.append(True) or a[0])
    monkeypatch.setattr(torch._C, "_get_tracing_state", lambda: object())  # as while torch.jit traces
    x = torch.ones(2)
    assert obs(x) is x and slow == [True]


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.obs = MinMaxObserver()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.obs(x) + 1


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, MinMaxObserver) or super().is_leaf_module(m, qualname)


def test_torch_fx_tracing_sees_the_observer_call(active: bool) -> None:
    """torch.fx patches ``Module.__call__`` while it traces: the observer's call goes through it."""
    graph = _LeafTracer().trace(_Wrapper())
    assert [(n.op, n.target) for n in graph.nodes if n.op == "call_module"] == [("call_module", "obs")]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(32, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def _calibrated_state(**options: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(1, 8, 32, generator=g) * s for s in (1.0, 2.0, 0.5)]
    program = torch.export.export(_Attention().eval(), (batches[0],))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("qnn_htp", precision="16a8w", **options))
    with torch.no_grad():
        for x in batches:
            prepared(x)
    return [t.clone() for _, obs in observer_children(prepared) for t in obs.state_dict().values()]


@pytest.mark.parametrize(
    "options", [{}, {"act_observer": "moving_average"}], ids=["minmax", "moving_average"]
)
def test_calibration_ends_in_the_same_state(options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    one_frame = _calibrated_state(**options)
    monkeypatch.setattr(torch_module_call, "ACTIVE", False)
    assert len(one_frame) > 4
    for a, b in zip(one_frame, _calibrated_state(**options), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
