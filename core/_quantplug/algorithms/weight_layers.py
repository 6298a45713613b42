"""What AdaRound, SeqMSE and GPTQ share on the torch side: a layer's Hessian, a weight's matrix view.

* :class:`LayerHessian` -- the collector: ``H = sum x x^T`` of the rows a layer multiplies its
  weight with (a linear's input features; a convolution's patches), accumulated batch by batch.
  Convolution patches are read through the layer itself (``site.forward`` with one-hot kernels,
  bias subtracted), so stride, padding and dilation are the op's own, whatever they are.
* :func:`site_matrix` -- a weight and its grid as the ``[O, I]`` matrix and expanded encoding the
  pure algorithms take (:mod:`_quantplug.algorithms.weight_matrix`), and the way back to codes of
  the weight's shape.

A grouped convolution (depthwise included) is collected group by group: ``H`` is a stack
``[G, I, I]``, one per group of output channels (:mod:`~_quantplug.algorithms.weight_matrix`).
A recurrent op's ``w_ih``/``w_hh`` is a linear layer over rows the op computes inside
(:mod:`~_quantplug.graph.recurrent`); a mixture-of-experts weight ``[experts, out, in]`` is
one linear per expert over the rows routed to it, collected expert by expert as a grouped
convolution is group by group (:mod:`~_quantplug.algorithms.experts`). Weights these algorithms
cannot express as ``y = W x`` on collected rows (transposed convolutions, a projected LSTM's
``w_hr``, block shapes that are not contiguous in a row) keep the backend's default encoding:
:func:`site_matrix` or the collector returns None for them.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from _quantplug.algorithms.collectors import sum_in_order
from _quantplug.algorithms.experts import GATHER_OP
from _quantplug.algorithms.spec import AlgorithmOption, WeightGrid, WeightSite, option
from _quantplug.algorithms.weight_matrix import (
    HessianAccumulator,
    IntegerGrid,
    column_groups,
    from_matrix,
    matrix_tiles,
    output_error,
    rows_times,
    shrink_toward_diagonal_,
    shrunk_toward_diagonal,
    to_matrix,
)
from _quantplug.errors import AlgorithmError, OptionError
from _quantplug.graph.recurrent import RECURRENT_OPS

#: clipped weight matrix ``[O, I]`` -> its encoding expanded to ``[O, I]`` (scale, zero point)
Encoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger("quantplug.algorithms")

LINEAR_OPS = frozenset({"aten.linear.default"})
CONV_OPS = frozenset({"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default"})


def layer_kind(site: WeightSite) -> str | None:
    """``"linear"``, ``"conv"``, ``"experts"`` or None (a weight these algorithms leave to the
    backend)."""
    if not site.has_layer or site.weight.dim() < 2:
        return None
    if (site.op in LINEAR_OPS or site.op in RECURRENT_OPS) and site.weight.dim() == 2:
        return "linear"  # a recurrent op's w_ih/w_hh: a linear over the rows the op computes
    if site.op in CONV_OPS:
        return "conv"
    if site.op == GATHER_OP and site.weight.dim() == 3:
        return "experts"  # [experts, out, in]: a linear per expert
    return None


def layer_inputs(site: WeightSite) -> int:
    """How many inputs each output of the layer reads: the width of its ``H``."""
    if layer_kind(site) == "experts":
        return int(site.weight.shape[1] if site.in_out else site.weight.shape[2])
    return int(site.weight[0].numel())


#: the widest layer (inputs per output) whose ``H`` the Hessian algorithms collect. ``H`` is
#: ``[I, I]`` float64 for every such layer at once during calibration, and shrinking, damping and
#: factoring it copy it a few times: 16384 inputs are 2 GiB a copy. VGG's first classifier layer
#: (25088 inputs: 5 GiB a copy, and hours of factoring on 2 cores) took a 24 GB machine out of
#: memory; a wider layer is left to the codes it is given, with a warning.
MAX_HESSIAN_INPUTS = 16384


def collects_hessian(site: WeightSite, algorithm: str) -> bool:
    """Whether ``algorithm`` collects ``H`` for ``site``: a conv/linear it can express
    (:func:`layer_kind`) no wider than :data:`MAX_HESSIAN_INPUTS` (warned about, by name)."""
    if layer_kind(site) is None:
        return False
    inputs = layer_inputs(site)
    if inputs <= MAX_HESSIAN_INPUTS:
        return True
    logger.warning(
        "%s: %s has %d inputs per output; its Hessian (%d x %d float64, %.1f GiB a copy) is beyond "
        "the %d-input limit, so it keeps the codes it is given (round to nearest, or an earlier "
        "algorithm's choice)",
        algorithm,
        site.label,
        inputs,
        inputs,
        inputs,
        hessian_bytes(inputs) / 2**30,
        MAX_HESSIAN_INPUTS,
    )
    return False


#: prepare warns when the Hessians fed during calibration would take more than this share of the
#: machine's memory: each is allocated at the first batch and held until convert, so a model whose
#: layers are each under :data:`MAX_HESSIAN_INPUTS` can still need more than the machine has in
#: all (a 7B-parameter Llama: 128 distinct layer inputs, 41 GiB of Hessians), and the kernel would kill
#: the process in the first batch, with no word of why.
HESSIAN_MEMORY_SHARE = 0.5
#: copies of the widest ``H`` convert works with beside the calibrated sums (its shrunk mean,
#: GPTQ's reordered copy, its Cholesky factors and their inverse's workspace): measured on
#: torchvision's r3d_18, whose 13824-input layers peaked at the sums plus 6.5 copies
CONVERT_COPIES = 6


def hessian_bytes(columns: int) -> int:
    """Bytes of one layer's ``H``: ``[I, I]`` float64 (:class:`HessianAccumulator`). A grouped
    convolution's is ``G`` times this (one per group); counted as one: its ``I`` is a group's
    ``C / G * prod(kernel)`` inputs, so even its stack is smaller than a dense layer's ``H``."""
    return columns * columns * 8


