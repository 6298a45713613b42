"""What every observer is, and the one formula that turns a range into qparams.

An observer is an ``nn.Module`` whose ``forward`` records statistics and returns its input
unchanged, and whose ``calculate_qparams()`` returns ``(scale, zero_point)`` tensors. That is the
PT2E protocol, so torchao's observers also work wherever ours do. ``qparams_from_range`` uses
the same arithmetic as torchao's observers so both give bit-identical scales for the same data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from _quantplug.annotation.dtypes import UINT2, UINT4, full_range, resolve_range
from _quantplug.annotation.specs import SYMMETRIC_QSCHEMES
from _quantplug.errors import ObserverMergeError, OptionError
from _quantplug.observers import seen

DEFAULT_EPS = float(torch.finfo(torch.float32).eps)
#: ``num_batches.add_(ONE)``: a batch counted in place without wrapping a Python 1 into a tensor
#: per call (``num_batches += 1`` also goes through ``Module.__setattr__``: 10 us a call)
ONE = torch.ones((), dtype=torch.int64)
#: the instance attribute where a range observer keeps views of its 0-dim buffers
#: (:func:`_quantplug.observers.minmax.scalar_views`): never copied or pickled
SCALAR_VIEWS = "_quantplug_scalar_views"


class ObserverFactory:
    """A constructor with bound keyword arguments; ``Observer.with_args(eps=...)`` returns one.

    Mirrors PT2E's ``with_args`` so configs written for torchao read the same, and stays a plain
    value (comparable, hashable by identity) so it can sit inside a frozen spec.
    """

    def __init__(self, cls: type[nn.Module], kwargs: dict[str, Any]) -> None:
        self.cls = cls
        self.kwargs = dict(kwargs)

    def with_args(self, **kwargs: Any) -> ObserverFactory:
        return ObserverFactory(self.cls, {**self.kwargs, **kwargs})

    def __call__(self, **kwargs: Any) -> nn.Module:
        return self.cls(**{**kwargs, **self.kwargs})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObserverFactory) and (self.cls, self.kwargs) == (other.cls, other.kwargs)

    def __hash__(self) -> int:
        return hash((self.cls, tuple(sorted(self.kwargs.items(), key=lambda kv: kv[0]))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.cls.__name__}.with_args({args})"


def qparams_from_range(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    *,
    dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    symmetric: bool,
    eps: float = DEFAULT_EPS,
    customized_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point covering ``[min_val, max_val]`` (per tensor or per channel).

    The range always includes zero. Symmetric grids put zero at the grid's midpoint: 0 for signed
    dtypes, 128 / 32768 for full-range uint8 / uint16, and the rounded-down midpoint of a custom
    unsigned range (torchao's convention).
    """
    min_neg = torch.clamp(min_val, max=0.0)
    max_pos = torch.clamp(max_val, min=0.0)
    eps_t = torch.tensor(eps, dtype=torch.float32, device=min_val.device)
    zero_point = torch.zeros(min_neg.size(), dtype=torch.int64, device=min_val.device)
    if symmetric:
        max_pos = torch.max(-min_neg, max_pos)
        scale = torch.max(max_pos / (float(quant_max - quant_min) / 2), eps_t)
        if dtype in (torch.uint8, torch.uint16, UINT4, UINT2):
            if customized_range:
                mid = (quant_min + quant_max) // 2
            else:
                mid = (full_range(dtype)[1] + 1) // 2
            zero_point = zero_point.new_full(zero_point.size(), mid)
    else:
        scale = torch.max((max_pos - min_neg) / float(quant_max - quant_min), eps_t)
        zero_point = quant_min - torch.round(min_neg / scale).to(torch.int)
        zero_point = torch.clamp(zero_point, quant_min, quant_max)
    if scale.dim() == 0:
        scale = scale.reshape(1)
    if zero_point.dim() == 0:
        zero_point = zero_point.reshape(1)
    return scale.to(torch.float32), zero_point


