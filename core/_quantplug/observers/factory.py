"""Building one observer (or fake-quantize) module from a group's spec.

Specs from torchao or ExecuTorch carry their own observer constructors; those are called the way
torchao's prepare calls them (spec fields as keyword arguments, ``ch_axis`` only for per-channel
classes), so their qparams match torchao's exactly. Our specs may omit the constructor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from _quantplug.annotation.spec_view import SpecKind, is_per_channel, spec_kind
from _quantplug.errors import AnnotationError
from _quantplug.graph.attrs import module_getattr
from _quantplug.observers.base import ObserverBase, ObserverFactory
from _quantplug.observers.fake_quantize import FakeQuantize
from _quantplug.observers.fixed import DerivedObserver, FixedQParamsObserver
from _quantplug.observers.minmax import MinMaxObserver, PerChannelMinMaxObserver
from _quantplug.observers.nonfinite import saw_masks
from _quantplug.observers.per_block import PerBlockMinMaxObserver


class DynamicPlaceholder(ObserverBase):
    """A dynamic spec's stand-in: no statistics, qparams are computed at run time."""

    needs_data = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _is_ours(ctr: Any) -> bool:
    return isinstance(ctr, ObserverFactory) or (isinstance(ctr, type) and issubclass(ctr, ObserverBase))


def _spec_fields(spec: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(spec):
        return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return {k: v for k, v in vars(spec).items() if not k.startswith("_")}


def _default_ctr(spec: Any) -> Any:
    if getattr(spec, "is_dynamic", False):
        return DynamicPlaceholder
    if getattr(spec, "block_size", None) is not None:
        return PerBlockMinMaxObserver
    if is_per_channel(spec):
        return PerChannelMinMaxObserver
    return MinMaxObserver


def create_observer(spec: Any, *, qat: bool, sources: Sequence[nn.Module] = ()) -> nn.Module:
    """The observer for a group whose representative spec is ``spec``.

    Args:
        spec: a plain, fixed or derived spec (any PT2E flavour).
        qat: build fake-quantize modules instead of observers.
        sources: for a derived spec, the observers of its ``derived_from`` keys, in order.
    """
    kind = spec_kind(spec)
    if kind is SpecKind.DERIVED:
        return DerivedObserver(
            sources,
            spec.derive_qparams_fn,
            dtype=spec.dtype,
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=spec.qscheme,
            ch_axis=spec.ch_axis,
        )
    if kind is SpecKind.FIXED:
        fixed = FixedQParamsObserver(
            spec.scale,
            spec.zero_point,
            dtype=spec.dtype,
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=getattr(spec, "qscheme", None),
        )
        return FakeQuantize(fixed) if qat else fixed
    if kind is not SpecKind.PLAIN:
        raise AnnotationError(f"cannot build an observer for {spec!r}")
    ctr = getattr(spec, "observer_or_fake_quant_ctr", None)
    fields = _spec_fields(spec)
    fields.pop("observer_or_fake_quant_ctr", None)
    if ctr is None or _is_ours(ctr):
        obs = (ctr or _default_ctr(spec))(**fields)
        return FakeQuantize(obs) if qat and not getattr(spec, "is_dynamic", False) else obs
    # a foreign constructor: call it exactly as torchao's prepare does
    cls = getattr(getattr(ctr, "p", None), "func", ctr)
    if "PerChannel" not in getattr(cls, "__name__", ""):
        fields.pop("ch_axis", None)
    fields.pop("block_size", None)
    try:
        return ctr.with_args(**fields)() if hasattr(ctr, "with_args") else ctr(**fields)
    except Exception as exc:
        raise AnnotationError(
            f"observer constructor {ctr!r} rejected spec fields {sorted(fields)}: {type(exc).__name__}: {exc}"
        ) from exc


def observer_saw_data(obs: nn.Module) -> bool:
    """Whether ``obs`` has statistics (works for ours and for torchao's observers/fake-quants);
    mask entries count: a tensor holding nothing but masks still gets a grid."""
    answer = _saw_data_or_range(obs)
    return answer if isinstance(answer, bool) else _range_holds_data(answer)


def observers_saw_data(observers: Sequence[nn.Module]) -> list[bool]:
    """``[observer_saw_data(obs) for obs in observers]``, the range checks of torchao-style
    observers in one comparison (convert asks it of every observer; three small tensor operations
    each): where every such range is non-empty and none holds +inf, each of them saw data."""
    answers = [_saw_data_or_range(obs) for obs in observers]
    ranges = [a for a in answers if not isinstance(a, bool)]
    if ranges and all(r.numel() and r.is_floating_point() for r in ranges):
        flat = torch.cat([r.detach().reshape(-1).float() for r in ranges])
        if not bool((flat == float("inf")).any()):
            return [True if not isinstance(a, bool) else a for a in answers]
    return [a if isinstance(a, bool) else _range_holds_data(a) for a in answers]


def _range_holds_data(min_val: torch.Tensor) -> bool:
    """+inf: never updated; NaN: saw data (convert refuses it)."""
    return min_val.numel() > 0 and not bool((min_val == float("inf")).all())


def _saw_data_or_range(obs: nn.Module) -> bool | torch.Tensor:
    """:func:`observer_saw_data` of ``obs``, or the ``min_val`` tensor whose values decide it."""
    if saw_masks(obs):
        return True
    if isinstance(obs, (ObserverBase, FakeQuantize)):
        return bool(obs.observed)
    inner = module_getattr(obs, "activation_post_process", None)
    if isinstance(inner, nn.Module):
        return _saw_data_or_range(inner)
    if type(obs).__name__ in (
        "FixedQParamsObserver",
        "PlaceholderObserver",
        "NoopObserver",
        "FixedQParamsFakeQuantize",
    ):
        return True
    if module_getattr(obs, "is_dynamic", False):
        return True
    min_val = module_getattr(obs, "min_val", None)
    return min_val if isinstance(min_val, torch.Tensor) else True
