"""LSTM, GRU and RNN ops unrolled over their time steps into ops HTP quantizes one by one.

An exported ``nn.LSTM`` is one ``aten.lstm.input`` node. QNN's HTP backend has no quantized
recurrent op to map it to, and ExecuTorch's QnnQuantizer has no rule for it: the whole layer,
often most of a speech or sequence model's weights, stayed float (``float_tensors`` in the
report). QNN's own converter expands an LSTM into its arithmetic for HTP
(``--expand_lstm_op_structure``); this pass does the same before annotation, so every weight gets
the precision's weight quantization and every gate its activation encoding:

* per layer and direction, the input projection of the whole sequence is one ``linear``
  (``W_ih``, with the biases that do not depend on the state folded into its bias: ``b_ih +
  b_hh`` for LSTM and RNN, GRU's ``b_hr``/``b_hz`` too);
* per step, ``select`` the step's projected row, ``linear(h, W_hh)`` (GRU's ``b_hn`` kept there:
  ``r`` multiplies it), ``add``, ``slice`` the gates, ``sigmoid``/``tanh``, and the cell update
  with ``mul``/``add``/``sub``; a projected LSTM's ``linear(h, W_hr)``;
* ``stack`` of the steps' states (a reverse direction's in input order), ``cat`` of the
  directions, ``stack`` of the final states for ``h_n``/``c_n``.

``W_hh`` (and ``W_hr``) is one constant read at every step: one encoding, one copy in the
artifact; the weight algorithms see every step's input as rows of that one layer
(:attr:`quantplug.algorithms.WeightSite.tied`). Numerically the unrolled form is the op's own
arithmetic (equal up to float rounding order).

A tensor of a step (a gate, the cell state, the ``W_hh`` product) shares one encoding with the
same tensor of every other step (:func:`share_steps`), as QNN's and AIMET's recurrent encodings
have it (a gate is one tensor over time: one scale, whichever step), and its observer sees every
step. A moving
average (``act_observer``'s default) then updates once per calibration batch over all steps
(``SharingGroups.observed_per_pass``): updated at each step, the first one, from the zero
state, would outweigh the rest.

An op is left whole (float, as before) in training with dropout, with
``unroll_recurrent=False``, or when its sequence length is not a static integer (torch.export
specializes an LSTM's length today; a dynamic batch unrolls).
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch.fx import GraphModule, Node

from quantplug.backend import (
    BackendContext,
    Key,
    RecurrentLayout,
    SharingGroups,
    SharingProblem,
    constant_value,
    recurrent_layout,
)
from quantplug_qnn_htp.decompositions import _Builder, _shape

aten = torch.ops.aten

#: node meta: which node of a step this is (``"<op node>/<cell>/<k>"``), the same at every step
STEP_ROLE_KEY = "qnn_htp_recurrent_role"

#: gates per cell: LSTM (input, forget, cell, output), GRU (reset, update, new), RNN (one)
_GATES = {"aten.lstm.input": 4, "aten.gru.input": 3, "aten.rnn_tanh.input": 1, "aten.rnn_relu.input": 1}


def _parameter_name(node: Node) -> str:
    """A parameter node's name as a buffer name: ``rnn.bias_ih_l0`` -> ``rnn_bias_ih_l0``."""
    target = node.target if node.op == "get_attr" else node.name
    return str(target).replace(".", "_")


class _Cell:
    """One layer and direction of a recurrent op, its parameters as graph nodes."""

    def __init__(self, b: _Builder, kind: str, params: list[Any], layout: RecurrentLayout) -> None:
        self.b = b
        self.kind = kind
        self.w_ih, self.w_hh = params[0], params[1]
        projected = layout.lstm and layout.stride in (3, 5)
        self.w_hr = params[-1] if projected else None
        self.hidden = int(_shape(self.w_hh)[0]) // _GATES[kind]
        self.bias_x, self.bias_h = self._biases(params[2:4] if layout.has_biases else None)

    def _biases(self, biases: list[Any] | None) -> tuple[Any, Any]:
        """(the input projection's bias, the state product's bias): what does not depend on the
        state is added once per sequence instead of once per step."""
        if biases is None:
            return None, None
        b_ih, b_hh = (constant_value(p) for p in biases)
        if b_ih is None or b_hh is None:  # not constants: each where the op adds it
            return biases[0], biases[1]
        # named after the module's parameters, as the encodings list them: rnn.bias_ih_l0 and
        # rnn.bias_hh_l0 folded -> rnn_bias_ih_l0_plus_hh (GRU: _plus_hh_rz, and bias_hh_l0_n)
        ih, hh = (_parameter_name(p) for p in biases)
        with torch.no_grad():
            if self.kind != "aten.gru.input":
                return self.b.constant(f"{ih}_plus_hh", (b_ih + b_hh).detach(), exact=True), None
            h = self.hidden
            folded = b_ih.detach().clone()
            folded[: 2 * h] += b_hh.detach()[: 2 * h]
            kept = torch.zeros_like(b_hh.detach())
            kept[2 * h :] = b_hh.detach()[2 * h :]
        return (
            self.b.constant(f"{ih}_plus_hh_rz", folded, exact=True),
            self.b.constant(f"{hh}_n", kept, exact=True),
        )

    def _gate(self, x: Node, index: int, count: int = 1) -> Node:
        h = self.hidden
        return self.b.call(aten.slice.Tensor, x, 1, index * h, (index + count) * h)

    def step(self, row: Node, h: Node, c: Node | None) -> tuple[Node, Node | None]:
        """The state after one step from ``h`` (and ``c``), ``row`` the step's input projection."""
        b = self.b
        state = b.call(aten.linear.default, h, self.w_hh, self.bias_h)
        if self.kind == "aten.gru.input":
            rz = b.call(
                aten.sigmoid.default, b.call(aten.add.Tensor, self._gate(row, 0, 2), self._gate(state, 0, 2))
            )
            r, z = self._gate(rz, 0), self._gate(rz, 1)
            n = b.call(
                aten.tanh.default,
                b.call(aten.add.Tensor, self._gate(row, 2), b.call(aten.mul.Tensor, r, self._gate(state, 2))),
            )
            # (1 - z) * n + z * h, with one product
            return b.call(aten.add.Tensor, n, b.call(aten.mul.Tensor, z, b.call(aten.sub.Tensor, h, n))), None
        gates = b.call(aten.add.Tensor, row, state)
        if self.kind != "aten.lstm.input":
            act = aten.tanh.default if self.kind == "aten.rnn_tanh.input" else aten.relu.default
            return b.call(act, gates), None
        i, f, g, o = (self._gate(gates, k) for k in range(4))
        i, f, o = (b.call(aten.sigmoid.default, t) for t in (i, f, o))
        g = b.call(aten.tanh.default, g)
        c = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, f, cast(Node, c)), b.call(aten.mul.Tensor, i, g))
        h = b.call(aten.mul.Tensor, o, b.call(aten.tanh.default, c))
        if self.w_hr is not None:
            h = b.call(aten.linear.default, h, self.w_hr)
        return h, c


