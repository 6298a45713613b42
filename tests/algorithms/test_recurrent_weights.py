"""The weight algorithms on recurrent ops (LSTM, GRU, RNN): each ``w_ih``/``w_hh`` is a linear
layer over rows the op computes inside (:mod:`_quantplug.graph.recurrent`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.graph.recurrent import RecurrentLayout, RecurrentRole, recurrent_layout
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}


def _module(kind: str, bidirectional: bool, batch_first: bool, proj: int, bias: bool) -> nn.RNNBase:
    torch.manual_seed(0)
    extra: dict[str, Any] = {"proj_size": proj} if proj else {}
    if kind.startswith("rnn"):
        extra["nonlinearity"] = kind[4:]
    return CELLS[kind](
        5, 6, num_layers=2, bias=bias, batch_first=batch_first, bidirectional=bidirectional, **extra
    )


def _cell_states(
    kind: str, module: nn.RNNBase, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None
) -> list[list[torch.Tensor]]:
    """Each (layer, direction)'s layer input per step and the state each step starts from,
    stepped by hand from the cell equations (nothing of the op or of quantplug): ``[ih, hh]``
    rows per (layer, direction), in the module's params order."""
    dirs = 2 if module.bidirectional else 1
    steps = x.transpose(0, 1) if module.batch_first else x  # [T, N, I]
    found: list[list[torch.Tensor]] = []
    for layer in range(module.num_layers):
        outputs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
            b_ih = getattr(module, "bias_ih" + sfx, torch.zeros(w_ih.shape[0]))
            b_hh = getattr(module, "bias_hh" + sfx, torch.zeros(w_hh.shape[0]))
            h, c = h0[layer * dirs + d], None if c0 is None else c0[layer * dirs + d]
            order = range(steps.shape[0]) if d == 0 else reversed(range(steps.shape[0]))
            starts, outs = [], [torch.empty(0)] * steps.shape[0]
            for t in order:
                starts.append(h)
                gi, gh = steps[t] @ w_ih.T + b_ih, h @ w_hh.T + b_hh
                if kind == "lstm":
                    i, f, g, o = (gi + gh).chunk(4, -1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                    if module.proj_size:
                        h = h @ getattr(module, "weight_hr" + sfx).T
                elif kind == "gru":
                    ir, iz, in_ = gi.chunk(3, -1)
                    hr, hz, hn = gh.chunk(3, -1)
                    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
                    h = (1 - z) * torch.tanh(in_ + r * hn) + z * h
                else:
                    h = torch.tanh(gi + gh) if kind == "rnn_tanh" else torch.relu(gi + gh)
                outs[t] = h
            found.append([steps.reshape(-1, steps.shape[-1]), torch.stack(starts).reshape(-1, h.shape[-1])])
            outputs.append(torch.stack(outs))
        steps = torch.cat(outputs, -1)
    return found


CASES = [
    ("lstm", False, True, 0, True),
    ("lstm", True, False, 0, True),
    ("lstm", True, True, 3, True),
    ("lstm", False, True, 0, False),
    ("gru", True, True, 0, True),
    ("gru", False, False, 0, False),
    ("rnn_tanh", True, True, 0, True),
    ("rnn_relu", False, True, 0, True),
]


@pytest.mark.parametrize(("kind", "bidirectional", "batch_first", "proj", "bias"), CASES)
def test_each_weight_gets_the_rows_it_multiplies(
    kind: str, bidirectional: bool, batch_first: bool, proj: int, bias: bool
) -> None:
    """Layer by layer re-running gives, per weight, exactly what the cell equations multiply it
    with: the layer's input at every step, and the state every step starts from (a reverse
    direction's from the end; a projected LSTM's the projection), from a given initial state."""
    module = _module(kind, bidirectional, batch_first, proj, bias).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 5, generator=g)  # batch_first: 3 sequences of 4 steps; else 3 steps of 4
    cells = module.num_layers * (2 if bidirectional else 1)
    h0 = torch.randn(cells, x.shape[0 if batch_first else 1], proj or 6, generator=g)
    c0 = torch.randn(cells, h0.shape[1], 6, generator=g) if kind == "lstm" else None
    hx = (h0, c0) if c0 is not None else h0
    program = torch.export.export(module, (x, hx))
    (node,) = [
        n for n in program.graph.nodes if str(n.target).startswith(("aten.lstm", "aten.gru", "aten.rnn"))
    ]
    layout = recurrent_layout(node)
    assert isinstance(layout, RecurrentLayout) and layout.has_biases == bias
    roles = [layout.role(i) for i in range(len(module._flat_weights))]
    wanted = {r for r in roles if r is not None}
    assert len(wanted) == 2 * cells  # w_ih and w_hh of each (layer, direction); not biases, not w_hr
    rows = layout.layer_inputs((x, [h0, c0] if c0 is not None else h0, module._flat_weights), wanted)
    expected = _cell_states(kind, module, x, h0, c0)
    for cell in range(cells):
        layer, direction = divmod(cell, 2 if bidirectional else 1)
        for kind_index, role_kind in enumerate(("ih", "hh")):
            got = rows[RecurrentRole(layer, direction, role_kind)]
            want = expected[cell][kind_index]
            # rows are a set for H = sum x x^T: compare in a canonical order
            assert got.shape == want.shape
            assert torch.allclose(got.sum(0), want.sum(0), atol=1e-5)
            assert torch.allclose(got.T @ got, want.T @ want, atol=1e-4)


