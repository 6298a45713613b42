"""What calibration does with NaN and infinite values, for every kind of observer.

One NaN or inf in a range observer's input makes its range, hence the scale, NaN or infinite:
the converted program then outputs NaN and the encodings files hold non-JSON ``NaN`` tokens.
The policy, chosen with ``prepare(..., nonfinite=...)``:

* ``"error"`` (the default): a NaN anywhere, or an infinity in the model's inputs (calibration
  data), raises :class:`~_quantplug.errors.NonFiniteError` at the first observer that sees it,
  naming its node(s) and counting the values, during the very batch that brought them (the
  command line adds the file, batch and input). Infinities the model computes itself from finite
  inputs are attention masks (``masked_fill(mask, -inf)``, ``generate_square_subsequent_mask``):
  they are left out of the statistics and counted per observer (``infinities_masked``;
  :func:`masked_counts` gathers them), and so are the finite stand-ins for ``-inf`` that
  transformers and others fill masks with (``torch.finfo(dtype).min``, -1e9: any computed value
  at or below :data:`MASK_SENTINEL`; -1e4 on the way into a softmax, at or below
  :data:`SCORE_MASK_SENTINEL`: see ``_quantplug.graph.softmax_inputs``); at convert the grid is
  extended :data:`MASK_MARGIN` below the smallest real value (above the largest for ``+inf``;
  :func:`widen_for_masks`), so that a masked entry, which quantize clamps to the grid's end, keeps
  its meaning: after a softmax its weight is below ``exp(-MASK_MARGIN)``, where a grid ending at
  the real values would give it the weight of the smallest score;
* ``"strict"``: any NaN or infinity raises, masks included (finite sentinels are data then);
* ``"ignore"``: every NaN and infinity is left out of the statistics and counted per observer
  (``nonfinite_ignored``; :func:`ignored_counts` gathers them for the report).

Observers find out for free: they compute each batch's min and max anyway, and a NaN, infinite
or sentinel extreme is the only sign needed (:func:`ordinary`); only then is the batch scanned
again. Observers built to hold
infinities (the QNN backend's mask-aware observer: ``-inf`` attention masks) keep doing so; NaN
is never a mask. Whatever an observer does, :func:`check_qparams` makes ``convert`` refuse a
non-finite scale or zero point (e.g. from a third-party observer), so no output file ever holds
one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from _quantplug.annotation.specs import SYMMETRIC_QSCHEMES
from _quantplug.errors import NonFiniteError, OptionError
from _quantplug.meta import observer_children
from _quantplug.observers.base import ObserverBase, qparams_from_range

POLICIES = ("error", "strict", "ignore")
#: where prepare keeps the policy and the node names on an observer
POLICY_ATTR = "nonfinite"
WHERE_ATTR = "where"
#: whether the observer measures a model input (calibration data: an infinity there is bad data)
INPUT_ATTR = "observes_input"
#: whether the observer measures values that reach a softmax as its scores (``flow.softmax_inputs``)
SCORES_ATTR = "observes_scores"
COUNT_ATTR = "nonfinite_ignored"
MASKED_ATTR = "infinities_masked"
#: which ends saw mask infinities: "-inf" and/or "+inf" (a set on the observer)
MASK_ENDS_ATTR = "mask_ends"
#: a value the model computes at or below this is a mask entry, not data: transformers fills its
#: attention masks with ``torch.finfo(dtype).min`` (-3.4e38), other code with -1e9 or -65504. A
#: grid spanning one of them rounds every score to the same code (MPT's attention became a plain
#: average at int8). The fp16 range's end, the threshold ExecuTorch's QNN quantizer uses.
MASK_SENTINEL = -float(torch.finfo(torch.float16).max)
#: the same for values that reach a softmax as its scores: there a value 1000 below its row's
#: largest has no weight in any float format (``exp(-1000)`` is 0 even in float64), and code older
#: than ``finfo.min`` masks with -1e4 or -10000 (OpenAI GPT, BigBird, MarkupLM, TAPAS), which a
#: plain activation may well hold as data. A row whose real scores all lie below -255 would feel
#: the difference; attention logits lie in the tens (Gemma 2 softcaps them at 50).
SCORE_MASK_SENTINEL = -1000.0
#: how far below the smallest real value a ``-inf`` mask entry dequantizes (above for ``+inf``):
#: the softmax weight of a masked entry is then below exp(-16) ~ 1e-7
MASK_MARGIN = 16.0


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise OptionError(f"nonfinite must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def configure(
    observer: nn.Module,
    policy: str,
    where: str,
    *,
    observes_input: bool = True,
    observes_scores: bool = False,
) -> None:
    """Give ``observer`` (and the observers it wraps) the policy, the node names it serves,
    whether one of them is a model input and whether its values reach a softmax as scores.

    Set as ``nn.Module.__setattr__`` sets them (plain values under names that are no parameter,
    buffer or submodule: ``object.__setattr__``) without its checks, a third of prepare's time
    per observer; a class with its own ``__setattr__`` gets it called."""
    values = (
        (POLICY_ATTR, policy),
        (WHERE_ATTR, where),
        (INPUT_ATTR, observes_input),
        (SCORES_ATTR, observes_scores),
    )
    for module in observer.modules() if observer._modules else (observer,):
        if not hasattr(module, POLICY_ATTR):
            continue
        held = (module._parameters, module._buffers, module._modules)
        plain = type(module).__setattr__ is nn.Module.__setattr__
        for name, value in values:
            if plain and not any(name in d for d in held):
                object.__setattr__(module, name, value)
            else:
                setattr(module, name, value)


def mask_sentinel(observer: Any) -> float:
    """The value at or below which what ``observer`` sees is a mask entry: :data:`MASK_SENTINEL`,
    or :data:`SCORE_MASK_SENTINEL` for a softmax's scores; -inf (none) where it measures a model
    input (in calibration data huge values are data) or the policy is "strict"."""
    if getattr(observer, INPUT_ATTR, True) or getattr(observer, POLICY_ATTR, "error") == "strict":
        return -math.inf
    return SCORE_MASK_SENTINEL if getattr(observer, SCORES_ATTR, False) else MASK_SENTINEL


def ordinary(observer: Any, lo: float, hi: float) -> bool:
    """Whether a batch whose extremes are ``lo`` and ``hi`` needs no :func:`handle`: both finite
    (False with NaN), and no mask sentinel among the values ``observer`` sees."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False
    return lo > SCORE_MASK_SENTINEL or lo > mask_sentinel(observer)  # the first: no attribute read


