"""qnn_htp unrolls LSTM/GRU/RNN ops over their steps (``quantplug_qnn_htp.recurrent``): the
float program stays what the module computes, every weight and gate is quantized, the artifact is
complete and holds each recurrent weight once, and the weight algorithms see every step."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.algorithms.sites import weight_sites
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from _quantplug.meta import STATE_KEY

pytest.importorskip("quantplug_qnn_htp")

from quantplug_qnn_htp.recurrent import unroll_recurrent

RECURRENT = ("aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input", "aten.rnn_relu.input")


class Sequence(nn.Module):
    """A recurrent layer and a head over its outputs; returns the final state too."""

    def __init__(self, cell: type[nn.RNNBase] = nn.LSTM, batch_first: bool = True, **options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(6, 8, num_layers=2, batch_first=batch_first, **options)
        width = options.get("proj_size") or 8 * (2 if options.get("bidirectional") else 1)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.rnn(x)
        return self.head(out), state[0] if isinstance(state, tuple) else state


def _batches(count: int, seed: int, steps: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, steps, 6, generator=g) for _ in range(count)]


CASES = [
    (nn.LSTM, {}),
    (nn.LSTM, {"bidirectional": True, "bias": False}),
    (nn.LSTM, {"proj_size": 5, "batch_first": False}),
    (nn.GRU, {"bidirectional": True}),
    (nn.GRU, {"bias": False}),
    (nn.RNN, {"nonlinearity": "tanh"}),
    (nn.RNN, {"nonlinearity": "relu", "bidirectional": True}),
]


@pytest.mark.parametrize(("cell", "options"), CASES)
def test_the_unrolled_float_program_computes_what_the_module_does(
    cell: type[nn.RNNBase], options: dict[str, Any]
) -> None:
    """Outputs and final states (``h_n``; ``c_n`` through the LSTM's next state) equal the
    module's, for a given non-zero initial state too."""
    model = Sequence(cell, **options).eval()
    x = _batches(1, 0)[0]
    if not model.rnn.batch_first:
        x = x.transpose(0, 1).contiguous()
    program = torch.export.export(model, (x,))
    gm = program.module()
    unroll_recurrent(gm)  # type: ignore[arg-type]
    assert not [n for n in gm.graph.nodes if str(n.target) in RECURRENT]
    with torch.no_grad():
        for got, want in zip(gm(x), model(x)):
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


class WithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(6, 8, num_layers=2)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> Any:
        return self.rnn(x, (h, c))


def test_a_given_initial_state_and_both_final_states() -> None:
    model = WithState().eval()
    args = (torch.randn(5, 2, 6), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
    gm = torch.export.export(model, args).module()
    unroll_recurrent(gm)  # type: ignore[arg-type]
    with torch.no_grad():
        got, want = gm(*args), model(*args)
    assert torch.allclose(got[0], want[0], atol=1e-5)
    for g, w in zip(got[1], want[1]):  # h_n, c_n
        assert torch.allclose(g, w, atol=1e-5)


def _quantize(model: nn.Module, precision: str = "16a4w", algorithms: Any = (), **options: Any) -> Any:
    program = torch.export.export(model, (_batches(1, 0)[0],))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision=precision, **options)
    prepared = quantplug.prepare(
        program, quantizer, algorithms=quantplug.Algorithms(list(algorithms), guard=False)
    )
    with torch.no_grad():
        for b in _batches(6, 1):
            prepared(b)
    return quantizer, prepared, quantplug.convert(prepared)


def _sqnr(model: nn.Module, quantized: Any) -> float:
    with torch.no_grad():
        ref = torch.cat([model(b)[0] for b in _batches(3, 2)])
        out = torch.cat([quantized(b)[0] for b in _batches(3, 2)])
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


@pytest.mark.parametrize(
    ("cell", "options"), [(nn.LSTM, {"proj_size": 5}), (nn.GRU, {"bidirectional": True})]
)
def test_every_recurrent_weight_and_gate_is_encoded_and_stored_once(
    cell: type[nn.RNNBase], options: dict[str, Any], tmp_path: Any
) -> None:
    """Strict lowering passes (every tensor of a quantized op has an encoding, nothing is left
    float); each recurrent weight, read at every step, is one initializer of the ONNX model and
    one entry of the encodings, the folded biases named after the parameters they hold; ONNX
    Runtime computes what the converted program does."""
    pytest.importorskip("onnxruntime")
    import numpy as np
    import onnx
    import onnxruntime as ort

    model = Sequence(cell, **options).eval()
    quantizer, _, converted = _quantize(model)
    assert not [n for n in converted.graph.nodes if str(n.target) in RECURRENT]
    artifact = quantplug.lower(converted, quantizer)  # strict
    artifact.save(tmp_path)
    report = json.loads((tmp_path / "artifact.json").read_text())["encoding_completeness"]
    assert report["complete"] and not report["float_tensors"]
    weights = [name for name, _ in model.rnn.named_parameters() if name.startswith("weight")]
    initializers = [t.name for t in onnx.load(str(tmp_path / "model.onnx")).graph.initializer]
    for name in weights:
        assert len([i for i in initializers if i.startswith(f"rnn_{name}_q")]) == 1, name
    encodings = json.loads((tmp_path / "model.encodings").read_text())
    encoded = json.dumps(encodings)
    assert all(f"rnn.{name}" in encoded or f"rnn_{name}" in encoded for name in weights)
    # the folded biases are named after the module's parameters they hold
    folded = (
        ["rnn_bias_ih_l0_plus_hh"] if cell is nn.LSTM else ["rnn_bias_ih_l0_plus_hh_rz", "rnn_bias_hh_l0_n"]
    )
    if options.get("bidirectional"):
        folded += [name.replace("_l0", "_l0_reverse") for name in folded]
    # GRU's b_hn is added at every step, each step's int32 bias derived from the same shared
    # encodings: one initializer, as W_hh is
    for name in folded:
        assert len([i for i in initializers if re.fullmatch(f"{name}_q\\d*", i)]) == 1, name
    assert all(f'"{name}' in encoded for name in folded), folded
    assert "_recurrent_bias" not in encoded
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    x = _batches(1, 5)[0]
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = converted(x)
    for g, w in zip(got, want):
        # the same program: a Q/DQ rounding step that flips with the float summation order (ORT's
        # matmuls against torch's) moves later steps by a few grid steps, a wrong op by far more
        error = float(np.square(g - w.numpy()).sum())
        assert 10 * math.log10(float(np.square(g).sum()) / max(error, 1e-30)) > 50.0


def test_unroll_recurrent_false_leaves_the_op_float() -> None:
    model = Sequence().eval()
    *_, kept = _quantize(model, unroll_recurrent=False)
    assert [n for n in kept.graph.nodes if str(n.target) == "aten.lstm.input"]


def test_a_dynamic_batch_unrolls_and_runs_at_other_batch_sizes() -> None:
    """The steps are static (torch.export specializes an LSTM's length), the batch need not be."""
    model = Sequence(nn.GRU).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (_batches(1, 0)[0],), dynamic_shapes=({0: batch},))
    quantizer = quantplug.get_quantizer("qnn_htp", precision="16a8w")
    prepared = quantplug.prepare(program, quantizer)
    for b in _batches(4, 1):
        prepared(b)
    converted = quantplug.convert(prepared)
    assert not [n for n in converted.graph.nodes if str(n.target) in RECURRENT]
    x = torch.randn(5, 7, 6)
    with torch.no_grad():
        got, want = converted(x)[0], model(x)[0]
    assert got.shape == want.shape
    assert float(10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())) > 25