class HeldHessian(NamedTuple):
    """One set of Hessian sums calibration holds: whose, for which layer, its width, and how many
    ``[I, I]`` it stacks (a mixture-of-experts weight's: one per expert, each as wide as a dense
    layer's; a grouped convolution's counts as one, see :func:`hessian_bytes`)."""

    algorithm: str
    label: str
    inputs: int
    stack: int = 1

    @property
    def nbytes(self) -> int:
        return self.stack * hessian_bytes(self.inputs)


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def hessian_memory_problem(held: Sequence[tuple[Any, ...]], memory: int | None) -> str | None:
    """Why the Hessians ``held`` during calibration (:class:`HeldHessian`, or the tuple of its
    fields: algorithm, layer label, inputs, the stack's depth if not 1), with convert's
    :data:`CONVERT_COPIES` of the widest, may not fit in ``memory`` bytes (more than
    :data:`HESSIAN_MEMORY_SHARE` of it), with what to do; None if they fit or the memory is unknown.

    Only a warning: the same request runs on a larger machine, and the result must not depend on
    the machine it was prepared on.
    """
    if not held:
        return None
    sets = [HeldHessian(*h) for h in held]
    sums = sum(h.nbytes for h in sets)
    working = CONVERT_COPIES * max(h.nbytes for h in sets)
    if memory is None or sums + working <= HESSIAN_MEMORY_SHARE * memory:
        return None
    gib = 2**30
    counts = Counter(h.algorithm for h in sets)
    largest = sorted(sets, key=lambda h: -h.nbytes)[:3]  # ties in graph order
    return (
        f"calibration will hold {sums / gib:.1f} GiB of layer Hessians (float64, inputs x inputs "
        f"per layer: {', '.join(f'{n} for {a}' for a, n in counts.items())}) and convert about "
        f"{working / gib:.1f} GiB more while it works on the widest, more than "
        f"{HESSIAN_MEMORY_SHARE:.0%} of this machine's {memory / gib:.1f} GiB of memory; the largest: "
        + ", ".join(
            f"{h.algorithm} {h.label} ({h.inputs} inputs{f' x {h.stack} experts' if h.stack > 1 else ''}, "
            f"{h.nbytes / gib:.2f} GiB)"
            for h in largest
        )
        + ". An algorithm with sequential=true collects one stage's Hessians at a time, at convert "
        "(quantize: --algorithm-option NAME.sequential=true)"
    )