def all_ordinary(observer: Any, *tensors: torch.Tensor) -> bool:
    """:func:`ordinary` for tensors of extremes (per channel, per block) or for a whole batch."""
    sentinel = mask_sentinel(observer)
    return all(
        bool(torch.isfinite(t).all()) and not bool((t <= sentinel).any()) for t in tensors if t.numel()
    )


def nonfinite_counts(data: torch.Tensor, finite: torch.Tensor | None = None) -> tuple[int, int, str]:
    """How many NaN and how many infinities ``data`` holds, and both in words (``"3 NaN and 1
    inf"``), as every NaN/inf message says them. ``finite``: ``torch.isfinite(data)``, if known."""
    keep = torch.isfinite(data) if finite is None else finite
    nan = int(torch.isnan(data).sum())
    inf = data.numel() - int(keep.sum()) - nan
    return nan, inf, " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "inf")) if n)


def handle(observer: Any, data: torch.Tensor) -> torch.Tensor:
    """The mask of ``data``'s values to keep, once its extremes were found not :func:`ordinary`.

    Raises NonFiniteError where the policy says so (module docstring); otherwise counts the other
    elements on the observer (as ignored, or as masks) and returns the mask of those to keep.
    """
    finite = torch.isfinite(data)
    nan, inf, counts = nonfinite_counts(data, finite)
    keep = finite
    threshold = mask_sentinel(observer)
    if threshold > -math.inf:
        sentinel = (data <= threshold) & finite  # -inf follows the policy below
        if mask_like(data, sentinel, finite):
            keep = finite & ~sentinel
            _record_masks(observer, int(sentinel.sum()), {"-inf"})
    policy = getattr(observer, POLICY_ATTR, "error")
    if not nan and not inf:
        return keep
    if policy == "ignore":
        setattr(observer, COUNT_ATTR, getattr(observer, COUNT_ATTR, 0) + nan + inf)
        return keep
    if policy == "error" and not nan and not getattr(observer, INPUT_ATTR, True):
        ends = {end for end, inf_ in (("-inf", -math.inf), ("+inf", math.inf)) if bool((data == inf_).any())}
        _record_masks(observer, inf, ends)
        return keep
    where = getattr(observer, WHERE_ATTR, "") or f"a {type(observer).__name__}"
    if nan:
        cause = "NaN is never a valid value; fix the data (or the model)"
    elif policy == "strict":
        cause = "nonfinite='strict' refuses infinities, attention masks included"
    else:
        cause = "infinities in the model's inputs are bad calibration data; fix the data"
    raise NonFiniteError(
        f"{counts} value(s) reached the observer of {where}: a range (and the scale) computed from "
        f"them would not be finite ({cause}), or prepare(..., nonfinite='ignore') to leave such values "
        "out of the statistics",
        where=where,
        nan=nan,
        inf=inf,
    )