def test_the_algorithms_see_every_step_of_a_tied_state_weight() -> None:
    """``W_hh`` is read at every step: one weight site whose tied nodes are the other steps, and
    GPTQ (on every step's rows) gains over round to nearest on held-out sequences."""
    model = Sequence().eval()
    _, _, default = _quantize(model)
    _, prepared, chosen = _quantize(model, algorithms=["gptq"])
    assert {"rnn.weight_hh_l0", "rnn.weight_hh_l1"} <= {name for name, _ in prepared.meta[RUN_KEY].collectors}
    sites = {ref.site.name: ref.site for ref in weight_sites(prepared, prepared.meta[STATE_KEY])}
    for layer in (0, 1):
        assert len(sites[f"rnn.weight_hh_l{layer}"].layer_nodes) == 7  # one per step
        assert sites[f"rnn.weight_ih_l{layer}"].tied == ()  # one projection of the sequence
    assert _sqnr(model, chosen) > _sqnr(model, default) + 1.0


def _prepared(steps: int, precision: str = "16a8w") -> Any:
    x = torch.randn(3, steps, 6)
    program = torch.export.export(Sequence().eval(), (x,))
    quantizer = quantplug.get_quantizer("qnn_htp", precision=precision, act_observer="moving_average")
    prepared = quantplug.prepare(program, quantizer)
    prepared(x)
    return prepared


