"""SmoothQuant: migrate activation outliers into the weights, with the migration strength searched.

Xiao, Lin, Seznec, Wu, Demouth, Han, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", ICML 2023.

A linear layer ``y = x W^T`` equals ``(x / s) (W s)^T`` for any positive per-input-channel ``s``.
With ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)`` the few activation channels with huge
ranges shrink and the weights' columns grow, splitting the difficulty between the two grids. The
``1/s`` is folded into what produces ``x`` (a LayerNorm's affine parameters, an RMSNorm's weight
multiply, a preceding linear layer), so the program gains no op; layers reading the same input
(query/key/value projections) share one ``s``. ``alpha`` is searched per input on a bounded sample
of calibration rows, minimizing the layers' output error under simulated quantization
(per-tensor activations and per-channel weights with the bit widths of the quantizer's global
config, read from its specs; ``act_bits``/``weight_bits`` override them) against the float output;
"no smoothing" is a candidate too, so an input is only smoothed where that helps.

Needs calibration data before annotation:
``prepare(..., algorithms=Algorithms(["smoothquant"], calibration=batches))``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from _quantplug.algorithms.collectors import InputSample
from _quantplug.algorithms.spec import Algorithm, TransformContext, option, options_as_fields
from _quantplug.errors import OptionError
from _quantplug.graph.attrs import fetch_attr

LINEAR = "aten.linear.default"


@dataclass(frozen=True)
class SmoothGroup:
    """Linear layers reading one input, and the op whose output channels absorb ``1/s``."""

    source: Node
    linears: tuple[Node, ...]
    kind: str  # "layer_norm", "mul", "linear"
    targets: tuple[str, ...]  # the tensors divided by s (norm weight/bias, multiplier, weight/bias)


def _weight(node: Node) -> Node:
    weight = node.args[1]
    assert isinstance(weight, Node)
    return weight


def _const(arg: Any) -> bool:
    return isinstance(arg, Node) and arg.op == "get_attr"


def _absorber(gm: GraphModule, source: Node, channels: int) -> tuple[str, tuple[str, ...]] | None:
    """How ``source``'s output channels can absorb a division (or None)."""
    if source.op != "call_function":
        return None
    target = str(source.target)
    if target == "aten.layer_norm.default":
        params: list[Any] = [a for a in source.args[2:4] if a is not None]
        if params and all(_const(a) and len(a.users) == 1 for a in params) and len(params) == 2:
            return "layer_norm", tuple(str(a.target) for a in params)
        return None
    if target == LINEAR:
        params = [a for a in source.args[1:3] if a is not None]  # type: ignore[misc]
        if all(_const(a) and len(a.users) == 1 for a in params):
            return "linear", tuple(str(a.target) for a in params)
        return None
    if target == "aten.mul.Tensor" and len(source.args) == 2:
        arg: Any
        for arg in source.args:
            if _const(arg) and len(arg.users) == 1:
                value = fetch_attr(gm, str(arg.target))
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == channels:
                    if value.numel() == channels:
                        return "mul", (str(arg.target),)
    return None


def find_groups(gm: GraphModule) -> list[SmoothGroup]:
    by_input: dict[Node, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target) == LINEAR and _const(node.args[1]):
            if isinstance(node.args[0], Node) and len(node.args[1].users) == 1:
                by_input[node.args[0]].append(node)
    groups = []
    for source, linears in by_input.items():
        if set(source.users) != set(linears):
            continue  # someone else reads the unsmoothed activation
        channels = fetch_attr(gm, str(_weight(linears[0]).target)).shape[1]
        found = _absorber(gm, source, channels)
        if found is not None:
            groups.append(SmoothGroup(source, tuple(linears), found[0], found[1]))
    return groups


def fake_quant(x: torch.Tensor, bits: int, dim: int | None) -> torch.Tensor:
    """Symmetric round-to-nearest quantization of ``x`` (per tensor, or per slice along ``dim``)."""
    qmax = 2 ** (bits - 1) - 1
    if dim is None:
        scale = x.abs().amax().clamp(min=1e-12) / qmax
    else:
        scale = (
            x.abs().amax(dim=tuple(d for d in range(x.dim()) if d != dim), keepdim=True).clamp(min=1e-12)
            / qmax
        )
    return torch.clamp(torch.round(x / scale), -qmax - 1, qmax) * scale