#: how far beyond every other value of the batch a mask entry lies: masks are sentinels
#: (-65504, -1e9, ``finfo.min``; -1e4 before a softmax), orders of magnitude past the data, where
#: activations that merely reach past the threshold continue the data's own range
MASK_GAP = 8.0


def mask_like(data: torch.Tensor, sentinel: torch.Tensor, finite: torch.Tensor) -> bool:
    """Whether the values at or below the mask threshold (``sentinel``) are mask entries rather
    than data: each at least :data:`MASK_GAP` times farther from zero than every other finite value
    of the batch. Activations of a model with a wide range (down to -200,000) are data: taken for
    masks they were left out of the range and clamped (held-out SQNR 30.1 -> 3.8 dB)."""
    if not bool(sentinel.any()):
        return False
    others = finite & ~sentinel
    if not bool(others.any()):
        return True  # nothing but sentinels: a mask-filled state (RWKV's first step)
    nearest = float(data[sentinel].max())
    widest = float(data[others].abs().max())
    return abs(nearest) >= MASK_GAP * widest


def _record_masks(observer: Any, count: int, ends: set[str]) -> None:
    """Count ``count`` mask entries on ``observer`` and the ends of its grid (``"-inf"``,
    ``"+inf"``) they lie beyond."""
    if count:
        setattr(observer, MASKED_ATTR, getattr(observer, MASKED_ATTR, 0) + count)
        setattr(observer, MASK_ENDS_ATTR, frozenset(set(getattr(observer, MASK_ENDS_ATTR, ())) | ends))