def test_each_tensor_of_a_step_has_one_encoding_over_all_steps() -> None:
    """The encodings of an unrolled LSTM do not grow with its length, and a gate's moving average
    is told that one batch calls it once per step (so each batch is one update)."""
    short, long = _prepared(4), _prepared(9)
    assert len(short.meta[STATE_KEY].groups) == len(long.meta[STATE_KEY].groups)
    state = long.meta[STATE_KEY]
    calls = {getattr(state.observer(long, g.gid), "calls_per_pass", None) for g in state.groups if g.per_pass}
    assert 9 in calls  # a gate of one layer and direction: once per step
    assert not any(g.per_pass for g in short.meta[STATE_KEY].groups if g.constant)


def test_qat_fake_quantizes_a_shared_step_tensor_on_one_range_per_pass() -> None:
    """QAT keeps the moving average (its default): the observer inside each step group's
    fake-quant module is told the steps' calls, so one training forward pass is one update
    and every step is fake-quantized on the same range."""
    x = torch.randn(3, 9, 6)
    program = torch.export.export(Sequence().train(), (x,))
    quantizer = quantplug.get_quantizer("qnn_htp", precision="16a8w", qat=True)
    prepared = quantplug.prepare(program, quantizer, qat=True)
    state = prepared.meta[STATE_KEY]
    modules = [state.observer(prepared, g.gid) for g in state.groups if g.per_pass and not g.constant]
    assert modules
    inner = [m.activation_post_process for m in modules]
    averages = [m for m in inner if type(m).__name__ == "MovingAverageMinMaxObserver"]
    assert 9 in {m.calls_per_pass for m in averages}
    prepared(x)
    assert all(int(m.num_batches) == 1 for m in averages if m.calls_per_pass > 1)


def test_shared_steps_keep_held_out_sequences_from_clipping() -> None:
    """Per-step encodings see one step of each calibration sequence, and a moving average shared
    by the steps but updated at every call is dominated by the first step, from the zero state:
    on this LSTM at 16a8w 43.1 dB and 22.5 dB. One update per batch over all steps: 54.2 dB.
    (ExecuTorch's observer and grid, which QAT's default keeps: the default min-max observer does
    not depend on the calls' order.)"""
    model = Sequence().eval()
    _, _, converted = _quantize(model, precision="16a8w", act_observer="moving_average", act_range_margin=1.0)
    assert _sqnr(model, converted) > 50.0


def test_nan_in_a_calibration_sequence_is_named_or_left_out() -> None:
    """NaN in one step of one sequence reaches the unrolled ops: a typed error naming the
    observer's node, or with ``nonfinite="ignore"`` a finite model; the caller's program is
    not changed by the unroll."""
    model = Sequence().eval()
    x = _batches(1, 0)[0]
    program = torch.export.export(model, (x,))
    before = [str(n.target) for n in program.graph.nodes]
    bad = x.clone()
    bad[0, 3, 2] = float("nan")
    quantizer = quantplug.get_quantizer("qnn_htp", precision="16a8w")
    with pytest.raises(quantplug.NonFiniteError, match=r"NaN.*node '"):
        quantplug.prepare(program, quantizer)(bad)
    prepared = quantplug.prepare(program, quantizer, nonfinite="ignore")
    prepared(bad)
    prepared(x)
    with torch.no_grad():
        assert all(torch.isfinite(t).all() for t in quantplug.convert(prepared)(x))
    assert [str(n.target) for n in program.graph.nodes] == before
    assert "aten.lstm.input" in before