class ObserverBase(nn.Module):
    """Common state of quantplug observers: the grid they target and whether they saw data."""

    #: True for observers that need no data (fixed qparams, derived).
    needs_data: ClassVar[bool] = True
    #: NaN/inf values: "error" raises NonFiniteError, "ignore" leaves them out and counts them in
    #: ``nonfinite_ignored``; ``where`` names the node(s) observed. Both are set by
    #: ``prepare(..., nonfinite=...)`` (see _quantplug.observers.nonfinite).
    nonfinite: str = "error"
    where: str = ""
    nonfinite_ignored: int = 0
    num_batches: torch.Tensor
    # ``module(x)`` is torch's call, made in one frame where it would only call ``forward``, once
    # prepare is imported (:mod:`_quantplug.peers.torch_module_call` installs it from the layer above)

    def __init__(
        self,
        dtype: torch.dtype = torch.uint8,
        qscheme: torch.qscheme | None = torch.per_tensor_affine,
        quant_min: int | None = None,
        quant_max: int | None = None,
        ch_axis: int | None = None,
        is_dynamic: bool = False,
        eps: float = DEFAULT_EPS,
        block_size: tuple[int, ...] | None = None,
        range_margin: float = 1.0,
        **_ignored: Any,
    ) -> None:
        super().__init__()
        if not 1.0 <= range_margin < math.inf:
            raise OptionError(
                f"{type(self).__qualname__}: range_margin must be a finite factor >= 1 (1: the "
                f"observed range as it is), got {range_margin}"
            )
        self.dtype = dtype
        self.qscheme = qscheme if qscheme is not None else torch.per_tensor_affine
        self.customized_range = quant_min is not None and quant_max is not None
        self.quant_min, self.quant_max = resolve_range(dtype, quant_min, quant_max)
        self.ch_axis = ch_axis
        self.is_dynamic = is_dynamic
        self.eps = float(eps)
        self.block_size = block_size
        #: the grid covers ``range_margin`` times the observed range (both ends scaled away from
        #: zero): values beyond what calibration saw keep their place instead of clipping. For
        #: grids with steps to spare (16-bit activations), where held-out data exceed a few
        #: calibration batches' range; 1 keeps the observed range.
        self.range_margin = float(range_margin)
        self.register_buffer("num_batches", torch.zeros((), dtype=torch.int64), persistent=False)

    @classmethod
    def with_args(cls, **kwargs: Any) -> ObserverFactory:
        return ObserverFactory(cls, kwargs)

    @property
    def symmetric(self) -> bool:
        return self.qscheme in SYMMETRIC_QSCHEMES

    @property
    def observed(self) -> bool:
        """True once the observer has statistics to compute qparams from."""
        return not self.needs_data or int(self.num_batches) > 0

    def merge_(self, others: Sequence[nn.Module]) -> None:
        """Fold the statistics of ``others`` (same class, same grid) into this observer, so that it
        stands for every batch they saw too (rules: :mod:`_quantplug.observers.merge`).

        ``quantplug.distributed.sync_observers`` calls it once per group with the observers of the
        other processes (rebuilt from their buffers). Observers without statistics inherit this
        no-op; an observer with statistics must override it, else merging it is refused.
        """
        if self.needs_data:
            raise ObserverMergeError(
                f"{type(self).__qualname__} keeps statistics but defines no merge_(others), so they "
                "cannot be combined across processes; override merge_ (see 'Observers that merge' in "
                "docs/writing-a-backend.md)"
            )

    def __getstate__(self) -> dict[str, Any]:
        """The module's state without the batches it saw last (``observers.seen``: weak references
        to storages, meaningless in a copy) and without views of its buffers' memory."""
        state = dict(super().__getstate__())
        state.pop(seen.ATTR, None)
        state.pop(SCALAR_VIEWS, None)
        return state

    def _add_batches(self, others: Sequence[Any]) -> None:
        """``num_batches`` after a merge: every batch any of them saw."""
        self.num_batches.fill_(sum(int(o.num_batches) for o in (self, *others)))

    def _qparams(self, min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.range_margin != 1.0:
            min_val, max_val = min_val * self.range_margin, max_val * self.range_margin
        return qparams_from_range(
            min_val,
            max_val,
            dtype=self.dtype,
            quant_min=self.quant_min,
            quant_max=self.quant_max,
            symmetric=self.symmetric,
            eps=self.eps,
            customized_range=self.customized_range,
        )

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, qscheme={self.qscheme}, range=[{self.quant_min}, {self.quant_max}]"
