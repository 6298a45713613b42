"""The algorithm protocol: what an accuracy algorithm may do, and what quantplug hands it.

An algorithm is an object (usually an :class:`Algorithm` subclass) with up to three hooks, each
optional, each called by the core at one step of ``prepare -> calibrate -> convert``:

1. :meth:`Algorithm.transform_program` -- before annotation, on quantplug's private copy of the
   float program (batch norms already folded). Rewrites weights or inserts ops so that the float
   function stays the same but quantizes better (cross-layer equalization, SmoothQuant). It gets
   the calibration batches the user gave (``prepare(..., algorithms=Algorithms([...], calibration=...))``).
2. :meth:`Algorithm.collector` -- at prepare, once per :class:`WeightSite` (a quantized constant
   weight of a conv/linear-like op, or of a recurrent op: an LSTM's ``weight_ih``/``weight_hh`` is
   a linear layer over rows quantplug computes): returns a :class:`Collector` that sees the layer's input
   activation on every calibration batch and keeps a bounded summary of it (a running mean, a
   Hessian ``X^T X``, a capped sample of rows), never the whole data set. With its optional merge
   hook (:class:`MergeableCollector`) it takes part in calibration on several processes.
3. :meth:`Algorithm.choose_weight` -- at convert, once per weight site, after the backend's
   observer has given the weight's default encoding: returns a :class:`WeightChoice` (integer
   codes and/or scales within the backend's :class:`WeightGrid`, optionally a bias correction),
   or None to keep what it was given.

The core never lets an algorithm leave the backend's grid: codes are checked to lie in
``[quant_min, quant_max]`` with the weight's shape; new scales must keep the granularity (one per
tensor / channel / block, the same shape), stay positive and finite, keep symmetric grids
symmetric, and be scales the backend's own observer can produce (``WeightGrid.observe`` is the
way to get one: e.g. observe a clipped weight); weights sharing one encoding with other weights
keep it (codes only). Violations raise :class:`~_quantplug.errors.AlgorithmError` naming the
algorithm, the weight and the rule.

Algorithms run in the order the user lists them; at convert each sees the encoding and codes the
previous ones chose (``grid.scale``, ``codes``), so ``["seq_mse", "adaround", "bias_correction"]``
picks scales, then rounding, then corrects the bias of the result.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import Field, dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch.fx import GraphModule

from _quantplug.algorithms.option_checks import AlgorithmOption, option_values
from _quantplug.algorithms.weight_matrix import code_dtype
from _quantplug.annotation.spec_view import spec_range
from _quantplug.errors import CalibrationError
from _quantplug.graph.attrs import put_attr
from _quantplug.observers.per_block import resolve_block_size
from _quantplug.plugins.contract import OPTION_TYPES

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**kwargs: Any) -> Any:  # what type checkers read; nothing at run time
        return lambda decorated: decorated


@dataclass(frozen=True)
class AlgorithmInfo:
    """What an algorithm is, for ``quantplug algorithms`` and ``list_algorithms()``."""

    name: str
    description: str
    paper: str = ""
    options: tuple[AlgorithmOption, ...] = ()


@runtime_checkable
class Collector(Protocol):
    """Bounded statistics of one layer's input over the calibration batches.

    ``update`` is called with the layer's input activation (what the weighted op receives during
    calibration) on every batch; ``result`` once, at convert. Memory must not grow with the number
    of batches beyond a cap the collector chooses.
    """

    def update(self, x: torch.Tensor) -> None: ...

    def result(self) -> Any: ...


@runtime_checkable
class MergeableCollector(Collector, Protocol):
    """A :class:`Collector` with the optional merge hook: it takes part in distributed calibration.

    Calibrating on several processes (``quantplug.distributed.sync_observers``, ``quantplug
    quantize --nproc N``, torchrun) gives each process's collectors its share of the batches.
    ``sync_observers`` gathers every rank's :meth:`state` and calls :meth:`merge_` on every rank
    with all of them, in rank order, so each rank's collector ends up standing for every batch
    and every rank converts the same program. Gathered, not reduced by the backend: the merge
    is this method's, in an order that does not depend on nccl or gloo.

    A collector without these two methods is refused there with a
    :class:`~_quantplug.errors.CollectorMergeError` naming the algorithm, the collector's class and
    this fix, before any rank converts with only its own share of the data (``quantize --nproc``
    refuses before calibrating). Collectors that never see calibration data (those of sequential
    algorithms, of weights without a layer input) are not merged and need no hook.

    Rules for a merge (see ``quantplug/algorithms/README.md``, "Collectors across processes"):
    make it a function of ``states`` alone (every rank computes it from the same list and must
    get the same bits); make it the one-process result where the statistic allows (sums, counts,
    extremes), otherwise a statistic as valid (a reservoir sample: a uniform sample of every
    rank's rows, drawn with a seeded generator); keep memory bounded.
    """

    def state(self) -> Any:
        """What other processes need to merge this collector: tensors, numbers, strings, None and
        lists/tuples/dicts of them (pickled between processes; tensors travel on the CPU)."""
        ...

    def merge_(self, states: Sequence[Any]) -> None:
        """Become the merge of ``states``: every rank's :meth:`state`, in rank order, this rank's
        among them (so this collector's own statistics are replaced, not added to)."""
        ...


@dataclass(frozen=True)
class WeightSite:
    """One quantized constant weight and the op that consumes it.

    Attributes:
        name: the weight's attribute path in the program (``"layers.0.fc1.weight"``).
        node: the consuming node's name; ``op`` its target (``"aten.linear.default"``).
        weight: the float weight (after any transform).
        bias: the float bias the op adds (None when it has none or it is not a constant).
        group: the weight's sharing group; ``shared_with`` the other weights in it (an encoding
            shared by several weights must stay shared: such sites accept codes only).
        input_index: which argument of the op is the activation input a collector sees (None
            when the op is not one quantplug can re-run on a layer input, e.g. an embedding's
            lookup; and for a recurrent op's ``weight_ih``/``weight_hh``, whose collectors see
            the rows the op computes inside: :mod:`_quantplug.graph.recurrent`; and for a
            mixture-of-experts weight ``[experts, out, in]``, whose ``node`` is the gather
            ``W[ids]`` (``op`` ``"aten.index.Tensor"``) and ``tied`` the ``bmm`` reading it: its
            collectors see each expert's rows packed, ``[experts, R, in]`` with zero rows after
            each expert's own, and :meth:`forward` takes that layout:
            :mod:`_quantplug.algorithms.experts`).
        in_out: a mixture-of-experts weight stored ``[experts, in, out]`` (read as
            ``bmm(x, W[ids])``), whose experts are its slices' transposes.
        folded_from: the weight the user wrote, when this one is it with a batch norm folded in
            (quantplug's name for such a weight means nothing to the user).
        tied: the other nodes that multiply this weight as the same layer (same op, same bias and
            arguments): a recurrence unrolled over time steps, layers shared across depth. Their
            inputs are rows of this layer too, so collectors see every node's input, not ``node``'s
            alone; one encoding and one set of codes serve them all.
    """

    name: str
    node: str
    op: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    group: int
    shared_with: tuple[str, ...] = ()
    input_index: int | None = None
    folded_from: str | None = None
    tied: tuple[str, ...] = ()
    in_out: bool = False
    _call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def label(self) -> str:
        """The weight as messages name it: as the user wrote it."""
        return f"{self.folded_from} (with its batch norm)" if self.folded_from else self.name

    @property
    def layer_nodes(self) -> tuple[str, ...]:
        """Every node whose input is a row of this layer: ``node`` and the ``tied`` ones."""
        return (self.node, *self.tied)

    @property
    def has_layer(self) -> bool:
        """Whether :meth:`forward` can re-run the op (conv/linear-like ops with constant arguments;
        for a recurrent op's ``weight_ih``/``weight_hh``, the linear map it applies to each step's
        row, its bias included), and so whether collectors are fed a layer input."""
        return self._call is not None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The op's output for input ``x`` with ``weight`` (default: the float weight), bias included."""
        if self._call is None:
            raise TypeError(f"weight {self.name} feeds {self.op}, which quantplug cannot re-run on an input")
        return self._call(x, self.weight if weight is None else weight)


@dataclass(frozen=True)
class WeightGrid:
    """The backend's grid for one weight, with the encoding chosen so far.

    Attributes come from the weight's QuantizationSpec (``quant_min``/``quant_max``, ``dtype``,
    ``qscheme``, ``ch_axis``, ``block_size``) and its observer (``scale``/``zero_point``, in the
    compact shape the backend stores: one value per tensor, per channel, or a grid of blocks).
    ``granularity`` is ``"tensor"``, ``"channel"`` or ``"block"``.
    """

    quant_min: int
    quant_max: int
    dtype: torch.dtype
    qscheme: Any
    granularity: str
    scale: torch.Tensor
    zero_point: torch.Tensor
    symmetric: bool
    ch_axis: int | None = None
    block_size: tuple[int, ...] | None = None
    _observe: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, repr=False, compare=False
    )

    def observe(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` the backend's weight observer gives for ``tensor``.

        The legal way to choose another scale: observe a clipped or rescaled weight and the
        backend applies its own rules (symmetry, eps, LPBQ's 4-bit scale lattice).
        """
        if self._observe is None:
            raise TypeError("this grid has no observer (built by hand)")
        return self._observe(tensor)

    def expand(self, param: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """A scale or zero point stretched over a weight of ``shape`` (broadcastable to it)."""
        if self.granularity == "tensor":
            return param.reshape(-1)[0].expand(tuple(shape))
        if self.granularity == "channel":
            axis = (self.ch_axis or 0) % len(shape)
            view = [1] * len(shape)
            view[axis] = -1
            return param.reshape(view).expand(tuple(shape))
        block = resolve_block_size(self.block_size or (), shape)
        out = param
        for dim, size in enumerate(block):
            out = out.repeat_interleave(size, dim=dim) if size > 1 else out
        return out.reshape(tuple(shape))

    def quantize(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        zero_point: torch.Tensor | None = None,
        *,
        rounding: Callable[[torch.Tensor], torch.Tensor] = torch.round,
        dtype: torch.dtype = torch.int64,
    ) -> torch.Tensor:
        """Integer codes (int64, or ``dtype``: :attr:`code_dtype` holds them in the least memory)
        of ``weight`` on this grid: ``clamp(rounding(w / s) + z)``.

        Rounded to nearest (the default ``rounding``), a large weight is computed in slices of
        rows into the codes: its float intermediates would otherwise be four copies of it (a
        1M-row embedding, which convert offers every algorithm, cost 1.9 GB at its peak)."""
        s = self.expand(self.scale if scale is None else scale, weight.shape).to(torch.float32)
        z = self.expand(self.zero_point if zero_point is None else zero_point, weight.shape)
        if rounding is not torch.round or weight.dim() == 0:
            codes = rounding(weight.to(torch.float32) / s) + z.to(torch.float32)
            return codes.clamp(self.quant_min, self.quant_max).to(dtype)
        # a slice at a time in one reused float32 buffer, the same operations in place (each
        # element's value as the whole weight's expression gives it): four new temporaries of
        # the weight's size per call were fresh memory to fault in (118k page faults in GPTQ's
        # convert of a 110M Llama)
        out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        rows = max(1, min(_SLICE, _BUFFER) // max(1, weight[0].numel()))
        shape = (min(rows, weight.shape[0]), *weight.shape[1:])
        buffer = torch.empty(shape, dtype=torch.float32, device=weight.device)
        for start in range(0, weight.shape[0], rows):
            part = slice(start, start + rows)
            piece = weight[part]
            codes = torch.div(piece.to(torch.float32), s[part], out=buffer[: piece.shape[0]])
            codes.round_().add_(z[part].to(torch.float32))
            out[part] = codes.clamp_(self.quant_min, self.quant_max)
        return out

    @property
    def code_dtype(self) -> torch.dtype:
        """The narrowest signed integer dtype holding this grid's codes (int8 for an 8-bit
        grid): the dtype of the codes :meth:`Algorithm.choose_weight` is given."""
        return code_dtype(self.quant_min, self.quant_max)

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The float weight that ``codes`` stand for: ``(q - z) * s`` (float32, made in place in
        one buffer: a large weight's intermediates were three copies of it)."""
        s = self.expand(self.scale if scale is None else scale, codes.shape).to(torch.float32)
        z = self.expand(self.zero_point if zero_point is None else zero_point, codes.shape)
        return codes.to(torch.float32, copy=True).sub_(z.to(torch.float32)).mul_(s)

    def rounded(self, weight: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(weight))`` in ``weight``'s dtype: the same values (the same float
        operations in the same order; codes are whole numbers, exact in float32), computed in one
        float32 buffer with the scale and zero point broadcast, not stretched over the weight. The
        quantized simulation reads every weight no algorithm changed this way, at each read and
        never stored: a 1M-row embedding costs one transient copy, not a stored one plus five."""
        s = self._broadcastable(self.scale, weight.shape).to(torch.float32)
        z = self._broadcastable(self.zero_point, weight.shape).to(torch.float32)
        out = weight.to(torch.float32, copy=True)
        out.div_(s).round_().add_(z).clamp_(self.quant_min, self.quant_max).sub_(z).mul_(s)
        return out.to(weight.dtype)

    def _broadcastable(self, param: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """:meth:`expand` without the stretching where broadcasting does it (per tensor, per channel)."""
        if self.granularity == "tensor":
            return param.reshape(-1)[0]
        if self.granularity == "channel":
            view = [1] * len(shape)
            view[(self.ch_axis or 0) % len(shape)] = -1
            return param.reshape(view)
        return self.expand(param, shape)

    def with_encoding(self, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> WeightGrid:
        """The same grid with another scale (and zero point)."""
        return replace(self, scale=scale, zero_point=self.zero_point if zero_point is None else zero_point)


#: elements of a weight :meth:`WeightGrid.quantize` rounds at once (4M: 16 MiB of float32)
_SLICE = 1 << 22
#: at most this many (1 MiB of float32): a buffer the allocator reuses, in cache
_BUFFER = 1 << 18


@dataclass(frozen=True)
class WeightChoice:
    """What :meth:`Algorithm.choose_weight` returns; every field is optional.

    Attributes:
        codes: integer codes with the weight's shape, within ``[quant_min, quant_max]``.
        scale: new scales in the grid's compact shape (requires ``codes`` or re-rounds to nearest).
        zero_point: new zero points (asymmetric grids only), same shape as ``scale``.
        bias_delta: a float correction added to the op's bias (one value per output channel),
            before the bias itself is quantized; needs an op with a constant bias.
    """

    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    bias_delta: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerInputs:
    """``collected`` for a sequential algorithm that also collects during calibration.

    An algorithm with ``sequential = True`` gets, by default, the result of a collector fed by
    the sequential pass (the layer's inputs in the model quantized so far). With
    ``float_inputs = True`` as well, its collectors are also fed during calibration (the float
    model's inputs) and ``choose_weight`` receives both results here (empirical bias correction
    compares the float output mean with the quantized one).
    """

    float: Any
    quantized: Any


@dataclass
class TransformContext:
    """What :meth:`Algorithm.transform_program` gets besides the program.

    ``calibration``: the batches given as ``Algorithms([...], calibration=...)`` (tuples of the
    program's positional inputs), or None. Transforms must write new tensors with
    :meth:`set_constant` (never in place: the program's tensors may be the caller's).
    """

    algorithm: str
    calibration: Sequence[tuple[Any, ...]] | None = None
    #: the quantizer the program is prepared with (read its configs; never call annotate on it)
    quantizer: Any = None

    def global_bits(self) -> tuple[int | None, int | None]:
        """``(activation bits, weight bits)`` of the quantizer's global config (None: float or unknown).

        Read from the specs' ranges, so it works for any backend whose quantizer exposes a
        ``global_config`` (quantplug's do); transforms use it to simulate the grids they prepare for.
        """
        config = getattr(self.quantizer, "global_config", None)
        return _bits(getattr(config, "input_activation", None)), _bits(getattr(config, "weight", None))

    def batches(self) -> Iterator[tuple[Any, ...]]:
        """The calibration batches; a typed error when the algorithm needs them and none were given."""
        if not self.calibration:
            raise CalibrationError(
                f"algorithm {self.algorithm!r} needs calibration data before annotation; pass "
                "prepare(program, quantizer, algorithms=quantplug.Algorithms([...], "
                "calibration=[batch, ...])) (each batch a tuple of the program's inputs)"
            )
        for batch in self.calibration:
            yield batch if isinstance(batch, tuple) else (batch,)

    @staticmethod
    def set_constant(gm: GraphModule, target: str, value: torch.Tensor) -> None:
        """Replace the tensor at attribute path ``target`` with ``value`` (a new tensor)."""
        new = value.detach().clone()
        old = put_attr(gm, target, new)
        if isinstance(old, torch.nn.Parameter):  # stays a parameter (sharing new's storage)
            put_attr(gm, target, torch.nn.Parameter(new, old.requires_grad))


def _bits(spec: Any) -> int | None:
    if spec is None or not hasattr(spec, "dtype"):
        return None
    try:
        qmin, qmax = spec_range(spec)
    except Exception:
        return None
    return max(1, (qmax - qmin).bit_length())


class Algorithm:
    """Base class of accuracy algorithms; override the hooks you need (all default to no-ops).

    Class attributes describe the algorithm (``name``, ``description``, ``paper``, ``options``);
    constructor keywords are its options. Instances are configured objects: pass one to
    ``prepare(..., algorithms=[MyAlgorithm(alpha=0.6)])`` or register the class by name.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    options: ClassVar[tuple[AlgorithmOption, ...]] = ()
    #: collectors fed at convert with each layer's inputs in the model quantized so far (earlier
    #: layers as chosen, activations quantized) instead of during float calibration
    #: (:mod:`_quantplug.algorithms.sequential`)
    sequential: bool = False
    #: with ``sequential``: also feed collectors during calibration; ``collected`` is then a
    #: :class:`LayerInputs` with both results
    float_inputs: bool = False

    @classmethod
    def info(cls) -> AlgorithmInfo:
        return AlgorithmInfo(cls.name, cls.description, cls.paper, cls.options)

    def transform_program(self, gm: GraphModule, context: TransformContext) -> GraphModule | None:
        """Rewrite the float program before annotation (in place or return a new GraphModule).

        Must keep the program's float function (up to rounding) and write weights through
        ``context.set_constant``. Called on quantplug's private copy, batch norms folded.
        """
        return None

    def collector(self, site: WeightSite) -> Collector | None:
        """A fresh collector for one weight site, or None when this algorithm needs no data there."""
        return None

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        """The weight's codes/scales on ``grid``, given the current ``codes`` and what was collected.

        ``codes`` are of :attr:`WeightGrid.code_dtype`, the narrowest signed integer dtype holding
        the grid's range (int8 for an 8-bit grid; widen them before arithmetic that could leave
        it). ``collected`` is this algorithm's collector's ``result()`` (None without one, or when
        the layer never ran).
        """
        return None

    def __repr__(self) -> str:
        shown = ", ".join(f"{o.name}={getattr(self, o.name, o.default)!r}" for o in self.options)
        return f"{type(self).__name__}({shown})"


def algorithm_name(algorithm: Any) -> str:
    """An algorithm's name as messages show it: its ``name``, else its class's."""
    return str(getattr(algorithm, "name", "") or type(algorithm).__name__)


def is_sequential(algorithm: Any) -> bool:
    """Whether ``algorithm`` wants its layers' inputs from the partly quantized model (see
    :mod:`_quantplug.algorithms.sequential`) rather than from float calibration."""
    return bool(getattr(algorithm, "sequential", False))


#: the metadata key marking a dataclass field as an algorithm option (:func:`option`)
_OPTION = "quantplug_algorithm_option"

_AlgorithmClass = TypeVar("_AlgorithmClass", bound="type[Algorithm]")


def option(
    default: Any,
    help: str = "",
    *,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """An algorithm option declared as a field of the algorithm (see :func:`options_as_fields`)."""
    declared = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum}
    return field(default=default, metadata={_OPTION: declared})


@dataclass_transform(field_specifiers=(option,))
def options_as_fields(cls: _AlgorithmClass) -> _AlgorithmClass:
    """An :class:`Algorithm` subclass made a dataclass whose :func:`option` fields are its options.

    Each option is one line, a field: its name and type are the constructor keyword's, its default,
    help and bounds are :func:`option`'s. ``cls.options`` (what listings, metadata files and the
    command line read) lists them in order, and constructing the algorithm checks and converts the
    values given (:func:`option_values`) before the class's own ``__post_init__`` runs.
    """
    annotations = inspect.get_annotations(cls)
    declared = []
    for name, value in cls.__dict__.items():
        if isinstance(value, Field) and _OPTION in value.metadata:
            kind = annotations[name] if isinstance(annotations[name], str) else annotations[name].__name__
            if kind not in OPTION_TYPES:
                raise TypeError(
                    f"option {name!r} of {cls.__name__} is a {kind}; options are {', '.join(OPTION_TYPES)}"
                )
            declared.append(AlgorithmOption(name, kind, value.default, **value.metadata[_OPTION]))
    own_post_init = cls.__dict__.get("__post_init__")

    def __post_init__(self: Any) -> None:
        given = {o.name: getattr(self, o.name) for o in self.options}
        for name, value in option_values(self.name, self.options, given).items():
            setattr(self, name, value)
        if own_post_init is not None:
            own_post_init(self)

    cls.options = tuple(declared)
    setattr(cls, "__post_init__", __post_init__)  # noqa: B010 (the base class declares none)
    dataclass(repr=False, eq=False)(cls)  # in place; Algorithm's repr, and equal only to itself
    return cls