def finite_extremes(
    observer: Any, data: torch.Tensor, dims: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max of ``data``'s finite elements (over ``dims``, all by default), once its
    extremes were found non-finite; raises under the "error" policy (see :func:`handle`).

    Where a slice has no finite element its min is +inf and its max -inf: an empty range that
    leaves running statistics unchanged.
    """
    keep = handle(observer, data)
    inf = torch.tensor(math.inf, dtype=data.dtype, device=data.device)
    low = torch.where(keep, data, inf)
    high = torch.where(keep, data, -inf)
    if dims is None:
        return low.amin(), high.amax()
    return low.amin(dim=tuple(dims)), high.amax(dim=tuple(dims))


def _mask_ends(observer: nn.Module) -> set[str]:
    """The ends of the grid past which ``observer`` (or an observer it wraps) saw mask entries."""
    ends: set[str] = set()
    for module in observer.modules():
        ends |= set(vars(module).get(MASK_ENDS_ATTR, ()))
    return ends


def saw_masks(observer: nn.Module) -> bool:
    """Whether ``observer`` counted mask entries. One that saw nothing else still has a grid:
    :func:`widen_for_masks` gives it ``[-MASK_MARGIN, 0]`` (RWKV starts its recurrence from a
    state of -1e38: its first step's tensors hold nothing but that)."""
    return bool(_mask_ends(observer))


def widen_for_masks(observer: nn.Module, qparams: tuple[Any, Any]) -> tuple[Any, Any]:
    """``qparams`` of a per-tensor grid extended :data:`MASK_MARGIN` past the real values on each
    end where the observer saw mask infinities (module docstring); unchanged otherwise."""
    ends = _mask_ends(observer)
    if not ends:  # (most observers: nothing to look at)
        return qparams
    scale, zero_point = qparams
    scale_t, zp_t = torch.as_tensor(scale), torch.as_tensor(zero_point)
    if scale_t.numel() != 1:
        return qparams
    fields: Any = observer  # an observer's grid: quantplug's or torchao's fields
    qmin, qmax = int(fields.quant_min), int(fields.quant_max)
    s, z = float(scale_t.reshape(-1)[0]), int(zp_t.reshape(-1)[0])
    lo, hi = (qmin - z) * s, (qmax - z) * s
    if "-inf" in ends:
        lo = min(lo, 0.0) - MASK_MARGIN
    if "+inf" in ends:
        hi = max(hi, 0.0) + MASK_MARGIN
    new_scale, new_zp = qparams_from_range(
        torch.tensor(lo),
        torch.tensor(hi),
        dtype=fields.dtype,
        quant_min=qmin,
        quant_max=qmax,
        symmetric=getattr(observer, "qscheme", None) in SYMMETRIC_QSCHEMES,
        eps=float(getattr(observer, "eps", torch.finfo(torch.float32).eps)),
    )
    return new_scale.reshape(scale_t.shape).to(scale_t.dtype), new_zp.reshape(zp_t.shape).to(zp_t.dtype)


def ignored_counts(prepared: nn.Module) -> dict[str, int]:
    """Node(s) -> how many NaN/inf values their observer left out (``nonfinite="ignore"``)."""
    return _counts(prepared, COUNT_ATTR)


def masked_counts(prepared: nn.Module) -> dict[str, int]:
    """Node(s) -> how many infinities the model computed (masks) their observer left out."""
    return _counts(prepared, MASKED_ATTR)


def _counts(prepared: nn.Module, attr: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for observer in _observers(prepared):
        # the instances' own counters (a wrapper such as FakeQuantize forwards attribute reads)
        total = sum(int(vars(m).get(attr, 0)) for m in observer.modules())
        if total:
            where = str(getattr(observer, WHERE_ATTR, "") or "?")
            counts[where] = counts.get(where, 0) + total
    return counts


def _observers(prepared: nn.Module) -> Iterator[nn.Module]:
    for _, observer in observer_children(prepared):
        yield observer


def check_state(where: str, observer: Any) -> None:
    """Refuse an observer whose recorded range holds NaN or a +-inf end (a third-party observer
    that recorded NaN/inf values), before its ``calculate_qparams`` asserts or returns NaN.
    quantplug's own observers never record them (they apply the policy as data arrives)."""
    if isinstance(observer, ObserverBase) or hasattr(type(observer), POLICY_ATTR):
        return
    for name in ("min_val", "max_val"):
        value = getattr(observer, name, None)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            bad = torch.isnan(value) | (value == (-math.inf if name == "min_val" else math.inf))
            if bool(bad.any()):
                raise NonFiniteError(
                    f"the observer of {where} recorded a non-finite range ({name} "
                    f"{value.reshape(-1)[:4].tolist()}): the data it saw held NaN or inf values (its "
                    "observer cannot leave them out); fix the calibration data or the model",
                    where=where,
                )


def check_all_qparams(found: Sequence[tuple[str, Any, Any]]) -> None:
    """:func:`check_qparams` of each ``(where, scale, zero_point)``, in one pass over them all
    (convert has thousands on a large model)."""
    floats = [
        t.reshape(-1)
        for _, scale, zero_point in found
        for t in (torch.as_tensor(scale), torch.as_tensor(zero_point))
        if t.is_floating_point() and t.numel()
    ]
    if floats and bool(torch.isfinite(torch.cat([f.float() for f in floats])).all()):
        return
    for where, scale, zero_point in found:
        check_qparams(where, scale, zero_point)


def check_qparams(where: str, scale: Any, zero_point: Any) -> None:
    """Refuse non-finite qparams (a scale of NaN or inf, or a float zero point that is one)."""
    bad = []
    for name, value in (("scale", scale), ("zero point", zero_point)):
        t = torch.as_tensor(value)
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad.append(f"{name} {t.reshape(-1)[:4].tolist()}")
    if bad:
        raise NonFiniteError(
            f"the observer of {where} gives a non-finite {' and '.join(bad)}: the data it saw held NaN or "
            "inf values (its observer cannot leave them out); fix the calibration data or the model",
            where=where,
        )