def fake_quant_range(x: torch.Tensor, seen: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` quantized asymmetrically per tensor on the range (zero included) of ``seen``; values of
    ``x`` outside it clip, as new data does against a calibrated range."""
    lo, hi = torch.clamp(seen.amin(), max=0.0), torch.clamp(seen.amax(), min=0.0)
    levels = 2**bits - 1
    scale = torch.clamp((hi - lo) / levels, min=1e-12)
    zero = torch.round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, levels) - zero) * scale


def smoothing_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = act_max_j^alpha / weight_max_j^(1 - alpha)``; 1 where a channel is all zero."""
    ok = (act_max > 0) & (weight_max > 0)
    a = torch.where(ok, act_max, torch.ones_like(act_max))
    w = torch.where(ok, weight_max, torch.ones_like(weight_max))
    return torch.where(ok, a.pow(alpha) / w.pow(1 - alpha), torch.ones_like(act_max)).clamp(min=1e-5)


@options_as_fields
class SmoothQuant(Algorithm):
    name = "smoothquant"
    description = "SmoothQuant: migrate activation outliers into linear weights, alpha searched per input"
    paper = "Xiao et al. 2023, SmoothQuant (ICML)"
    alpha: float = option(
        -1.0, "migration strength in [0, 1]; -1 searches it per input", minimum=-1.0, maximum=1.0
    )
    act_bits: int = option(
        0, "activation bits simulated in the search (0: the quantizer's; -1: float)", minimum=-1, maximum=16
    )
    weight_bits: int = option(
        0, "weight bits (per channel) simulated (0: the quantizer's)", minimum=0, maximum=16
    )
    sample_rows: int = option(512, "calibration rows kept per input for the search", minimum=1)

    def __post_init__(self) -> None:
        if -1 < self.alpha < 0:
            raise OptionError(
                "option 'alpha' of algorithm 'smoothquant' must be in [0, 1], or -1 to search it, "
                f"got {self.alpha!r}"
            )
        if self.weight_bits == 1:
            raise OptionError(
                "option 'weight_bits' of algorithm 'smoothquant' must be 0 (the quantizer's) or in [2, 16], "
                "got 1 (a symmetric 1-bit grid has no level but zero)"
            )
        #: per smoothed input: the alpha chosen (-1: left alone; for reports and tests)
        self.chosen: dict[str, float] = {}
        self._bits: tuple[int | None, int] = (8, 8)

    def transform_program(self, gm: GraphModule, context: TransformContext) -> None:
        groups = find_groups(gm)
        if not groups:
            return
        act, weight = context.global_bits()
        if getattr(context.quantizer, "global_config", None) is None:
            act = 8  # no config to read (a foreign quantizer): assume 8-bit activations
        self._bits = (
            None if self.act_bits < 0 else self.act_bits or act,  # None: activations stay float
            self.weight_bits or weight or 8,
        )
        maxima, samples = _activation_stats(gm, [g.source for g in groups], context, self.sample_rows)
        for group in groups:
            act_max = maxima.get(group.source.name)
            sample = samples[group.source.name].result()
            if act_max is None or sample is None:
                continue
            weights = [fetch_attr(gm, str(_weight(n).target)).detach() for n in group.linears]
            weight_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
            alpha = self.alpha if self.alpha >= 0 else self._search(sample, weights, act_max, weight_max)
            self.chosen[group.source.name] = alpha
            if alpha < 0:
                continue  # no migration strength beats leaving this input alone
            s = smoothing_scales(act_max, weight_max, alpha)
            if bool((s == 1).all()):
                continue
            for node, w in zip(group.linears, weights):
                context.set_constant(gm, str(_weight(node).target), w * s)
            for target in group.targets:
                value = fetch_attr(gm, target).detach()
                if group.kind == "linear" and value.dim() == 2:
                    context.set_constant(gm, target, value / s[:, None])
                else:
                    context.set_constant(gm, target, value / s)

    def _search(
        self,
        sample: torch.Tensor,
        weights: Sequence[torch.Tensor],
        act_max: torch.Tensor,
        weight_max: torch.Tensor,
    ) -> float:
        """The alpha in 0, 0.05, ..., 1 whose simulated quantization best keeps the layers' outputs,
        or -1 when no smoothing at all does better.

        Two-fold: the smoothing scales and the activation range come from one half of the sample
        rows and the error is measured on the other half (and the other way round). Measured on
        the rows that set them, equalized channels all sit exactly at their range and look
        better than they are: on new data every channel can clip, where without smoothing only
        the widest one does (the random encoder at int8: alpha 0.9 chosen, -1.3 dB on held-out
        data; ``bench/results/nncf_compare.md``).
        """
        x = sample.to(torch.float32)
        act_bits, weight_bits = self._bits
        if x.shape[0] < 2:
            return -1.0
        folds = [(x[0::2], x[1::2]), (x[1::2], x[0::2])]
        refs = [[test @ w.t() for w in weights] for _, test in folds]

        def error(alpha: float) -> float:
            total = 0.0
            for (fit, test), outs in zip(folds, refs):
                s = (
                    torch.ones_like(act_max)
                    if alpha < 0
                    else smoothing_scales(fit.abs().amax(0), weight_max, alpha)
                )
                xq = test / s if act_bits is None else fake_quant_range(test / s, fit / s, act_bits)
                for w, ref in zip(weights, outs):
                    total += float((xq @ fake_quant(w * s, weight_bits, dim=0).t() - ref).pow(2).sum())
            return total

        best, best_alpha = error(-1.0), -1.0
        for step in range(21):
            alpha = step / 20
            found = error(alpha)
            if found < best:
                best, best_alpha = found, alpha
        return best_alpha


def _activation_stats(
    gm: GraphModule, nodes: Sequence[Node], context: TransformContext, rows: int
) -> tuple[dict[str, torch.Tensor], dict[str, InputSample]]:
    """Per-channel abs-max and a bounded row sample of each node's output over the calibration data."""
    wanted = {n.name for n in nodes}
    maxima: dict[str, torch.Tensor] = {}
    samples = {name: InputSample(rows) for name in wanted}

    class Recorder(Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            if n.name in wanted and isinstance(out, torch.Tensor):
                flat = out.detach().reshape(-1, out.shape[-1]).to(torch.float32)
                seen = flat.abs().amax(0)
                maxima[n.name] = seen if n.name not in maxima else torch.maximum(maxima[n.name], seen)
                samples[n.name].update(flat)
            return out

    with torch.no_grad():
        for batch in context.batches():
            Recorder(gm).run(*batch)
    return maxima, samples
