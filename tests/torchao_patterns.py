"""torchao's pattern graphs, exported once per test session instead of once per call.

torchao's QAT prepare, its convert and ``move_exported_model_to_eval/train`` rewrite conv -> batch
norm (and dropout) by subgraph matching against pattern functions they ``torch.export`` on every
call: one ``convert_pt2e`` of a QAT model exports 96 patterns (4 conv kinds x 12 quantization
variants x match and replacement), about 8 s here, and each torchao case of the QAT tests spent
90% of its time there. A pattern's graph depends only on the pattern function (its code and what
its closure holds), the example inputs' types, shapes and dtypes, ``is_cuda`` and the keyword
inputs; so the tests export each distinct pattern once and hand every caller its own deep copy
(torchao edits the graphs it matches against, and node metadata must not leak between tests).
torchao's results are unchanged (checked when this was written: in one process, torchao's QAT
prepare, 3 training steps, move_exported_model_to_eval/train and convert of every model of
test_qat_conv_bn.py, without the cache, then through it, then from it, gave the same code, state
dicts, outputs and node metadata); tests/pt2e/test_torchao_patterns.py checks the key and the
copies. Anything the key cannot describe goes to torchao's own function.

Verified on torchao 0.18 (``torchao.quantization.pt2e.utils._get_aten_graph_module_for_pattern``,
imported by name in ``qat_utils`` and ``reference_representation_rewrite``, and at each call in
``export_utils``).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

_CACHE: dict[Hashable, torch.fx.GraphModule] = {}
_UNKEYABLE = object()


def _key(value: Any) -> Any:
    """A hashable description of what the exported pattern depends on, or ``_UNKEYABLE``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        items = tuple(_key(v) for v in value)
        return _UNKEYABLE if _UNKEYABLE in items else (type(value), items)
    if isinstance(value, types.FunctionType):
        cells = tuple(_key(c.cell_contents) for c in value.__closure__ or ())
        defaults = _key(value.__defaults__ or ())
        if _UNKEYABLE in cells or defaults is _UNKEYABLE or value.__kwdefaults__:
            return _UNKEYABLE
        return ("function", value.__code__, cells, defaults)
    if isinstance(value, types.BuiltinFunctionType):  # torch.nn.functional.conv2d, ...
        return ("builtin", value)
    if type(value).__name__ == "WrapperModule" and isinstance(value, torch.nn.Module):
        fn = _key(getattr(value, "fn", None))
        return _UNKEYABLE if fn is _UNKEYABLE else ("wrapper", type(value), fn)
    return _UNKEYABLE


def _cached(original: Callable[..., torch.fx.GraphModule]) -> Callable[..., torch.fx.GraphModule]:
    def get_pattern(
        pattern: Callable[..., Any], example_inputs: tuple[Any, ...], is_cuda: bool = False, **kwargs: Any
    ) -> torch.fx.GraphModule:
        key = _key((pattern, tuple(example_inputs), is_cuda, tuple(sorted(kwargs.items()))))
        if key is _UNKEYABLE:
            return original(pattern, example_inputs, is_cuda, **kwargs)
        if key not in _CACHE:
            _CACHE[key] = original(pattern, example_inputs, is_cuda, **kwargs)
        return copy.deepcopy(_CACHE[key])

    get_pattern.__wrapped__ = original  # type: ignore[attr-defined]
    return get_pattern


#: the torchao modules that call it (``export_utils`` imports it from ``utils`` at each call)
CALLERS = (
    "torchao.quantization.pt2e.utils",
    "torchao.quantization.pt2e.qat_utils",
    "torchao.quantization.pt2e.reference_representation_rewrite",
)


def install() -> None:
    """Route torchao's pattern exports through the cache (idempotent; no-op without torchao)."""
    import importlib

    try:
        modules = [importlib.import_module(name) for name in CALLERS]
    except ImportError:
        return
    original = getattr(modules[0], "_get_aten_graph_module_for_pattern", None)
    if original is None or hasattr(original, "__wrapped__"):  # another torchao, or installed
        return
    cached = _cached(original)
    for module in modules:
        if getattr(module, "_get_aten_graph_module_for_pattern", None) is original:
            module._get_aten_graph_module_for_pattern = cached  # type: ignore[attr-defined]