def conv_patches(site: WeightSite, x: torch.Tensor, grouped: bool = True) -> torch.Tensor | None:
    """The patches a convolution multiplies its weight with, ``[positions, C * prod(kernel)]``; for
    a grouped convolution, each group's, ``[G, positions, C / G * prod(kernel)]``.

    Column ``j`` is what a one-hot kernel ``e_j`` (in the flattened ``[C, *kernel]`` order of
    the weight's rows) reads at every output position, so ``weight.reshape(O, -1) @ patch`` is the
    convolution at that position without bias. The layer itself is run (stride, padding,
    dilation and groups are the op's own): each output channel carries one column of its group's
    patches, so ``I / (O / G)`` runs read them all. None when the input does not fit the weight,
    or the convolution is grouped and ``grouped`` is False (nothing is run then).
    """
    w = site.weight
    if x.dim() == w.dim() - 1:  # unbatched input
        x = x.unsqueeze(0)
    if x.dim() != w.dim() or x.shape[1] % w.shape[1]:
        return None
    groups = x.shape[1] // w.shape[1]
    out_channels = w.shape[0]
    if out_channels % groups or (groups > 1 and not grouped):
        return None
    per_group = out_channels // groups
    columns = int(torch.tensor(w.shape[1:]).prod())
    x = x.to(w.dtype)
    with torch.no_grad():
        base = site.forward(x, torch.zeros_like(w))  # the bias alone
        parts = []
        for start in range(0, columns, per_group):
            # in every group, rows start.. of the identity (never the whole [I, I] identity: a
            # 13824-input conv's would be 0.7 GiB at every batch)
            taken = min(per_group, columns - start)
            chunk = torch.zeros(groups, per_group, columns, dtype=w.dtype)
            chunk[:, torch.arange(taken), torch.arange(start, start + taken)] = 1
            read = site.forward(x, chunk.reshape(out_channels, *w.shape[1:])) - base
            parts.append(read.reshape(read.shape[0], groups, per_group, *read.shape[2:])[:, :, :taken])
        patches = torch.cat(parts, dim=2)  # [N, G, I, *positions]
    patches = patches.movedim(2, -1).movedim(1, 0).reshape(groups, -1, columns)
    return patches[0] if groups == 1 else patches


#: where :class:`LayerHessian` shrinks ``H`` toward its diagonal (:func:`shrunk_toward_diagonal`)
SHRINKAGE_CHOICES = ("singular", "all", "off")
#: ``"singular"`` shrinks layers calibrated on fewer than this many rows per input: ``H`` singular
#: (fewer rows than inputs) or nearly so. With ``n`` rows of ``p`` independent inputs, the sample
#: ``H``'s smallest eigenvalues fall toward ``(1 - sqrt(p / n))^2`` of the true ones (Marchenko and
#: Pastur), under 9 % below two rows per input, and GPTQ moves error into those directions. The
#: patch embedding of a ViT calibrated on 16 images (256 rows, 192 inputs) cost 2.3 dB held out.
NEAR_SINGULAR_ROWS = 2


class HessianSums:
    """The sums one layer input gives (``sum x x^T`` and its row count), or that it cannot give
    them (an input of another width); shared by every :class:`LayerHessian` that reads that input."""

    def __init__(self) -> None:
        self.accumulator: HessianAccumulator | None = None
        self.unsupported = False
        #: counts the changes to the sums (every batch, every merge): a result made at another
        #: count is not what :meth:`LayerHessian.result` would make now
        self.version = 0


