"""Cross-layer equalization with high-bias absorption.

Nagel, van Baalen, Blankevoort, Welling, "Data-Free Quantization Through Weight Equalization and
Bias Correction", ICCV 2019, sections 4.1 (equalization) and 4.2 (absorbing high biases).

For two layers ``y = W2 f(W1 x + b1) + b2`` with ``f`` positively homogeneous (ReLU, or nothing),
scaling output channel ``c`` of layer 1 by ``1/s_c`` and input channel ``c`` of layer 2 by ``s_c``
keeps the function. Choosing ``s_c = sqrt(r1_c / r2_c)`` (``r1_c``: channel ``c``'s range in W1's
output, ``r2_c``: in W2's input) makes both ranges ``sqrt(r1_c r2_c)``: per-tensor (and
per-block) weight grids stop wasting their range on a few wide channels. Chains of three or more
layers are equalized pairwise until the scales settle.

High-bias absorption then moves what every ReLU input surely exceeds, ``h_c = max(0, mu_c - 3
sigma_c)``, out of ``b1`` into ``b2 += W2 h`` so activations centre nearer zero. The paper reads
``mu``/``sigma`` from batch-norm parameters; batch norms are folded before this runs, so here they
are measured on the calibration batches (``Algorithms([...], calibration=...)``); without calibration
data only equalization runs. Absorption is exact while the ReLU input stays above ``h`` (the
3-sigma rule) and is done only where the next layer is a linear layer or an unpadded convolution
(zero padding would otherwise see the shift at the borders).

Works on the float program before annotation (on quantplug's copy), for any backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from _quantplug.algorithms.spec import Algorithm, TransformContext, option, options_as_fields
from _quantplug.graph.attrs import fetch_attr

LAYERS = {
    "aten.linear.default": "linear",
    "aten.conv1d.default": "conv",
    "aten.conv2d.default": "conv",
    "aten.conv3d.default": "conv",
}
#: positively homogeneous activations between the pair: f(x / s) = f(x) / s for s > 0
HOMOGENEOUS = {"aten.relu.default", "aten.relu_.default"}


@dataclass(frozen=True)
class Pair:
    """Two layers equalized together: ``first`` -> [``act``] -> ``second``."""

    first: Node
    second: Node
    act: Node | None


def _groups(node: Node) -> int:
    if LAYERS[str(node.target)] != "conv":
        return 1
    groups: Any = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    return int(groups)


def _padding_is_zero(node: Node) -> bool:
    if LAYERS[str(node.target)] == "linear":
        return True
    padding: Any = node.args[4] if len(node.args) > 4 else node.kwargs.get("padding", 0)
    values = padding if isinstance(padding, (list, tuple)) else [padding]
    return all(int(p) == 0 for p in values)


def _const(node: Any) -> bool:
    return isinstance(node, Node) and node.op == "get_attr" and len(node.users) == 1


def find_pairs(gm: GraphModule) -> list[Pair]:
    """Layer pairs whose connecting tensor has no other reader (so rescaling it changes nothing else)."""
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or str(node.target) not in LAYERS or not _const(node.args[1]):
            continue
        if len(node.args) > 2 and node.args[2] is not None and not _const(node.args[2]):
            continue
        current, act = node, None
        if len(current.users) != 1:
            continue
        (user,) = current.users
        if str(user.target) in HOMOGENEOUS and user.args[0] is current and len(user.users) == 1:
            act = user
            (user,) = user.users
        if user.op != "call_function" or str(user.target) not in LAYERS or user.args[0] is not (act or node):
            continue
        if not _const(user.args[1]) or (
            len(user.args) > 2 and user.args[2] is not None and not _const(user.args[2])
        ):
            continue
        groups = _groups(user)
        w2 = fetch_attr(gm, str(_weight(user).target))
        if groups != 1 and not (w2.shape[1] == 1 and w2.shape[0] == groups):
            continue  # grouped (not depthwise) second layers mix channels within groups only
        pairs.append(Pair(node, user, act))
    return pairs


#: channels whose two ranges differ by more than this factor are left alone (dead or degenerate:
#: a scale beyond 1e6 would only move rounding noise around, or underflow)
MAX_RANGE_RATIO = 1e12


def equalization_scales(r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``s = sqrt(r1 / r2)`` per channel: both ranges become ``sqrt(r1 r2)``.

    1 where either range is zero or their ratio exceeds :data:`MAX_RANGE_RATIO` either way.
    """
    ok = (r1 > 0) & (r2 > 0)
    safe1 = torch.where(ok, r1, torch.ones_like(r1))
    safe2 = torch.where(ok, r2, torch.ones_like(r2))
    ratio = safe1 / safe2
    ok = ok & (ratio <= MAX_RANGE_RATIO) & (ratio >= 1 / MAX_RANGE_RATIO)
    return torch.where(ok, torch.sqrt(torch.where(ok, ratio, torch.ones_like(ratio))), torch.ones_like(r1))


def _out_ranges(w: torch.Tensor) -> torch.Tensor:
    return w.abs().reshape(w.shape[0], -1).amax(-1)


def _in_ranges(w: torch.Tensor, groups: int) -> torch.Tensor:
    """Per input channel of the second layer (depthwise: weight dim 0 indexes the channels)."""
    if groups > 1:
        return w.abs().reshape(w.shape[0], -1).amax(-1)
    return w.abs().transpose(0, 1).reshape(w.shape[1], -1).amax(-1)


