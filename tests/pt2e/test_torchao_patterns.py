"""The session's cache of torchao's pattern graphs (tests/torchao_patterns.py) keys each pattern by
everything its export depends on and never hands out a graph another caller can change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import utils
from torchao.quantization.pt2e.export_utils import WrapperModule

from tests import torchao_patterns
from tests.torchao_patterns import _UNKEYABLE, _cached, _key


def _pattern(scale: float, relu: bool) -> Any:
    """A pattern as torchao writes them: a closure in a WrapperModule."""

    def pattern(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, w) * scale
        return torch.relu(y) if relu else y

    return WrapperModule(pattern)


def _call(pattern: Any, *shape: int, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    inputs = (torch.randn(shape).to(dtype), torch.randn(2, 3))
    return _key((pattern, inputs, False, tuple(sorted(kwargs.items()))))


def test_the_key_names_what_the_graph_depends_on() -> None:
    assert _call(_pattern(0.5, True), 1, 3) == _call(_pattern(0.5, True), 1, 3)  # a fresh closure
    different = [
        _call(_pattern(0.25, True), 1, 3),  # a literal in the closure
        _call(_pattern(0.5, False), 1, 3),  # a flag in the closure
        _call(_pattern(0.5, True), 2, 3),  # a shape
        _call(_pattern(0.5, True), 1, 3, dtype=torch.float64),
        _call(_pattern(0.5, True), 1, 3, bias=torch.randn(2)),  # a keyword input
        _call(_pattern(0.5, True).fn, 1, 3),  # the bare function
    ]
    assert len({_call(_pattern(0.5, True), 1, 3), *different}) == len(different) + 1
    held = object()
    assert _key(WrapperModule(lambda x: (x, held))) is _UNKEYABLE


def test_each_caller_gets_its_own_copy_of_the_graph() -> None:
    calls: list[Any] = []

    def export(pattern: Any, example_inputs: Any, is_cuda: bool = False, **kwargs: Any) -> Any:
        calls.append(pattern)
        function = utils._get_aten_graph_module_for_pattern
        original = getattr(function, "__wrapped__", function)  # torchao's own, installed or not
        return original(pattern, example_inputs, is_cuda, **kwargs)

    get = _cached(export)
    inputs = (torch.randn(1, 3), torch.randn(2, 3))
    first = get(_pattern(0.5, True), inputs)
    code = first.code
    relu = next(n for n in first.graph.nodes if n.target == torch.ops.aten.relu.default)
    relu.replace_all_uses_with(relu.args[0])  # as torchao's post-transforms edit a pattern
    first.graph.erase_node(relu)
    first.recompile()
    second = get(_pattern(0.5, True), inputs)
    assert len(calls) == 1 and second.code == code != first.code
    held = object()
    get(WrapperModule(lambda x, w: (x, held)[0]), inputs)
    get(WrapperModule(lambda x, w: (x, held)[0]), inputs)
    assert len(calls) == 3  # what the key cannot describe is exported at each call


def test_installed_in_every_module_that_calls_it() -> None:
    import importlib

    torchao_patterns.install()
    modules = [importlib.import_module(name) for name in torchao_patterns.CALLERS]
    (function,) = {module._get_aten_graph_module_for_pattern for module in modules}
    assert hasattr(function, "__wrapped__")
