"""The layer inputs of a recurrent op's weights (LSTM, GRU, RNN), which the op computes inside.

An exported ``nn.LSTM`` is one ``aten.lstm.input`` node holding every layer's weights. Each
``weight_ih_l{k}`` multiplies layer ``k``'s input sequence, each ``weight_hh_l{k}`` the hidden state
before each step, ``y = W x + b`` row by row: a linear layer, the kind SeqMSE, AdaRound, GPTQ and
bias correction know. Only the op's first argument is visible in the graph, so the weights of an
LSTM (often most of a speech or sequence model's parameters) were rounded to nearest, whatever
the user asked for: on the algorithm bench's 2-layer LSTM the algorithms could only choose its
linear head.

:func:`recurrent_layout` reads the op's constant arguments; :meth:`RecurrentLayout.layer_inputs`
re-runs the op one layer at a time (the op itself, ``num_layers=1``, so every cell's arithmetic is
torch's own) to get, per weight, the rows it multiplies:

* ``ih`` of layer ``k``, direction ``d``: layer ``k``'s input at every step (the model's input, or
  the previous layer's output in both directions);
* ``hh``: the state the step starts from, ``h_0`` then the direction's outputs but its last (a
  reverse direction runs from the end; a projected LSTM's state is the projection).

A projected LSTM's ``weight_hr`` multiplies ``o * tanh(c)``, which the op returns nowhere: it keeps
the backend's default. So do the weights of an op in training mode with dropout (a re-run would
draw other masks).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

#: recurrent ops whose weights are linear layers over rows this module can compute
RECURRENT_OPS = frozenset({"aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input", "aten.rnn_relu.input"})
#: the arguments after the params list: has_biases, num_layers, dropout, train, bidirectional, batch_first
_FLAGS = slice(3, 9)


@dataclass(frozen=True)
class RecurrentRole:
    """Which weight of a recurrent op: layer, direction (1: reverse) and ``"ih"`` or ``"hh"``."""

    layer: int
    direction: int
    kind: str


@dataclass(frozen=True)
class RecurrentLayout:
    """The constant arguments of one recurrent op (what its params list holds, in which order).

    ``stride`` is the params per layer and direction: ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``.
    """

    op: Any
    lstm: bool
    has_biases: bool
    num_layers: int
    bidirectional: bool
    batch_first: bool
    stride: int

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def role(self, index: int) -> RecurrentRole | None:
        """The role of params entry ``index`` when it is a ``w_ih`` or ``w_hh`` (else None)."""
        cell, offset = divmod(index, self.stride)
        if offset > 1 or cell >= self.num_layers * self.directions:
            return None
        layer, direction = divmod(cell, self.directions)
        return RecurrentRole(layer, direction, "ih" if offset == 0 else "hh")

    def bias_index(self, role: RecurrentRole) -> int | None:
        """The params index of the bias added to ``role``'s product (``b_ih`` / ``b_hh``)."""
        if not self.has_biases:
            return None
        cell = role.layer * self.directions + role.direction
        return cell * self.stride + (2 if role.kind == "ih" else 3)

    def layer_inputs(
        self, args: Sequence[Any], wanted: Collection[RecurrentRole]
    ) -> dict[RecurrentRole, torch.Tensor]:
        """The rows ``[steps * batch, inputs]`` each role in ``wanted`` multiplies, for the op's
        arguments ``args`` (as the node receives them); layers after the last one wanted are
        not run."""
        x, hx, params = args[0], args[1], list(args[2])
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            return {}  # not a batched sequence: nothing to feed (the collectors stay empty)
        last = max((role.layer for role in wanted), default=-1)
        found: dict[RecurrentRole, torch.Tensor] = {}
        dirs = self.directions
        with torch.no_grad():
            for layer in range(last + 1):
                cut = slice(layer * dirs, (layer + 1) * dirs)
                states: Any = [h[cut] for h in hx] if self.lstm else hx[cut]  # (h, c) or h
                own = params[layer * dirs * self.stride : (layer + 1) * dirs * self.stride]
                result = self.op(
                    x, states, own, self.has_biases, 1, 0.0, False, self.bidirectional, self.batch_first
                )
                out = result[0]
                steps = x.transpose(0, 1) if self.batch_first else x  # [T, N, I]
                outs = out.transpose(0, 1) if self.batch_first else out  # [T, N, D * H]
                first: torch.Tensor = states[0] if self.lstm else states  # [D, N, H]
                width = first.shape[-1]
                for direction in range(dirs):
                    ih = RecurrentRole(layer, direction, "ih")
                    if ih in wanted:
                        found[ih] = steps.reshape(-1, steps.shape[-1])
                    hh = RecurrentRole(layer, direction, "hh")
                    if hh in wanted:
                        mine = outs[..., direction * width : (direction + 1) * width]
                        before = mine[:-1] if direction == 0 else mine[1:]
                        found[hh] = torch.cat([first[direction].unsqueeze(0), before]).reshape(-1, width)
                x = out
        return found


def recurrent_layout(node: Node) -> RecurrentLayout | None:
    """The layout of ``node`` when it is a recurrent op whose weights' rows can be computed: its
    flags constant, its input batched ``[T, N, I]``-like (torch.nn adds the batch dimension before
    the op), its params a whole number of layers and directions; not in training with dropout."""
    if str(node.target) not in RECURRENT_OPS or len(node.args) != 9 or node.kwargs:
        return None
    flags = node.args[_FLAGS]
    if any(isinstance(a, Node) for a in flags) or not isinstance(node.args[2], (list, tuple)):
        return None
    has_biases, num_layers, dropout, train, bidirectional, batch_first = flags
    if (train and dropout) or not isinstance(num_layers, int):
        return None
    lstm = str(node.target) == "aten.lstm.input"
    directions = 2 if bidirectional else 1
    cells = num_layers * directions
    count = len(node.args[2])
    if cells <= 0 or count % cells:
        return None
    stride = count // cells
    if stride not in ((4, 5) if lstm and has_biases else (2, 3) if lstm else (4,) if has_biases else (2,)):
        return None
    return RecurrentLayout(
        op=node.target,
        lstm=lstm,
        has_biases=bool(has_biases),
        num_layers=num_layers,
        bidirectional=bool(bidirectional),
        batch_first=bool(batch_first),
        stride=stride,
    )