def _scale_out(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return w / s.reshape(-1, *([1] * (w.dim() - 1)))


def _scale_in(w: torch.Tensor, s: torch.Tensor, groups: int) -> torch.Tensor:
    if groups > 1:
        return w * s.reshape(-1, *([1] * (w.dim() - 1)))
    return w * s.reshape(1, -1, *([1] * (w.dim() - 2)))


@options_as_fields
class CrossLayerEqualization(Algorithm):
    name = "cle"
    description = "cross-layer equalization of conv/linear pairs through ReLU, with high-bias absorption"
    paper = "Nagel et al. 2019, Data-Free Quantization Through Weight Equalization and Bias Correction"
    iterations: int = option(20, "passes over the layer pairs (chains settle over passes)", minimum=1)
    absorb_high_bias: bool = option(True, "absorb high biases (needs calibration data)")
    sigmas: float = option(3.0, "absorb what the ReLU input exceeds with mean - sigmas * std", minimum=0.0)

    def __post_init__(self) -> None:
        self.pairs: list[Pair] = []

    def transform_program(self, gm: GraphModule, context: TransformContext) -> None:
        self.pairs = pairs = find_pairs(gm)
        if not pairs:
            return
        weights = {
            str(n.target): fetch_attr(gm, str(n.target)).detach().clone()
            for p in pairs
            for n in (_weight(p.first), _weight(p.second), *_bias(p.first), *_bias(p.second))
        }
        for _ in range(self.iterations):
            moved = 0.0
            for pair in pairs:
                w1, w2 = str(_weight(pair.first).target), str(_weight(pair.second).target)
                groups = _groups(pair.second)
                s = equalization_scales(_out_ranges(weights[w1]), _in_ranges(weights[w2], groups))
                weights[w1] = _scale_out(weights[w1], s)
                weights[w2] = _scale_in(weights[w2], s, groups)
                for b in _bias(pair.first):
                    weights[str(b.target)] = weights[str(b.target)] / s
                moved = max(moved, float((s - 1).abs().max()))
            if moved < 1e-6:
                break
        for target, value in weights.items():
            context.set_constant(gm, target, value)
        if self.absorb_high_bias and context.calibration:
            self._absorb(gm, context, pairs)

    def _absorb(self, gm: GraphModule, context: TransformContext, pairs: Sequence[Pair]) -> None:
        eligible = [
            p
            for p in pairs
            if p.act is not None and _bias(p.first) and _bias(p.second) and _padding_is_zero(p.second)
        ]
        if not eligible:
            return
        stats = _moments(gm, [p.first for p in eligible], context)
        for pair in eligible:
            found = stats.get(pair.first.name)
            if found is None:
                continue
            mean, std, rows = found
            if rows < MIN_ABSORB_ROWS:
                warnings.warn(
                    f"cle: not absorbing the high biases of {pair.first.name!r}: its statistics come from "
                    f"{rows} calibration row(s), fewer than {MIN_ABSORB_ROWS}; a mean and deviation from so "
                    "few samples are the samples themselves (one row made the output noise: -0.1 dB). "
                    "Give more calibration data, or cle's absorb_high_bias=False",
                    UserWarning,
                    stacklevel=2,
                )
                continue
            h = torch.clamp(mean - self.sigmas * std, min=0.0).to(torch.float32)
            if not bool((h > 0).any()):
                continue
            (b1,) = _bias(pair.first)
            (b2,) = _bias(pair.second)
            w2 = fetch_attr(gm, str(_weight(pair.second).target)).detach()
            groups = _groups(pair.second)
            if groups > 1:
                carried = w2.reshape(w2.shape[0], -1).sum(-1) * h
            else:
                carried = w2.reshape(w2.shape[0], w2.shape[1], -1).sum(-1) @ h
            context.set_constant(gm, str(b1.target), fetch_attr(gm, str(b1.target)).detach() - h)
            context.set_constant(gm, str(b2.target), fetch_attr(gm, str(b2.target)).detach() + carried)


#: the fewest rows (samples per channel) whose mean and deviation bias absorption trusts
MIN_ABSORB_ROWS = 32


def _weight(node: Node) -> Node:
    """A layer's weight node (``find_pairs`` checked it is a get_attr)."""
    weight = node.args[1]
    assert isinstance(weight, Node)
    return weight


def _bias(node: Node) -> list[Node]:
    bias = node.args[2] if len(node.args) > 2 else None
    return [bias] if isinstance(bias, Node) else []


def _moments(
    gm: GraphModule, nodes: Sequence[Node], context: TransformContext
) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Per-channel mean and std of ``nodes``' outputs over the calibration batches (running sums),
    and how many rows they come from."""
    wanted = {n.name: n for n in nodes}
    sums: dict[str, list[Any]] = {}

    class Recorder(Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            if n.name in wanted and isinstance(out, torch.Tensor):
                linear = LAYERS[str(n.target)] == "linear"
                rows = out.detach().reshape(-1, out.shape[-1]) if linear else out.detach().transpose(0, 1)
                rows = rows if linear else rows.reshape(rows.shape[0], -1).t()
                rows = rows.to(torch.float64)
                entry = sums.setdefault(n.name, [0, 0.0, 0.0])
                entry[0] += rows.shape[0]
                entry[1] = entry[1] + rows.sum(0)
                entry[2] = entry[2] + (rows * rows).sum(0)
            return out

    with torch.no_grad():
        for batch in context.batches():
            Recorder(gm).run(*batch)
    result = {}
    for name, (count, total, squares) in sums.items():
        mean = total / count
        var = torch.clamp(squares / count - mean * mean, min=0.0)
        result[name] = (mean, var.sqrt(), int(count))
    return result
