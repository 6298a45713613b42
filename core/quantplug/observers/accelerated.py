"""Faster, bit-identical stand-ins for the torchao observers that foreign quantizer configs bring.

A PT2E quantizer written for torchao (``X86InductorQuantizer``, ``XNNPACKQuantizer``, ExecuTorch's
``QnnQuantizer``) names torchao's observer classes in its specs; ``prepare`` builds them exactly as
torchao does, so that ``convert`` gives torchao's qparams. Two of them dominate calibration and
convert time for reasons unrelated to the statistics they keep:

* ``HistogramObserver``: ``torch.histc`` bins one element per 6-7 ns in scalar code, a few
  ``.item()``-style host syncs per batch, and a clipping search that walks histogram bins in a
  Python loop indexing a tensor one element at a time.
* ``PerChannelMinMaxObserver``: ``torch.aminmax(y, dim=1)`` is about 15x slower than
  ``amin`` plus ``amax`` on the same rows.

``accelerate(obs)`` swaps the class of an instance of exactly one of those classes for a subclass
defined here. The subclasses override only the hot methods and produce bit-identical state and
qparams: the same float32 operations in the same order, with loop-invariant work hoisted; where a
torch kernel is replaced, the replacement computes the same function (``histc``'s linear
interpolation binning, emulated with the same float32 arithmetic; exact min/max reductions). Any
case off the common path (non-float32 or non-CPU tensors, inf/NaN, a state of unexpected shape,
more than 2**24 elements) calls torchao's own method. Subclasses of torchao's observers are left
alone: they may override what we would skip.
"""

from __future__ import annotations

import copy
import struct
import sys

import torch
from torch import nn

_TORCHAO_OBSERVERS = "torchao.quantization.pt2e.observer"

#: histc accumulates counts in float32: exact below 2**24 elements per call
MAX_EXACT_COUNT = 1 << 24


def histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """``torch.histc(x, bins, min=lo, max=hi)`` for float32 CPU ``x``, bit for bit, about 2x faster.

    torch.histc builds ``linspace(lo, hi, bins + 1)`` edges, skips elements outside the first and
    last edge, and bins the rest by ``int64((x - left) * bins / (right - left))`` in float32
    scalar code, moving what lands on the last edge into the last bin. The same float32 steps
    here are vectorised tensor ops and a ``bincount``; anything unusual goes to torch.histc.
    """
    if not lo < hi or x.numel() >= MAX_EXACT_COUNT or x.dtype != torch.float32 or x.device.type != "cpu":
        return torch.histc(x, bins, min=lo, max=hi)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float32).numpy()
    left, right = edges[0], edges[bins]  # numpy float32 scalars
    if float(left) != lo or float(right) != hi:  # then some elements may lie outside the edges
        return torch.histc(x, bins, min=lo, max=hi)
    span = float(right - left)  # float32 subtraction, as in the kernel
    t = torch.sub(x.reshape(-1), float(left))
    t.mul_(bins).div_(span)
    counts = torch.bincount(t.to(torch.int32), minlength=bins + 1)
    hist = counts[:bins].to(torch.float32)
    hist[bins - 1] += counts[bins]  # the last edge belongs to the last bin
    return hist


def float32(value: float) -> float:
    """``value`` rounded to float32, as torch does when comparing a float32 tensor to a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def accelerate(obs: nn.Module) -> nn.Module:
    """Swap ``obs`` to its faster bit-identical class if it is exactly a known torchao observer."""
    if _TORCHAO_OBSERVERS not in sys.modules:  # then obs cannot be one of its observers
        return obs
    from quantplug.observers.torchao_fast import ACCELERATED

    fast = ACCELERATED.get(type(obs))
    if fast is not None:
        obs.__class__ = fast
    return obs


_MODULE_STATE = frozenset(nn.Module().__dict__)
_IMMUTABLE = (
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.qscheme,
    torch.device,
    tuple,
    frozenset,
)


def fresh_copy(obs: nn.Module) -> nn.Module:
    """An independent copy of an observer, to feed without touching the prepared module.

    Observers keep their statistics in buffers, so a leaf observer whose other attributes are
    immutable values is copied by cloning its buffers (about 15x cheaper than ``deepcopy``);
    anything else is deep-copied.
    """
    simple = not obs._modules and not obs._parameters
    if simple:
        simple = all(isinstance(v, _IMMUTABLE) for k, v in obs.__dict__.items() if k not in _MODULE_STATE)
    if not simple:
        return copy.deepcopy(obs)
    new = object.__new__(type(obs))
    new.__dict__ = obs.__dict__.copy()
    new._buffers = {k: None if v is None else v.clone() for k, v in obs._buffers.items()}
    new._non_persistent_buffers_set = set(obs._non_persistent_buffers_set)
    new._parameters = {}
    new._modules = {}
    return new


_PURE_TORCHAO_CTORS = frozenset(
    {
        "MinMaxObserver",
        "PerChannelMinMaxObserver",
        "HistogramObserver",
        "MovingAverageMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver",
    }
)


def clonable(obs: nn.Module) -> bool:
    """Whether a freshly built ``obs`` may stand for more of its kind (``fresh_copy`` of it).

    True for torchao's plain observer classes (their constructors only store their arguments and
    register empty statistics), whose constructors cost about 70 us each against 15 us for a copy.
    """
    cls = type(obs)
    return cls.__module__ == _TORCHAO_OBSERVERS and cls.__name__ in _PURE_TORCHAO_CTORS