def test_an_op_in_training_with_dropout_has_no_layout() -> None:
    """A re-run would draw other dropout masks than the calibration forward did."""
    module = nn.LSTM(5, 6, num_layers=2, dropout=0.5).train()
    program = torch.export.export(module, (torch.randn(4, 3, 5),))
    (node,) = [n for n in program.graph.nodes if str(n.target) == "aten.lstm.input"]
    assert node.args[6] and recurrent_layout(node) is None


class Speech(nn.Module):
    """A 2-layer LSTM over 24 steps and a head: most parameters are the LSTM's."""

    def __init__(self, cell: type[nn.RNNBase] = nn.LSTM, **options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(16, 32, num_layers=2, batch_first=True, **options)
        width = 32 * (2 if options.get("bidirectional") else 1)
        self.head = nn.Linear(options.get("proj_size") or width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _batches(count: int, seed: int) -> list[torch.Tensor]:
    """Features correlated as real ones are (independent ones leave GPTQ nothing to correct)."""
    mixing = torch.randn(16, 16, generator=torch.Generator().manual_seed(9)) / 4
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 24, 16, generator=g) @ mixing for _ in range(count)]


def _quantize(model: nn.Module, algorithms: list[Any], guard: bool = True) -> Any:
    program = torch.export.export(model, (_batches(1, 0)[0],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(program, quantizer, algorithms=quantplug.Algorithms(algorithms, guard=guard))
    with torch.no_grad():
        for b in _batches(6, 1):
            prepared(b)
    return prepared, quantplug.convert(prepared)


def _sqnr(model: nn.Module, quantized: Any) -> float:
    with torch.no_grad():
        ref = torch.cat([model(b) for b in _batches(3, 2)])
        out = torch.cat([quantized(b) for b in _batches(3, 2)])
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _weights(converted: Any) -> dict[str, torch.Tensor]:
    """The integer codes the converted program dequantizes, by their constant's name."""
    return {
        str(n.args[0].target): getattr(converted, str(n.args[0].target))
        for n in converted.graph.nodes
        if n.op == "call_function" and "dequantize_per" in str(n.target) and n.args[0].op == "get_attr"
    }


@pytest.mark.parametrize("algorithm", ["gptq", "seq_mse", "adaround"])
def test_an_lstms_weights_are_chosen_and_the_model_gains(algorithm: str) -> None:
    """Every w_ih and w_hh gets collected rows and its own choice: the model gains over round
    to nearest on held-out sequences, and the choice reaches the weights' codes. Before, only the
    head (a twentieth of the parameters) was chosen."""
    model = Speech().eval()
    _, default = _quantize(model, [])
    prepared, chosen = _quantize(model, [algorithm], guard=False)
    run = prepared.meta[RUN_KEY]
    lstm_sites = [name for name, _ in run.collectors if name.startswith("rnn.")]
    assert sorted(lstm_sites) == sorted(f"rnn.weight_{k}_l{layer}" for k in ("ih", "hh") for layer in (0, 1))
    assert all(
        c.result() is not None for name, _ in run.collectors for c in run.collectors[(name, _)].values()
    )
    assert _sqnr(model, chosen) > _sqnr(model, default) + 1.0


def _recurrent_codes_changed(default: Any, chosen: Any) -> set[str]:
    before, after = _weights(default), _weights(chosen)
    assert before.keys() == after.keys()
    return {k for k in before if k.startswith("rnn_") and not torch.equal(before[k], after[k])}


@pytest.mark.parametrize(
    ("cell", "options"),
    [(nn.GRU, {"bidirectional": True}), (nn.LSTM, {"proj_size": 12}), (nn.RNN, {"bias": False})],
)
def test_bidirectional_projected_and_biasless_cells_with_sequential_inputs(
    cell: type[nn.RNNBase], options: dict[str, Any]
) -> None:
    """GPTQ on sequential inputs (the simulation feeds the op's arguments, with the weights
    quantized so far) then bias correction: both reach the recurrent weights; a projected LSTM's
    w_hr, whose input the op never returns, keeps round to nearest."""
    model = Speech(cell, **options).eval()
    _, default = _quantize(model, [])
    algorithms: list[Any] = [("gptq", {"sequential": True}), "bias_correction"]
    _, chosen = _quantize(model, algorithms, guard=False)
    changed = _recurrent_codes_changed(default, chosen)
    directions = ("", "_reverse") if options.get("bidirectional") else ("",)
    expected = {
        f"rnn_weight_{k}_l{layer}{d}_q0" for k in ("ih", "hh") for layer in (0, 1) for d in directions
    }
    assert changed == expected
    if options.get("proj_size"):
        assert "rnn_weight_hr_l0_q0" in _weights(default)  # quantized, at its default codes
    assert _sqnr(model, chosen) > _sqnr(model, default)


def test_an_lstm_with_algorithms_lowers_to_what_the_program_computes() -> None:
    """The artifact ONNX Runtime runs holds the chosen int4 recurrent weights and computes what
    the converted program does."""
    pytest.importorskip("onnxruntime")
    import numpy as np
    import onnxruntime as ort

    model = Speech().eval()
    _, converted = _quantize(model, ["gptq"])
    artifact = quantplug.lower(converted, quantplug.get_quantizer("reference", preset="weight_only_int4"))
    session = ort.InferenceSession(artifact.files["model.onnx"])
    x = _batches(1, 5)[0]
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = converted(x).numpy()
    assert np.allclose(got, want, atol=1e-4)


class SharedDepth(nn.Module):
    """One linear applied three times (ALBERT's shared layers; an unrolled recurrence's W_hh)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.shared(x))
        return self.head(x)


def test_a_weight_applied_at_several_nodes_collects_every_nodes_rows() -> None:
    """The shared weight is one site whose tied nodes are its other applications: GPTQ's
    Hessian sums the rows of all three (not the first application's alone)."""
    from _quantplug.algorithms.sites import weight_sites
    from _quantplug.algorithms.weight_layers import LayerHessian
    from _quantplug.meta import STATE_KEY

    model = SharedDepth().eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) @ torch.randn(16, 16) / 4
    program = torch.export.export(model, (x,))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(program, quantizer, algorithms=quantplug.Algorithms(["gptq"], guard=False))
    with torch.no_grad():
        prepared(x)
    sites = {ref.site.name: ref.site for ref in weight_sites(prepared, prepared.meta[STATE_KEY])}
    assert len(sites["shared.weight"].layer_nodes) == 3 and sites["head.weight"].tied == ()
    run = prepared.meta[RUN_KEY]
    (made,) = [made for (name, _), made in run.collectors.items() if name == "shared.weight"]
    (collector,) = made.values()
    assert isinstance(collector, LayerHessian)
    hessian = collector.hessian
    assert hessian is not None and hessian.rows == 3 * 8
    with torch.no_grad():
        inputs = [x]
        for _ in range(2):
            inputs.append(torch.tanh(model.shared(inputs[-1])))
        want = sum(i.double().T @ i.double() for i in inputs)
    assert torch.allclose(hessian.sum, want, rtol=1e-6, atol=1e-8)
    converted = quantplug.convert(prepared)
    with torch.no_grad():
        assert converted(x).shape == (8, 4)
