"""What the algorithms' collectors do with NaN and infinite layer inputs.

A collector sums what it is fed (a Hessian, a mean, a sample of rows): one NaN makes the sum NaN,
and the algorithm then either gives up on the layer without a word or fails at convert with an
error that does not name the data as the cause. Observers follow ``prepare(..., nonfinite=...)``
(:mod:`_quantplug.observers.nonfinite`), but a weight-only configuration has no activation
observer at all, so nothing else would notice. The taps that feed collectors apply the same
policy, by samples (the leading dimension: a batch's items, or the rows of a 2-D input) so that
every collector still receives a tensor of the layer input's shape:

* ``"error"`` and ``"strict"``: a NaN or an infinity in a layer's input raises
  :class:`~_quantplug.errors.NonFiniteError` naming the layer and the algorithms collecting there
  (a weight layer has no attention-mask infinities to tolerate: its output would be inf or NaN);
* ``"ignore"``: the samples holding one are left out and counted; convert logs the counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from _quantplug.errors import NonFiniteError
from _quantplug.observers.nonfinite import nonfinite_counts


def finite_samples(
    x: torch.Tensor, policy: str, site: str, owners: Sequence[str]
) -> tuple[torch.Tensor | None, int]:
    """``x`` without its samples that hold a NaN or an infinity, and how many were left out.

    None when nothing is left (an unbatched input that holds one counts as one sample). Raises
    under the "error" and "strict" policies (module docstring); ``site`` (the weight) and
    ``owners`` (the algorithms) name where in the message.
    """
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return x, 0
    if policy != "ignore":
        nan, inf, counts = nonfinite_counts(x, finite)
        reached = (
            f"the input of the layer with weight {site}, where algorithm(s) "
            f"{', '.join(sorted(set(owners)))} collect statistics"
        )
        raise NonFiniteError(
            f"{counts} value(s) reached {reached}: a layer's input must be finite (check the "
            "calibration data, or the model before this layer), or pass "
            "prepare(..., nonfinite='ignore') to leave the samples holding them out",
            where=site,
            nan=nan,
            inf=inf,
            reached=reached,
        )
    if x.dim() < 2:
        return None, 1
    keep = finite.reshape(x.shape[0], -1).all(dim=1)
    dropped = int(x.shape[0] - int(keep.sum()))
    return (x[keep] if bool(keep.any()) else None), dropped
