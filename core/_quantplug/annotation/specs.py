"""The annotation vocabulary of PyTorch 2 export quantization.

Names and fields follow torchao's ``quantization.pt2e.quantizer`` so annotators written for PT2E
port by changing imports. Differences, each deliberate:

* specs are immutable values (frozen, hashable): a config shared by many nodes cannot be mutated
  per node, which is the root of ExecuTorch's leaking ``block_size`` bug;
* ``observer_or_fake_quant_ctr`` is optional: the core picks a min-max observer (per-tensor or
  per-channel from ``qscheme``) when it is omitted;
* 2/4/16-bit grids are real dtypes (``torch.int4``, ``torch.uint16``), not int32 plus a range;
* ``ch_axis`` may be negative, and ``block_size`` describes per-block (LPBQ) weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch.fx import Node

from _quantplug.annotation.dtypes import resolve_range
from _quantplug.errors import AnnotationError

Q_ANNOTATION_KEY = "quantization_annotation"

#: An input edge ``(producer, consumer)`` or a node (meaning that node's output).
EdgeOrNode = Union[tuple[Node, Node], Node]

ObserverConstructor = Callable[..., Any]

PER_CHANNEL_QSCHEMES = (torch.per_channel_affine, torch.per_channel_symmetric)
SYMMETRIC_QSCHEMES = (torch.per_tensor_symmetric, torch.per_channel_symmetric)


class QuantizationSpecBase:
    """Common base of the four spec kinds (kept for ``isinstance`` checks ported from PT2E)."""


@dataclass(frozen=True)
class QuantizationSpec(QuantizationSpecBase):
    """How one tensor is quantized: its grid, scheme and the observer that measures it."""

    dtype: torch.dtype
    observer_or_fake_quant_ctr: ObserverConstructor | None = None
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    ch_axis: int | None = None
    is_dynamic: bool = False
    #: per-block quantization: block shape over the tensor (e.g. ``(1, 64)`` for a linear weight).
    block_size: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        resolve_range(self.dtype, self.quant_min, self.quant_max)
        if self.is_dynamic and self.qscheme in PER_CHANNEL_QSCHEMES:
            # dynamic per-channel means per-token (one scale per row of the last dimension)
            if self.dtype != torch.int8:
                raise AnnotationError(
                    f"dynamic per-token quantization supports dtype torch.int8 only, got {self.dtype}"
                )
        elif self.qscheme in PER_CHANNEL_QSCHEMES and self.ch_axis is None and self.block_size is None:
            raise AnnotationError(f"per-channel qscheme {self.qscheme} needs ch_axis")
        if self.block_size is not None:
            object.__setattr__(self, "block_size", tuple(int(b) for b in self.block_size))

    @property
    def range(self) -> tuple[int, int]:
        """(quant_min, quant_max) with the dtype's full range filling any missing bound."""
        return resolve_range(self.dtype, self.quant_min, self.quant_max)

    @property
    def is_symmetric(self) -> bool:
        return self.qscheme in SYMMETRIC_QSCHEMES

    @property
    def is_per_channel(self) -> bool:
        return self.qscheme in PER_CHANNEL_QSCHEMES and self.block_size is None

    @property
    def is_per_block(self) -> bool:
        return self.block_size is not None


@dataclass(frozen=True)
class FixedQParamsQuantizationSpec(QuantizationSpecBase):
    """A tensor whose range is known in advance (sigmoid, tanh): no calibration needed."""

    dtype: torch.dtype
    scale: float
    zero_point: int
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    is_dynamic: bool = False

    def __post_init__(self) -> None:
        resolve_range(self.dtype, self.quant_min, self.quant_max)
        if not self.scale > 0:
            raise AnnotationError(f"fixed scale must be positive, got {self.scale}")

    @property
    def range(self) -> tuple[int, int]:
        return resolve_range(self.dtype, self.quant_min, self.quant_max)


@dataclass(frozen=True)
class SharedQuantizationSpec(QuantizationSpecBase):
    """Use the same observer (hence the same qparams) as another edge or node."""

    edge_or_node: EdgeOrNode


@dataclass(frozen=True)
class DerivedQuantizationSpec(QuantizationSpecBase):
    """qparams computed at convert from other keys' observers, e.g. bias = input x weight scale."""

    derived_from: Sequence[EdgeOrNode]
    derive_qparams_fn: Callable[[list[Any]], tuple[torch.Tensor, torch.Tensor]]
    dtype: torch.dtype
    quant_min: int | None = None
    quant_max: int | None = None
    qscheme: torch.qscheme | None = None
    ch_axis: int | None = None
    is_dynamic: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "derived_from", tuple(self.derived_from))
        resolve_range(self.dtype, self.quant_min, self.quant_max)

    @property
    def range(self) -> tuple[int, int]:
        return resolve_range(self.dtype, self.quant_min, self.quant_max)


@dataclass
class QuantizationAnnotation:
    """What a node asks for: a spec per input node and one for its output.

    Stored at ``node.meta["quantization_annotation"]``. ``allow_implicit_sharing=False`` keeps this
    node's input edges from joining the producer's observer even when the specs agree.
    """

    input_qspec_map: dict[Node, QuantizationSpecBase | None] = field(default_factory=dict)
    output_qspec: QuantizationSpecBase | None = None
    allow_implicit_sharing: bool = True
    _annotated: bool = False


BiasSpec = Union[QuantizationSpecBase, Callable[[Node], Union[QuantizationSpecBase, None]], None]


@dataclass(frozen=True)
class QuantizationConfig:
    """The specs a rule applies to one op: activations in/out, weight and bias.

    ``bias`` may be a callable ``(node) -> spec`` so a backend can derive the bias spec from the
    node's own input and weight observers (the spec is then built per node, never shared).
    """

    input_activation: QuantizationSpecBase | None
    output_activation: QuantizationSpecBase | None
    weight: QuantizationSpecBase | None
    bias: BiasSpec
    is_qat: bool = False

    def bias_spec(self, node: Node) -> QuantizationSpecBase | None:
        """The bias spec for ``node``: the stored spec, or the callable's result for this node."""
        if self.bias is None or isinstance(self.bias, QuantizationSpecBase):
            return self.bias
        if callable(self.bias):
            return self.bias(node)
        return self.bias


def get_annotation(node: Node) -> Any | None:
    """The annotation on ``node`` (ours or a PT2E one), or None."""
    return node.meta.get(Q_ANNOTATION_KEY)


def is_annotated(node: Node) -> bool:
    ann = node.meta.get(Q_ANNOTATION_KEY)
    return ann is not None and bool(getattr(ann, "_annotated", False))


def annotate_node(
    node: Node,
    input_qspec_map: Mapping[Node, QuantizationSpecBase | None] | None = None,
    output_qspec: QuantizationSpecBase | None = None,
    *,
    allow_implicit_sharing: bool = True,
) -> QuantizationAnnotation:
    """Write (or extend) ``node``'s annotation and mark it claimed."""
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if not isinstance(ann, QuantizationAnnotation):
        ann = QuantizationAnnotation()
        node.meta[Q_ANNOTATION_KEY] = ann
    if input_qspec_map:
        ann.input_qspec_map.update(input_qspec_map)
    if output_qspec is not None:
        ann.output_qspec = output_qspec
    ann.allow_implicit_sharing = ann.allow_implicit_sharing and allow_implicit_sharing
    ann._annotated = True
    return ann