def _unroll(b: _Builder, node: Node, layout: RecurrentLayout) -> tuple[Node, ...] | None:
    x, hx, params = node.args[0], node.args[1], list(node.args[2])  # type: ignore[arg-type]
    shape = _shape(x)
    time = 1 if layout.batch_first else 0
    if len(shape) != 3 or not isinstance(shape[time], int) or shape[time] < 1:
        return None  # a dynamic (or empty) time dimension cannot be unrolled
    states = list(hx) if layout.lstm else [hx]  # type: ignore[arg-type]
    if not all(isinstance(n, Node) for n in [x, *states, *params]):
        return None
    steps = int(shape[time])
    kind = str(node.target)
    dirs = layout.directions
    sequence: Node = x  # type: ignore[assignment]
    finals: list[list[Node]] = [[] for _ in states]
    for layer in range(layout.num_layers):
        outputs = []
        for direction in range(dirs):
            index = layer * dirs + direction
            cell = _Cell(b, kind, params[index * layout.stride : (index + 1) * layout.stride], layout)
            h = b.call(aten.select.int, states[0], 0, index)
            c = b.call(aten.select.int, states[1], 0, index) if layout.lstm else None
            projected = b.call(aten.linear.default, sequence, cell.w_ih, cell.bias_x)
            per_step: list[Node] = [h] * steps
            for t in range(steps) if direction == 0 else range(steps - 1, -1, -1):
                b.created = []
                h, c = cell.step(b.call(aten.select.int, projected, time, t), h, c)
                for k, made in enumerate(b.created):  # every step makes the same nodes in order
                    made.meta[STEP_ROLE_KEY] = f"{node.name}/{index}/{k}"
                b.created = None
                per_step[t] = h
            outputs.append(b.call(aten.stack.default, per_step, time))
            finals[0].append(h)
            if c is not None:
                finals[1].append(c)
        sequence = outputs[0] if dirs == 1 else b.call(aten.cat.default, outputs, -1)
    return (sequence, *(b.call(aten.stack.default, f, 0) for f in finals))


def unroll_recurrent(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Unroll every LSTM/GRU/RNN op of ``gm`` with a static sequence length (module docstring)."""
    if context is not None and not context.option("unroll_recurrent"):
        return
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or str(node.target) not in _GATES:
            continue
        layout = recurrent_layout(node)
        if layout is None or any(u.target is not operator.getitem for u in node.users):
            continue
        builder = _Builder(gm, node, f"{node.name} ({node.target})")
        outputs = _unroll(builder, node, layout)
        if outputs is None:
            continue
        for user in list(node.users):
            user.replace_all_uses_with(outputs[cast(int, user.args[1])])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def share_steps(problem: SharingProblem) -> SharingProblem:
    """``problem`` asking that each unrolled step's tensors share the encoding of the same
    tensor at the other steps (the module docstring)."""
    graph = problem.graph
    if graph is None:
        return problem
    first: dict[str, str] = {}
    merges: list[tuple[Key, Key]] = []
    for node in graph.nodes:
        role = node.meta.get(STEP_ROLE_KEY)
        if role is None or node.name not in problem.specs:
            continue
        if role in first:
            merges.append((first[role], node.name))
        else:
            first[role] = node.name
    return problem.with_merges(merges) if merges else problem


def observe_steps_per_pass(problem: SharingProblem, groups: SharingGroups) -> SharingGroups:
    """``groups`` with every group holding a step's tensor observed per pass (one update per
    calibration batch, not per step)."""
    graph = problem.graph
    if graph is None:
        return groups
    for node in graph.nodes:
        gid = groups.group_of.get(node.name) if STEP_ROLE_KEY in node.meta else None
        if gid is not None:
            groups.observed_per_pass.add(gid)
    return groups
