"""QNN HTP precisions as quantplug ``QuantizationConfig``s, numerically matching ExecuTorch 1.5.1.

Grids (ExecuTorch ``quantizer/qconfig.py``; anchor section 2):

==============  ===================  ===============================  ==========================
precision       activations          weights, per-tensor              weights, per-channel/block
==============  ===================  ===============================  ==========================
8a8w            uint8 [0,255]        int8 [-127,127] symmetric        int8 [-127,127]
8a4w            uint8                int4 [-7,7] symmetric            int4 [-7,7]
16a8w           uint16 [0,65535]     uint8 symmetric (zero point 128) int8 [-127,127]
16a4w           uint16               int4 [-7,7]                      int4 [-7,7]
16a16w          uint16               int16 [-32767,32767]             int16 [-32767,32767]
16a2w           uint16               (2-bit is per-channel only)      int2 [-2,1]
16a4w_block     uint16               int4 [-7,7]                      LPBQ: int4 [-7,7] per block
==============  ===================  ===============================  ==========================

Differences from ExecuTorch, each deliberate:

* 16-bit activations are ``torch.uint16`` (ExecuTorch: ``int32`` with range ``[0, 65535]``); the
  numbers are identical. Sub-byte weights are ``INT4`` / ``INT2`` with ExecuTorch's
  *restricted* ranges ``[-7, 7]`` / ``[-2, 1]`` (stored in an int8 container), so scales are
  ``amax / 7`` and ``amax / 1.5`` exactly as ExecuTorch's; the full int4 range ``[-8, 7]`` would
  give ``amax / 7.5`` and break parity.
* conv/linear biases are int32 with ``scale = input scale x weight scale`` in every config,
  per-tensor ones included (ExecuTorch's per-tensor bias observer collapses to eps). LPBQ biases
  use ``input scale x max(block scales of the channel) / 16``, as ExecuTorch's per-block configs.
* ``act_symmetric`` with 16-bit activations puts the zero point at 32768 (ExecuTorch: 0, which
  clips every negative value).
* The activation eps follows the precision everywhere (ExecuTorch's per-channel configs use the
  16-bit eps even for 8-bit activations); the user's eps also reaches LPBQ weights.
* Specs are immutable values; per-node specs (block size, derived bias) are built per node, so
  no block size leaks from one layer to another (``block_size_map``).
* LPBQ weights use :class:`~quantplug_qnn_htp.observers.LpbqObserver`: the converted program's
  block scales are already the device's ``per-channel scale x 4-bit integer``.
* An LPBQ block spans ``block_size`` input channels and the whole kernel window (one integer
  scale per output channel and block, QNN's ``numBlocksPerAxis = in_channels / block_size``);
  ExecuTorch's ``(1, B, 1, 1)`` gives every kernel tap its own block scales. Identical for
  1x1 convolutions and linears.

QAT variants (``qat=True``, every precision): activations are fake-quantized with the same
observer as PTQ; weights follow the current weights (ExecuTorch's per-channel and per-block QAT
observers calibrate once and freeze); fixed-qparam outputs (sigmoid...) get fake-quant modules
too (the core wraps every fixed observer in QAT); 16a8w per-tensor weights are signed int8
``[-127, 127]`` as in ExecuTorch's ``get_16a8w_qnn_qat_config``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from quantplug.backend import (
    INT2,
    INT4,
    AnnotationError,
    DerivedQuantizationSpec,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    ObserverFactory,
    OptionError,
    PerChannelMinMaxObserver,
    QuantizationConfig,
    QuantizationSpec,
    QuantizationSpecBase,
    constant_value,
    floor_bias_scale,
    set_coverage_note,
)
from quantplug_qnn_htp.observers import (
    DEFAULT_MASK_MARGIN,
    LPBQ_SCALE_STEPS,
    ConcatMinMaxObserver,
    LatestMinMaxObserver,
    LatestPerChannelMinMaxObserver,
    LpbqObserver,
    MaskAwareObserver,
)

#: ExecuTorch ``utils/constants.py``: DEFAULT_EPS_8BIT / DEFAULT_EPS_16BIT.
EPS_8BIT = 0.0001 / 255
EPS_16BIT = 0.0001 / 65535

PRECISIONS: dict[str, str] = {
    "8a8w": "uint8 activations, int8 symmetric weights, int32 bias",
    "16a8w": "uint16 activations, 8-bit symmetric weights, int32 bias",
    "16a4w": "uint16 activations, 4-bit symmetric weights, int32 bias",
    "16a16w": "uint16 activations, int16 symmetric weights, int32 bias (HTP V73+ for conv/linear/matmul)",
    "8a4w": "uint8 activations, 4-bit symmetric weights, int32 bias",
    "16a2w": "uint16 activations, 2-bit per-channel symmetric weights, int32 bias",
    "16a4w_block": "uint16 activations, 4-bit LPBQ block-wise weights for conv/linear (HTP V69+)",
}
DEFAULT_PRECISION = "8a8w"
ACT_OBSERVERS = ("moving_average", "minmax", "histogram")
#: PTQ activations are observed over every calibration batch's extremes: a moving average (ExecuTorch's
#: choice) depends on batch order, its first batch dominates with torchao's averaging constant, and no
#: split across processes reproduces it; QAT keeps the moving average, which follows the activations
#: as training moves them (bench/results/activation_margin.md)
DEFAULT_ACT_OBSERVER = "minmax"
DEFAULT_QAT_ACT_OBSERVER = "moving_average"
#: 16-bit activation grids cover 4 times their calibrated range: held-out values beyond what the
#: calibration batches reached are kept at the cost of 2 of 16 bits (bench/results/activation_margin.md)
DEFAULT_ACT_RANGE_MARGIN = 4.0
DEFAULT_BLOCK_SIZE = 64
#: the smallest LPBQ block chosen automatically (a smaller requested block_size lowers it): below
#: it a 4-bit block scale per few weights costs more memory than per-channel weights lose
MIN_FITTED_BLOCK = 16

# precision -> (activation dtype, weight grid (dtype, qmin, qmax), eps)
_GRIDS: dict[str, tuple[torch.dtype, tuple[torch.dtype, int, int], float]] = {
    "8a8w": (torch.uint8, (torch.int8, -127, 127), EPS_8BIT),
    "8a4w": (torch.uint8, (INT4, -7, 7), EPS_8BIT),
    "16a8w": (torch.uint16, (torch.int8, -127, 127), EPS_16BIT),
    "16a4w": (torch.uint16, (INT4, -7, 7), EPS_16BIT),
    "16a16w": (torch.uint16, (torch.int16, -32767, 32767), EPS_16BIT),
    "16a2w": (torch.uint16, (INT2, -2, 1), EPS_16BIT),
    "16a4w_block": (torch.uint16, (INT4, -7, 7), EPS_16BIT),
}
#: 2-bit weights cannot be encoded per tensor (QNN has no per-tensor 2-bit encoding), so 16a2w
#: always quantizes conv/linear weights per channel.
_ALWAYS_PER_CHANNEL = frozenset({"16a2w", "16a4w_block"})
#: precisions whose linear weights are per channel unless ``per_channel_linear=False``: with one
#: scale per tensor, 16 levels span every output channel's weights, and the trained char-level
#: GPT of ``bench/trained`` at 16a4w lost 0.09 test perplexity against 0.03 per channel (issue
#: 45). HTP quantizes FullyConnected weights per channel on every arch it supports (V68+).
#: ExecuTorch's QnnQuantizer keeps them per tensor (``EXECUTORCH_DEFAULTS``), as at 8 and 16 bits.
PER_CHANNEL_LINEAR_BY_DEFAULT = frozenset({"8a4w", "16a4w"})


@dataclass(frozen=True)
class QnnQuantizationConfig(QuantizationConfig):
    """A ``QuantizationConfig`` plus the op-specific weight grids HTP rules pick from.

    ``weight`` is the per-tensor weight spec (what ops without a more specific field use);
    ``conv_weight`` / ``conv_transpose_weight`` / ``linear_weight`` / ``addmm_weight`` /
    ``embedding_weight`` are the per-channel specs (None: per-tensor; embedding: the table takes
    the activation grid; ``addmm``'s ``[in, out]`` weight has its channels on axis 1);
    ``block_weight`` with ``block_size`` turns conv/linear weights into LPBQ blocks along the input
    channels (the largest block up to ``block_size`` that divides a layer's input channels, or
    exactly ``block_size`` with ``exact_block_size``); ``norm_weight`` is the layer/batch-norm
    weight grid; ``matmul_in1`` the second MatMul operand's grid (None: the activation spec);
    ``norm_bias`` an int32 symmetric grid for biases that are not derived (norms); ``concat`` the
    output grid of ``cat`` (absolute range); ``statistic`` the grid of per-row statistics
    (variance, 1/rms: absolute range too); ``mask_margin`` where ``-inf`` mask values land below
    the data (see ``observers``).
    """

    precision: str = DEFAULT_PRECISION
    conv_weight: QuantizationSpecBase | None = None
    conv_transpose_weight: QuantizationSpecBase | None = None
    linear_weight: QuantizationSpecBase | None = None
    addmm_weight: QuantizationSpecBase | None = None
    embedding_weight: QuantizationSpecBase | None = None
    block_weight: QuantizationSpecBase | None = None
    block_size: int | None = None
    exact_block_size: bool = False
    norm_weight: QuantizationSpecBase | None = None
    matmul_in1: QuantizationSpecBase | None = None
    norm_bias: QuantizationSpecBase | None = None
    concat: QuantizationSpecBase | None = None
    statistic: QuantizationSpecBase | None = None
    mask_margin: float = DEFAULT_MASK_MARGIN

    def masked(self, spec: QuantizationSpecBase | None) -> QuantizationSpecBase | None:
        """``spec`` observed by a :class:`MaskAwareObserver` (for outputs that carry ``-inf`` masks)."""
        if not isinstance(spec, QuantizationSpec):
            return spec
        inner = spec.observer_or_fake_quant_ctr or MinMaxObserver.with_args()
        if isinstance(inner, ObserverFactory) and inner.cls is MaskAwareObserver:
            return spec
        return dataclasses.replace(
            spec, observer_or_fake_quant_ctr=MaskAwareObserver.with_args(inner=inner, margin=self.mask_margin)
        )


def activation_observer(name: str, eps: float, margin: float = 1.0) -> ObserverFactory:
    if name == "moving_average":
        return MovingAverageMinMaxObserver.with_args(eps=eps, range_margin=margin)
    if name == "minmax":
        return MinMaxObserver.with_args(eps=eps, range_margin=margin)
    if name == "histogram":
        from quantplug.backend import HistogramObserver

        return HistogramObserver.with_args(eps=eps, range_margin=margin)
    raise OptionError(f"unknown act_observer {name!r}; valid values: {', '.join(ACT_OBSERVERS)}")


def build_config(precision: str | None, options: Mapping[str, Any]) -> QnnQuantizationConfig:
    """The config of ``precision`` with the backend options applied (also for per-module overrides).

    ``options`` uses the backend option names (``per_channel_conv``, ``act_observer``, ``qat``...);
    missing ones take their defaults.
    """
    precision = precision or DEFAULT_PRECISION
    if precision not in _GRIDS:
        raise OptionError(f"unknown QNN HTP precision {precision!r}; valid values: {', '.join(PRECISIONS)}")
    act_dtype, (w_dtype, w_min, w_max), default_eps = _GRIDS[precision]
    eps = options.get("eps")
    eps = default_eps if eps is None else float(eps)
    if eps <= 0:
        raise OptionError(f"option 'eps' of backend 'qnn_htp' must be positive, got {eps!r}")
    qat = bool(options.get("qat", False))
    # the margin is for 16-bit grids only: 8-bit ones have no steps to spare
    range_margin = options.get("act_range_margin")
    range_margin = DEFAULT_ACT_RANGE_MARGIN if range_margin is None else float(range_margin)
    act_margin = range_margin if torch.iinfo(act_dtype).bits == 16 else 1.0
    default_observer = DEFAULT_QAT_ACT_OBSERVER if qat else DEFAULT_ACT_OBSERVER
    act_obs = activation_observer(options.get("act_observer") or default_observer, eps, act_margin)
    symmetric_act = bool(options.get("act_symmetric", False))
    act = QuantizationSpec(
        dtype=act_dtype,
        observer_or_fake_quant_ctr=act_obs,
        qscheme=torch.per_tensor_symmetric if symmetric_act else torch.per_tensor_affine,
    )
    # weights are constants in PTQ (observed once); in QAT they move, so observe the latest values
    tensor_obs: Any = LatestMinMaxObserver if qat else MinMaxObserver
    channel_obs: Any = LatestPerChannelMinMaxObserver if qat else PerChannelMinMaxObserver

    if precision == "16a8w" and not qat:
        # ExecuTorch: uint8, per-tensor symmetric, no explicit range -> [0, 255], zero point 128
        per_tensor_w: QuantizationSpec = QuantizationSpec(
            dtype=torch.uint8,
            qscheme=torch.per_tensor_symmetric,
            observer_or_fake_quant_ctr=tensor_obs.with_args(eps=eps),
        )
    else:
        per_tensor_w = QuantizationSpec(
            dtype=w_dtype,
            quant_min=w_min,
            quant_max=w_max,
            qscheme=torch.per_tensor_symmetric,
            observer_or_fake_quant_ctr=tensor_obs.with_args(eps=eps),
        )

    def per_channel(axis: int) -> QuantizationSpec:
        return QuantizationSpec(
            dtype=w_dtype,
            quant_min=w_min,
            quant_max=w_max,
            qscheme=torch.per_channel_symmetric,
            ch_axis=axis,
            observer_or_fake_quant_ctr=channel_obs.with_args(eps=eps),
        )

    forced = precision in _ALWAYS_PER_CHANNEL
    pc_conv = forced or bool(options.get("per_channel_conv", True))
    pc_linear_option = options.get("per_channel_linear")
    pc_linear = forced or (
        precision in PER_CHANNEL_LINEAR_BY_DEFAULT if pc_linear_option is None else bool(pc_linear_option)
    )
    pc_embedding = bool(options.get("per_channel_embedding", False))

    block_weight = None
    block_size = None
    if precision == "16a4w_block":
        raw = options.get("block_size")
        block_size = DEFAULT_BLOCK_SIZE if raw is None else int(raw)
        if block_size < 0:
            raise OptionError(
                f"option 'block_size' of backend 'qnn_htp' must be >= 0 (0: LPBQ only for nodes in "
                f"block_size_map), got {block_size}"
            )
        # block_size is filled in per node (see weight_spec_for); this is the template
        block_weight = QuantizationSpec(
            dtype=w_dtype,
            quant_min=w_min,
            quant_max=w_max,
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
            observer_or_fake_quant_ctr=LpbqObserver.with_args(eps=eps, track_latest=qat),
        )

    sixteen = act_dtype == torch.uint16

    def int16_sym(obs: Any) -> QuantizationSpec:
        return QuantizationSpec(
            dtype=torch.int16,
            quant_min=-32767,
            quant_max=32767,
            qscheme=torch.per_tensor_symmetric,
            observer_or_fake_quant_ctr=obs.with_args(eps=eps),
        )

    norm_bias = QuantizationSpec(
        dtype=torch.int32,
        qscheme=torch.per_tensor_symmetric,
        observer_or_fake_quant_ctr=tensor_obs.with_args(eps=eps),
    )
    concat = dataclasses.replace(
        act, observer_or_fake_quant_ctr=ConcatMinMaxObserver.with_args(eps=eps, range_margin=act_margin)
    )
    margin = options.get("mask_margin")
    margin = DEFAULT_MASK_MARGIN if margin is None else float(margin)
    if margin < 0:
        raise OptionError(f"option 'mask_margin' of backend 'qnn_htp' must be >= 0, got {margin}")
    return QnnQuantizationConfig(
        input_activation=act,
        output_activation=act,
        weight=per_tensor_w,
        bias=None,  # derived per node from the weight spec actually used (rules.common.bias_spec_for)
        is_qat=qat,
        precision=precision,
        conv_weight=per_channel(0) if pc_conv else None,
        conv_transpose_weight=per_channel(1) if pc_conv else None,
        linear_weight=per_channel(0) if pc_linear else None,
        addmm_weight=per_channel(1) if pc_linear else None,
        embedding_weight=per_channel(0) if pc_embedding else None,
        block_weight=block_weight,
        block_size=block_size,
        exact_block_size=bool(options.get("exact_block_size", False)),
        norm_weight=int16_sym(tensor_obs) if sixteen else act,
        matmul_in1=int16_sym(MinMaxObserver) if sixteen else None,
        norm_bias=norm_bias,
        concat=concat,
        statistic=concat,  # the same absolute-range observer (rules.common.observe_absolute_range)
        mask_margin=margin,
    )


def make_config(precision: str = DEFAULT_PRECISION, **options: Any) -> QnnQuantizationConfig:
    """A QNN HTP config for per-module / per-node overrides, e.g.
    ``quantizer.set_module_name("head", make_config("16a8w", per_channel_linear=True))``."""
    return build_config(precision, options)


# --- block size map ------------------------------------------------------------------------------

BLOCK_MAP_STATE = "block_size_map"


def parse_block_size_map(value: Any) -> dict[str, int]:
    """``{"linear": 16}`` / ``{"conv2d_2": (1, 16, 1, 1)}`` (ExecuTorch style) / ``"linear:16,fc:32"``.

    A tuple gives the block along the input channels in its second entry; every other entry must
    be 1 (output channels are always per channel) -- or the kernel size, which is what our blocks
    span anyway. 0 keeps that node per-channel.
    """
    if value is None or value == "":
        return {}
    items: list[tuple[str, Any]]
    if isinstance(value, str):
        items = []
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, size = part.partition(":")
            if not sep:
                raise OptionError(f"block_size_map entry {part!r} must look like 'node_name:block_size'")
            items.append((name.strip(), size.strip()))
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise OptionError(
            f"block_size_map must be a dict or 'name:size,...' text, got {type(value).__name__}"
        )
    result: dict[str, int] = {}
    for name, size in items:
        if isinstance(size, (tuple, list)):
            if len(size) < 2 or int(size[0]) != 1:
                raise OptionError(
                    f"block_size_map[{name!r}] = {tuple(size)}: expected (1, block, ...) with the block "
                    "along the input channels (dim 1)"
                )
            size = size[1]
        try:
            bs = int(size)
        except (TypeError, ValueError):
            raise OptionError(f"block_size_map[{name!r}] = {size!r} is not an integer block size") from None
        if bs < 0:
            raise OptionError(f"block_size_map[{name!r}] = {bs} must be >= 0")
        result[str(name)] = bs
    return result


# --- per-node weight and bias specs ----------------------------------------------------------

WEIGHT_KINDS = ("conv", "conv_transpose", "linear", "addmm")


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def block_size_for(node: Node, config: QnnQuantizationConfig, block_map: Mapping[str, int] | None) -> int:
    if block_map and node.name in block_map:
        return block_map[node.name]
    return int(config.block_size or 0)


@dataclass(frozen=True)
class BlockChoice:
    """The LPBQ block of one weight: ``block`` input channels, or None for per-channel weights."""

    block: int | None
    note: str = ""


def fit_block(in_channels: int, requested: int) -> BlockChoice:
    """The largest LPBQ block up to ``requested`` that tiles ``in_channels`` input channels.

    No block (per-channel 4-bit weights) where ``in_channels <= requested`` (one block per
    channel is per-channel) or where no divisor between ``min(MIN_FITTED_BLOCK, requested)`` and
    ``requested`` exists; a note says why whenever the result is not ``requested`` itself.
    """
    if requested <= 0 or in_channels <= requested:
        return BlockChoice(None)
    if in_channels % requested == 0:
        return BlockChoice(requested)
    smallest = min(MIN_FITTED_BLOCK, requested)
    for block in range(requested - 1, smallest - 1, -1):
        if in_channels % block == 0:
            why = f"block_size {requested} does not divide {in_channels} input channels"
            return BlockChoice(block, f"LPBQ block {block}: {why}")
    return BlockChoice(
        None,
        f"per-channel 4-bit weights: no LPBQ block from {smallest} to {requested} divides "
        f"{in_channels} input channels",
    )


def weight_spec_for(
    node: Node,
    weight: Node,
    config: QuantizationConfig,
    kind: str,
    block_map: Mapping[str, int] | None = None,
) -> QuantizationSpecBase | None:
    """The weight spec of conv/linear ``node`` under ``config`` (per-block specs built per node).

    LPBQ blocks run along the input channels (dim 1) and span the kernel window. The block is
    fitted per node (:func:`fit_block`, the choice noted in ``node.meta`` for ``coverage()``):
    ``block_size`` is the largest block wanted. A block size the user fixes -- a
    ``block_size_map`` entry, or ``block_size`` with ``exact_block_size=True`` -- is used as
    given, and one that does not divide the input channels is an ``AnnotationError`` naming the
    node and both shapes. A weight with no more input channels than the block gets the
    per-channel grid (one block per channel is per-channel).
    """
    if not isinstance(config, QnnQuantizationConfig):
        return config.weight
    if kind == "linear" or kind == "conv":
        if config.block_weight is not None:
            bs = block_size_for(node, config, block_map)
            shape = _shape(weight)
            if bs and shape is not None and len(shape) >= 2 and shape[1] > bs:
                exact = config.exact_block_size or bool(block_map and node.name in block_map)
                if exact and shape[1] % bs != 0:
                    raise AnnotationError(
                        f"LPBQ block_size {bs} does not divide the {shape[1]} input channels "
                        f"of node {node.name!r} ({node.target}): weight shape {shape}, block shape "
                        f"{(1, bs, *shape[2:])}; pick a block_size that divides {shape[1]}, keep this "
                        f"node per-channel with block_size_map={{{node.name!r}: 0}}, or let qnn_htp fit "
                        "the block per node (exact_block_size=False, no block_size_map entry)"
                    )
                choice = BlockChoice(bs) if exact else fit_block(shape[1], bs)
                if choice.note:
                    set_coverage_note(node, choice.note)
                if choice.block is not None:
                    block_weight: Any = config.block_weight
                    return dataclasses.replace(block_weight, block_size=(1, choice.block, *shape[2:]))
        specific = config.linear_weight if kind == "linear" else config.conv_weight
        if config.block_weight is not None and specific is None:
            specific = _block_fallback(config)
        return specific if specific is not None else config.weight
    if kind == "conv_transpose":
        return config.conv_transpose_weight if config.conv_transpose_weight is not None else config.weight
    if kind == "addmm":
        if config.block_weight is not None:
            set_coverage_note(
                node,
                "per-channel 4-bit weights: LPBQ blocks need FullyConnected's [out, in] weight layout "
                "and addmm's weight is [in, out]",
            )
        return config.addmm_weight if config.addmm_weight is not None else config.weight
    raise ValueError(f"unknown weight kind {kind!r}; valid: {', '.join(WEIGHT_KINDS)}")


def _block_fallback(config: QnnQuantizationConfig) -> QuantizationSpecBase:
    """16a4w_block weights that stay per channel: the 4-bit per-channel grid."""
    spec = config.block_weight
    assert isinstance(spec, QuantizationSpec)
    ctr = LatestPerChannelMinMaxObserver if config.is_qat else PerChannelMinMaxObserver
    ctr_args: Any = getattr(spec.observer_or_fake_quant_ctr, "kwargs", None) or {}
    eps = ctr_args.get("eps")
    kwargs = {} if eps is None else {"eps": eps}
    return dataclasses.replace(spec, block_size=None, observer_or_fake_quant_ctr=ctr.with_args(**kwargs))


def _derive_bias(
    observers: list[Any], *, block: bool, groups: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 bias qparams: input scale x weight scale per output channel, zero point 0.

    Channels whose bias does not fit int32 on that scale (all-zero, denormal or pruned weights:
    their weight scale is eps) get the scale floor ``max|bias| / (2^31 - 1)``
    (``quantplug.annotation.annotators.floor_bias_scale``); the others keep the exact product.
    """
    act_scale, _ = observers[0].calculate_qparams()
    w_scale, _ = observers[1].calculate_qparams()
    w_scale = w_scale.to(torch.float32)
    if block:
        # LPBQ: QNN's per-channel scale is max(block scales of the channel) / 16
        w_scale = w_scale.reshape(w_scale.shape[0], -1).amax(-1) / LPBQ_SCALE_STEPS
    w_scale = w_scale.reshape(-1)
    if groups > 1 and w_scale.numel() > 1:
        w_scale = w_scale.repeat(groups)  # grouped transpose conv: weight axis 1 holds out/groups channels
    scale = (act_scale.reshape(-1)[0].to(torch.float32) * w_scale).reshape(-1)
    scale = floor_bias_scale(scale, bias)
    return scale, torch.zeros(scale.shape, dtype=torch.int64)


def bias_spec_for(
    node: Node,
    act: Node,
    weight: Node,
    weight_spec: QuantizationSpecBase | None,
    config: QuantizationConfig,
    *,
    bias: Node | None = None,
    groups: int = 1,
) -> QuantizationSpecBase | None:
    """The int32 bias spec derived from ``node``'s input and weight observers.

    ``bias`` (the bias node) floors degenerate channels' scales when it is a constant. A plain
    (non-HTP) config's own ``bias`` wins when it sets one.
    """
    if not isinstance(config, QnnQuantizationConfig):
        return config.bias_spec(node)
    if weight_spec is None or config.input_activation is None:
        return None
    block = getattr(weight_spec, "block_size", None) is not None
    per_channel = block or getattr(weight_spec, "qscheme", None) == torch.per_channel_symmetric
    return DerivedQuantizationSpec(
        derived_from=((act, node), (weight, node)),
        derive_qparams_fn=functools.partial(
            _derive_bias, block=block, groups=groups, bias=constant_value(bias)
        ),
        dtype=torch.int32,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        ch_axis=0 if per_channel else None,
    )