class LayerHessian:
    """Collector of ``H = sum x x^T`` for one linear or convolution weight (``[I, I]`` memory).

    ``shrinkage`` says which layers' ``H`` :meth:`result` shrinks toward its diagonal: those
    calibrated on fewer than :data:`NEAR_SINGULAR_ROWS` rows per input (``"singular"``), every
    layer, or none.

    Collectors of the same rows (several algorithms on one layer, or linears reading one input:
    a transformer's query, key and value) need not each hold ``[I, I]``: :meth:`follow` makes one
    read another's sums (:func:`share_hessians`), each keeping its own shrinkage.

    ``grouped``: a grouped convolution's collector sums one ``H`` per group, a stack ``[G, I, I]``
    (:func:`conv_patches`), and a mixture-of-experts weight's one per expert (fed packed rows
    ``[experts, R, I]``), which its algorithm must take (:func:`~.weight_matrix.rows_times`:
    SeqMSE, AdaRound and GPTQ do). Off by default, so an algorithm written for ``[I, I]`` gets
    None for such a layer, as before stacks existed.
    """

    def __init__(self, site: WeightSite, shrinkage: str = "off", grouped: bool = False) -> None:
        if shrinkage not in SHRINKAGE_CHOICES:
            raise OptionError(
                f"LayerHessian's shrinkage must be one of {SHRINKAGE_CHOICES}, got {shrinkage!r}"
            )
        self.site = site
        self.shrinkage = shrinkage
        self.kind = layer_kind(site)
        self.columns = layer_inputs(site)
        self.grouped = grouped
        self.sums = HessianSums()
        #: whether this collector sums its rows (else it reads a leader's: :meth:`follow`)
        self.leads = True
        #: the last tensor :meth:`result` made, the sums' version it was made from and the
        #: shrinkage intensity applied to it (None: not shrunk)
        self._made: tuple[weakref.ref[torch.Tensor], int, float | None] | None = None

    def follow(self, leader: LayerHessian) -> None:
        """Read ``leader``'s sums from now on instead of summing the same rows again: the caller
        feeds both the same inputs (so the sums are the same), and only the leader is fed,
        merged across processes and counted in memory."""
        mine, theirs = (self.kind, self.columns, self.grouped), (leader.kind, leader.columns, leader.grouped)
        if not leader.leads or leader is self or mine != theirs:
            raise AlgorithmError(
                f"the Hessian of {self.site.label} ({self.kind}, {self.columns} inputs, grouped="
                f"{self.grouped}) cannot read that of {leader.site.label} ({leader.kind}, "
                f"{leader.columns} inputs, grouped={leader.grouped}"
                f"{'' if leader.leads else ', itself a follower'})"
            )
        self.sums = leader.sums
        self.leads = False
        self._made = None

    @property
    def hessian(self) -> HessianAccumulator | None:
        return self.sums.accumulator

    @property
    def stack(self) -> int:
        """How many ``[I, I]`` sums this collector holds: one per expert for a mixture-of-experts
        weight, else one (a grouped convolution's narrow ones count as one: :func:`hessian_bytes`)."""
        return int(self.site.weight.shape[0]) if self.kind == "experts" else 1

    @property
    def unsupported(self) -> bool:
        return self.sums.unsupported

    def update(self, x: torch.Tensor) -> None:
        if not self.leads or self.sums.unsupported or self.kind is None:
            return
        if self.kind == "linear":
            rows: torch.Tensor | None = x.reshape(-1, x.shape[-1]) if x.shape[-1] == self.columns else None
        elif self.kind == "experts":
            fits = x.dim() == 3 and x.shape[0] == self.site.weight.shape[0] and x.shape[-1] == self.columns
            rows = x if fits and self.grouped else None
        else:
            rows = conv_patches(self.site, x, self.grouped)
        if rows is None:
            self.sums.unsupported = True
            self.sums.accumulator = None
            self.sums.version += 1
            return
        if self.sums.accumulator is None:
            groups = rows.shape[0] if rows.dim() == 3 else None
            self.sums.accumulator = HessianAccumulator(self.columns, groups)
        self.sums.accumulator.add(rows)
        self.sums.version += 1

    @property
    def rows(self) -> int:
        """The input rows ``H`` was summed over (a linear's samples or tokens, a convolution's
        output positions); fewer than :attr:`columns` leaves ``H`` singular."""
        return 0 if self.hessian is None else self.hessian.rows

    @property
    def shrinks(self) -> bool:
        """Whether :meth:`result` is shrunk toward its diagonal (by :attr:`shrinkage` and rows)."""
        near_singular = 0 < self.rows < NEAR_SINGULAR_ROWS * self.columns
        return self.shrinkage == "all" or (self.shrinkage == "singular" and near_singular)

    def result(self, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mean ``x x^T`` (float64), shrunk where :attr:`shrinks`, or None when the layer never
        ran or is not supported.

        Made in one new ``[I, I]`` (shrunk in place), or written into ``out`` (float64, of the
        result's shape) with none: an algorithm that borrowed the buffer of a result this
        collector made (:meth:`made`) gives it back so, bit for bit as it was, while the sums
        are held beside it (an 8192-input layer's ``H`` is 512 MiB a copy)."""
        hessian = self.hessian
        if hessian is None or hessian.rows == 0:
            return None
        again = out is not None and self.made(out)
        mean = hessian.mean() if out is None else torch.div(hessian.sum, max(hessian.rows, 1), out=out)
        intensity = None
        if self.shrinks:
            if mean.dim() == 2:  # made again: the same intensity, not estimated a second time
                known = self._made[2] if again and self._made is not None else None
                if not again or known is not None:
                    intensity = shrink_toward_diagonal_(mean, hessian.fourth, hessian.rows, known)
            else:
                shrunk = shrunk_toward_diagonal(mean, hessian.fourth, hessian.rows)[0]
                mean = shrunk if out is None else out.copy_(shrunk)
        self._made = (weakref.ref(mean), self.sums.version, intensity)
        return mean

    def readers(self, collectors: Iterable[LayerHessian]) -> int:
        """How many of ``collectors`` read these sums, this one included: the layers whose ``H``
        is this one's (a transformer's q/k/v read one input), the readers
        :class:`~_quantplug.algorithms.weight_matrix.HessianFactors` keeps a factor for."""
        return sum(1 for collector in collectors if collector.sums is self.sums)

    def made(self, tensor: Any) -> bool:
        """Whether ``tensor`` is the last result this collector made and the sums have not changed
        since: :meth:`result` would make it again, bit for bit, so its holder may use its memory
        and restore it with ``result(out=tensor)``."""
        if self._made is None or not isinstance(tensor, torch.Tensor):
            return False
        made, version, _ = self._made
        return made() is tensor and version == self.sums.version

    def release(self, tensor: torch.Tensor) -> None:
        """``tensor``, the last result made, was given up by its holder (its memory holds other
        values now): :meth:`made` is False for it from now on."""
        if self.made(tensor):
            self._made = None

    def discard(self) -> None:
        """Give up the sums (its prepared program was consumed: nothing reads them again); a
        follower's are its leader's, given up for both."""
        self.sums.accumulator = None
        self.sums.version += 1
        self._made = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_made": None}  # a weak reference does not pickle

    def state(self) -> dict[str, Any]:
        """This rank's sums (a follower's are its leader's, merged there: it sends none)."""
        hessian = self.hessian if self.leads else None
        return {
            "unsupported": self.unsupported if self.leads else False,
            "sum": None if hessian is None else hessian.sum,
            "fourth": None if hessian is None else hessian.fourth,
            "rows": 0 if hessian is None else hessian.rows,
        }

    def merge_(self, states: Sequence[dict[str, Any]]) -> None:
        """Every rank's ``sum x x^T`` added in rank order, rows counted; a layer one rank could not
        collect for (an input of another shape) is not collected for, as in one process. A
        follower has nothing to merge: its leader's merge is what it reads."""
        if not self.leads:
            return
        sums = self.sums
        sums.unsupported = any(bool(s["unsupported"]) for s in states)
        sums.version += 1
        total = None if sums.unsupported else sum_in_order([s["sum"] for s in states])
        sums.accumulator = None
        if total is not None:
            merged = HessianAccumulator(self.columns, total.shape[0] if total.dim() == 3 else None)
            merged.sum = total.to(torch.float64)
            fourth = sum_in_order([s["fourth"] for s in states])
            if fourth is not None:  # every rank with a sum has one
                merged.fourth = fourth.to(torch.float64)
            merged.rows = sum(int(s["rows"]) for s in states)
            sums.accumulator = merged


def share_hessians(collectors: Sequence[tuple[Hashable, LayerHessian]]) -> list[LayerHessian]:
    """Make the collectors under one key read the sums of the first under it; the leaders, in order.

    The key says which rows a collector is fed: equal keys must mean the same rows (the same
    layer input, and for a convolution the same layer, whose patches depend on its stride and
    padding). Exact, and every collector keeps its own shrinkage; what it saves is the memory
    and the time of summing the same ``[I, I]`` again.
    """
    leaders: dict[Hashable, LayerHessian] = {}
    for key, collector in collectors:
        leader = leaders.setdefault(key, collector)
        if leader is not collector:
            collector.follow(leader)
    return list(leaders.values())


#: rows a slice of :meth:`SiteMatrix.error` holds at least: a matrix product of fewer rows may take
#: another kernel whose sums round differently, and the error must not depend on the slicing
ERROR_SLICE_ROWS = 256
#: elements of a slice of :meth:`SiteMatrix.error` (8 MiB of float64); matrices under two
#: slices are weighed whole
ERROR_SLICE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class SiteMatrix:
    """A weight, its encoding and its grid as ``[O, I]`` matrices (float64; see
    :func:`site_matrix` for its ``compact`` form)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    grid: IntegerGrid
    #: (rows, columns) sharing one scale
    groups: tuple[int, int]
    shape: tuple[int, ...]
    #: a mixture-of-experts weight stored ``[E, I, O]``: its matrix is that of its transpose
    in_out: bool = False

    def _as_weight(self, matrix: torch.Tensor) -> torch.Tensor:
        if self.in_out:
            e, i, o = self.shape
            return matrix.reshape(e, o, i).transpose(1, 2).contiguous()
        return from_matrix(matrix, self.shape)

    def matrix_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the weight's shape (codes, a candidate weight) as this view's matrix."""
        return _expert_rows(tensor, True) if self.in_out else tensor.reshape(self.weight.shape)

    def codes(self, matrix: torch.Tensor) -> torch.Tensor:
        """Codes of the matrix back in the weight's shape, in the grid's
        :attr:`~.weight_matrix.IntegerGrid.code_dtype`, converted a slice of rows at a time."""
        dtype = self.grid.code_dtype
        if self.in_out:
            return self._as_weight(matrix.round()).to(dtype)
        out = torch.empty(matrix.shape, dtype=dtype)
        # tiles of rows and columns: GPTQ's codes are a transposed view, whose slices of rows
        # were rounded into fresh 33 MiB temporaries read across the grain (a 32000-row lm_head:
        # 94 ms, 48 ms in tiles); elementwise, so the same codes whatever the tiling
        for rows, columns in matrix_tiles(matrix.shape[0], matrix.shape[1]):
            out[rows, columns].copy_(matrix[rows, columns].round())
        return from_matrix(out, self.shape)

    def error(
        self,
        codes: torch.Tensor,
        hessian: torch.Tensor,
        scale: torch.Tensor | None = None,
        zero_point: torch.Tensor | None = None,
        *,
        weight: torch.Tensor | None = None,
    ) -> float:
        """The output error ``tr(D H D^T)`` of codes (an ``[O, I]`` matrix, any dtype) on this
        encoding, or on ``scale``/``zero_point`` (broadcastable to ``[O, I]``) where another one is
        weighed; ``weight`` reads the weight from another matrix of the same values (the float32
        weight itself, where GPTQ used this one's memory).

        A large matrix is weighed a slice of rows at a time (:data:`ERROR_SLICE_ROWS` at least),
        into one error per row summed as before: its float64 ``D`` and ``D H`` were four copies
        of the weight's size at once (2 GiB for an 8192 x 8192 layer)."""
        scale = self.scale if scale is None else scale
        zero_point = self.zero_point if zero_point is None else zero_point
        weight = self.weight if weight is None else weight
        h = hessian.to(torch.float64)
        out = codes.shape[0]
        step = max(ERROR_SLICE_ROWS, ERROR_SLICE_ELEMENTS // max(1, codes.shape[1]))
        if h.dim() == 3 or out < 2 * step:
            delta = weight.to(torch.float64) - (codes.to(torch.float64) - zero_point) * scale
            return float(output_error(delta, h).sum())
        errors = torch.empty(out, dtype=torch.float64)
        starts = list(range(0, out - step, step))  # the last slice takes the rest: never a thin one
        for start, stop in zip(starts, [*starts[1:], out]):
            part = slice(start, stop)
            s = scale[part] if scale.shape[0] > 1 else scale
            z = zero_point[part] if zero_point.shape[0] > 1 else zero_point
            # in place, the values of the expression above: two temporaries of a slice
            delta = weight[part].to(torch.float64, copy=True)
            delta.sub_(codes[part].to(torch.float64, copy=True).sub_(z).mul_(s))
            errors[part] = rows_times(delta, h).mul_(delta).sum(dim=1)
        return float(errors.sum())

    def weight_of(self, matrix: torch.Tensor) -> torch.Tensor:
        """A float matrix back in the weight's shape (float32)."""
        return self._as_weight(matrix).to(torch.float32)


def site_matrix(site: WeightSite, grid: WeightGrid, compact: bool = False) -> SiteMatrix | None:
    """The matrix view of ``site``'s weight on ``grid`` (None when the grid is not row-contiguous).

    ``compact``: the weight is a view of the site's own tensor (its dtype, no float64 copy) and a
    per-tensor or per-channel encoding stays ``[1, 1]`` or ``[O, 1]``, broadcast where it is used,
    not expanded to ``[O, I]``: three float64 copies of the weight's size less, for a caller that
    converts the weight itself where it needs float64 and only broadcasts the encoding (GPTQ).

    Output channels must be dim 0 (per-channel axis 0; blocks of one output channel each):
    what linear and convolution weights use on every backend quantplug knows. A
    mixture-of-experts weight ``[E, O, I]`` is the matrix ``[E * O, I]`` (:func:`_experts_groups`).
    """
    shape = tuple(int(d) for d in site.weight.shape)
    if layer_kind(site) == "experts":
        return _experts_matrix(site, grid, shape)
    if grid.granularity == "channel" and (grid.ch_axis or 0) % len(shape) != 0:
        return None
    if grid.granularity == "block":
        groups = column_groups(shape, 0, grid.block_size)
    elif grid.granularity == "channel":
        groups = column_groups(shape, 0, None)
    else:
        groups = column_groups(shape, None, None)
    if groups is None:
        return None
    if compact and grid.granularity in ("tensor", "channel"):

        def compacted(param: torch.Tensor) -> torch.Tensor:
            flat = param.to(torch.float64).reshape(-1)
            return flat[:1].reshape(1, 1) if grid.granularity == "tensor" else flat.reshape(shape[0], 1)

        scale, zero_point = compacted(grid.scale), compacted(grid.zero_point)
    else:
        scale = to_matrix(grid.expand(grid.scale.to(torch.float64), shape).contiguous())
        zero_point = to_matrix(grid.expand(grid.zero_point.to(torch.float64), shape).contiguous())
    return SiteMatrix(
        weight=to_matrix(site.weight.detach() if compact else site.weight.detach().to(torch.float64)),
        scale=scale,
        zero_point=zero_point,
        grid=IntegerGrid(grid.quant_min, grid.quant_max),
        groups=groups,
        shape=shape,
    )


def _experts_groups(shape: tuple[int, ...], grid: WeightGrid, in_out: bool) -> tuple[int, int] | None:
    """``(rows, columns)`` sharing one scale in the ``[E * O, I]`` matrix of an ``[E, O, I]``
    weight (``[E, I, O]`` if ``in_out``): one scale for all; one per expert (channels on axis 0);
    blocks inside one expert's rows (``(1, r, c)``, ``r`` dividing ``O``: the reference backend's
    ``(1, 1, group)``, ``(1, group, 1)`` when ``in_out``). Other grids (a scale shared across
    experts) give None."""
    experts, out, inputs = (shape[0], shape[2], shape[1]) if in_out else shape
    if grid.granularity == "tensor":
        return (experts * out, inputs)
    if grid.granularity == "channel":
        return (out, inputs) if (grid.ch_axis or 0) % 3 == 0 else None
    block = [int(b) if int(b) > 0 else d for b, d in zip(grid.block_size or (), shape)]
    if len(block) != 3 or block[0] != 1:
        return None
    rows, columns = (block[2], block[1]) if in_out else (block[1], block[2])
    return None if out % rows or inputs % columns else (rows, columns)


def _expert_rows(tensor: torch.Tensor, in_out: bool) -> torch.Tensor:
    """An ``[E, O, I]`` tensor (``[E, I, O]`` if ``in_out``) as ``[E * O, I]``: expert ``e``'s rows
    are row block ``e``, as the experts multiply them."""
    rows = tensor.transpose(1, 2) if in_out else tensor
    return rows.reshape(-1, rows.shape[2])


def _experts_matrix(site: WeightSite, grid: WeightGrid, shape: tuple[int, ...]) -> SiteMatrix | None:
    groups = _experts_groups(shape, grid, site.in_out)
    if groups is None:
        return None
    return SiteMatrix(
        weight=_expert_rows(site.weight.detach().to(torch.float64), site.in_out),
        scale=_expert_rows(grid.expand(grid.scale.to(torch.float64), shape), site.in_out),
        zero_point=_expert_rows(grid.expand(grid.zero_point.to(torch.float64), shape), site.in_out),
        grid=IntegerGrid(grid.quant_min, grid.quant_max),
        groups=groups,
        shape=shape,
        in_out=site.in_out,
    )


class SiteEncoder:
    """The encoding the backend's own observer gives a candidate weight matrix, expanded to
    ``[O, I]``: how SeqMSE and GPTQ's scale search try encodings without computing a scale
    themselves (whatever they choose, the backend could have produced: its symmetry, eps,
    LPBQ's 4-bit scale lattice)."""

    def __init__(self, matrix: SiteMatrix, grid: WeightGrid) -> None:
        self.matrix = matrix
        self.grid = grid

    def __call__(self, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._expanded(self.grid.observe(self.matrix.weight_of(candidate)))

    def _expanded(self, found: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero_point = found
        # broadcast views where the layout allows (per tensor, per channel): no [O, I] copies
        return (
            self.matrix.matrix_of(self.grid.expand(scale.to(torch.float64), self.matrix.shape)),
            self.matrix.matrix_of(self.grid.expand(zero_point.to(torch.float64), self.matrix.shape)),
        )

    def of_extremes(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What calling this on a candidate gives, from the candidate's min and max per row
        group (``[O // rows]`` each, one column group: per channel), without the candidate
        (the observer's ``extremes``: ``weight_choice.SiteObserver.extremes``, per channel). None:
        not known without it (then call this)."""
        matrix, grid = self.matrix, self.grid
        extremes = getattr(grid._observe, "extremes", None)
        if (
            extremes is None
            or grid.granularity != "channel"
            or matrix.in_out
            or matrix.groups[1] != matrix.weight.shape[1]
            or low.numel() != matrix.shape[0]
        ):
            return None
        found = extremes(low.reshape(-1), high.reshape(-1))
        return None if found is None else self._expanded(found)


def site_encoder(matrix: SiteMatrix, grid: WeightGrid) -> SiteEncoder:
    """:class:`SiteEncoder` of a site's matrix on its grid."""
    return SiteEncoder(matrix, grid)


def hessian_of(collected: Any, matrix: SiteMatrix) -> torch.Tensor | None:
    """The collected Hessian if it fits the matrix, ``[I, I]`` or one per row block ``[G, I, I]``
    (None: no data, keep the default)."""
    if not isinstance(collected, torch.Tensor) or collected.dim() not in (2, 3):
        return None
    out, inputs = matrix.weight.shape
    if collected.shape[-2:] != (inputs, inputs) or (collected.dim() == 3 and out % collected.shape[0]):
        return None
    # only zeros reached it (an initial state)
    if not float(torch.diagonal(collected, dim1=-2, dim2=-1).sum()) > 0:
        return None
    return collected


def matrix_and_hessian(
    site: WeightSite, grid: WeightGrid, collected: Any, compact: bool = False
) -> tuple[SiteMatrix, torch.Tensor] | None:
    """What a Hessian-based choice needs: the matrix view and its Hessian (None: keep the default).

    Without collected data (a site the algorithm made no collector for: an embedding table) the
    matrix view, float64 copies of the weight and its encoding, is not built at all: for a 1M-row
    table it cost 1.4 GB to say "keep the default"."""
    if not isinstance(collected, torch.Tensor):
        return None
    matrix = site_matrix(site, grid, compact)
    hessian = None if matrix is None else hessian_of(collected, matrix)
    return None if matrix is None or hessian is None else (matrix, hessian)


def improves(matrix: SiteMatrix, hessian: torch.Tensor, new: torch.Tensor, current: torch.Tensor) -> bool:
    """Whether codes ``new`` (an ``[O, I]`` matrix) give no more output error ``tr(D H D^T)`` than
    the ``current`` codes (the weight's shape): the guard that keeps a rounding algorithm from
    undoing a better choice (round-to-nearest, or an earlier algorithm's) on its own objective."""
    return matrix.error(new, hessian) <= matrix.error(matrix.matrix_of(current.to(torch.float64)), hessian)


#: whether SeqMSE, AdaRound and GPTQ take their layers' inputs from the partly quantized model
#: (:mod:`_quantplug.algorithms.sequential`) by default
SEQUENTIAL = False
#: the option of SeqMSE, AdaRound and GPTQ that chooses it
SEQUENTIAL_OPTION = AlgorithmOption(
    "sequential",
    "bool",
    SEQUENTIAL,
    "layer inputs from the model quantized so far (as AIMET, GPTQ); false: float inputs",
)


def sequential_option() -> Any:
    """:data:`SEQUENTIAL_OPTION` as a field of an algorithm: ``sequential: bool = sequential_option()``."""
    return option(SEQUENTIAL_OPTION.default, SEQUENTIAL_OPTION.help)
