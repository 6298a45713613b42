"""What calibration does with NaN and infinite values, for every kind of observer.

One NaN or inf in a range observer's input makes its range, hence the scale, NaN or infinite:
the converted program then outputs NaN and the encodings files hold non-JSON ``NaN`` tokens.
The policy, chosen with ``prepare(..., nonfinite=...)``:

* ``"error"`` (the default): the first observer that sees such a value raises
  :class:`~quantplug.errors.NonFiniteError` naming its node(s) and counting the values, during
  the very batch that brought them (the command line adds the file, batch and input);
* ``"ignore"``: the values are left out of the statistics and counted per observer
  (``nonfinite_ignored``; :func:`ignored_counts` gathers them for the report).

Observers find out for free: they compute each batch's min and max anyway, and a NaN or infinite
extreme is the only sign needed; only then is the batch scanned again. Observers built to hold
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

from quantplug.errors import NonFiniteError
from quantplug.observers.base import ObserverBase

POLICIES = ("error", "ignore")
#: where prepare keeps the policy and the node names on an observer
POLICY_ATTR = "nonfinite"
WHERE_ATTR = "where"
COUNT_ATTR = "nonfinite_ignored"


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        from quantplug.errors import OptionError

        raise OptionError(f"nonfinite must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def configure(observer: nn.Module, policy: str, where: str) -> None:
    """Give ``observer`` (and the observers it wraps) the policy and the node names it serves."""
    for module in observer.modules():
        if hasattr(module, POLICY_ATTR):
            setattr(module, POLICY_ATTR, policy)
            setattr(module, WHERE_ATTR, where)


def finite(lo: float, hi: float) -> bool:
    """Whether a batch's extremes are finite (False with NaN)."""
    return math.isfinite(lo) and math.isfinite(hi)


def handle(observer: Any, data: torch.Tensor) -> torch.Tensor:
    """``data``'s finite-element mask, once its extremes were found non-finite.

    Under the "error" policy raises NonFiniteError; under "ignore" counts the other elements on
    the observer and returns the mask of those to keep.
    """
    keep = torch.isfinite(data)
    nan = int(torch.isnan(data).sum())
    inf = data.numel() - int(keep.sum()) - nan
    if getattr(observer, POLICY_ATTR, "error") != "ignore":
        where = getattr(observer, WHERE_ATTR, "") or f"a {type(observer).__name__}"
        counts = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "inf")) if n)
        raise NonFiniteError(
            f"{counts} value(s) reached the observer of {where}: a range (and the scale) computed from "
            "them would not be finite; fix the data (or the model), or prepare(..., nonfinite='ignore') "
            "to leave such values out of the statistics",
            where=where,
            nan=nan,
            inf=inf,
        )
    setattr(observer, COUNT_ATTR, getattr(observer, COUNT_ATTR, 0) + nan + inf)
    return keep


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


def all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def ignored_counts(prepared: nn.Module) -> dict[str, int]:
    """Node(s) -> how many NaN/inf values their observer left out (``nonfinite="ignore"``)."""
    counts: dict[str, int] = {}
    for observer in _observers(prepared):
        # the instances' own counters (a wrapper such as FakeQuantize forwards attribute reads)
        total = sum(int(vars(m).get(COUNT_ATTR, 0)) for m in observer.modules())
        if total:
            where = str(getattr(observer, WHERE_ATTR, "") or "?")
            counts[where] = counts.get(where, 0) + total
    return counts


def _observers(prepared: nn.Module) -> Iterator[nn.Module]:
    from quantplug.flow.prepare import OBSERVERS

    container = getattr(prepared, OBSERVERS, None)
    if isinstance(container, nn.Module):
        yield from container.children()


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
