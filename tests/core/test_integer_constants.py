"""Issue 11.5: every quantized constant of a converted program is stored as integers.

Reproductions of what stayed float and was quantized at every forward: an embedding table whose
looked-up rows share its encoding (one sharing group holding a weight and an activation), every
weight after ``prepare(..., qat=True)``, per-block weights under QAT, and constants computed from
weights or created in the graph (a transposed weight, an LSTM's ``zeros`` initial state).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.flow.inspect import encodings
from _quantplug.graph.attrs import fetch_attr
from _quantplug.graph.constants import constant_nodes, constant_test, module_attr
from tests.zoo.integer_weights import (
    constants_quantized_at_run_time,
    float_quantized_constants,
    integer_constants,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


def _ids(gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randint(0, 20, (2, 5), generator=gen),)


def _quantize(model: nn.Module, draw: Any, quantizer: Any, *, qat: bool = False, batches: int = 4) -> Any:
    gen = _gen()
    ep = torch.export.export(model.eval(), draw(gen))
    prepared = quantplug.prepare(ep, quantizer, qat=qat)
    for _ in range(batches):
        prepared(*draw(gen))
    return prepared, quantplug.convert(prepared)


def _assert_integer_constants(converted: torch.fx.GraphModule) -> None:
    assert constants_quantized_at_run_time(converted) == []
    assert float_quantized_constants(converted) == []


SHARED_TABLE = {
    "qnn_htp-8a8w": ("qnn_htp", {"precision": "8a8w"}),
    "qnn_htp-16a8w": ("qnn_htp", {"precision": "16a8w"}),
    "reference-int8_per_tensor": ("reference", {"preset": "int8_per_tensor"}),
}


@pytest.mark.parametrize(("backend", "options"), SHARED_TABLE.values(), ids=SHARED_TABLE.keys())
def test_embedding_table_sharing_its_output_encoding_is_stored_as_integers(
    backend: str, options: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model = EmbeddingNet().eval()
    _, converted = _quantize(model, _ids, quantplug.get_quantizer(backend, **options))
    _assert_integer_constants(converted)
    table = next(t for t in integer_constants(converted) if fetch_attr(converted, t).shape == (20, 16))
    entries = encodings(converted)
    stored = next(e for e in entries if e["tensor"] == table.replace(".", "_") or e["tensor"] == table)
    looked_up = next(e for e in entries if e["tensor"] == "embedding" and e["kind"] == "activation")
    # one encoding for both: the table's integers and the looked-up rows' quantize agree
    assert stored["kind"] == "constant"
    assert stored["group"] == looked_up["group"]
    assert (stored["scale"], stored["zero_point"], stored["dtype"]) == (
        looked_up["scale"],
        looked_up["zero_point"],
        looked_up["dtype"],
    )
    # the stored integers are the table on that grid, and the program still computes the model
    scale, zero_point = stored["scale"], stored["zero_point"]
    expected = torch.clamp(
        torch.round(model.emb.weight.detach() / scale) + zero_point, stored["quant_min"], stored["quant_max"]
    )
    assert torch.equal(fetch_attr(converted, table).to(torch.int64), expected.to(torch.int64))
    idx = _ids(_gen(7))
    with torch.no_grad():
        ref, out = model(*idx), converted(*idx)
    assert float((ref - out).pow(2).mean() / ref.pow(2).mean()) < 0.1


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).mean((2, 3))
        return self.head(torch.relu(self.fc(y)))


def _image(gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8, 8, generator=gen),)


QAT = {
    "reference-int8": ("reference", {"preset": "int8"}),
    "reference-weight_only_int4": ("reference", {"preset": "weight_only_int4", "group_size": 16}),
    "qnn_htp-8a8w": ("qnn_htp", {"precision": "8a8w", "qat": True}),
    "qnn_htp-16a8w-per_tensor": ("qnn_htp", {"precision": "16a8w", "qat": True, "per_channel_conv": False}),
    "qnn_htp-16a4w_block": ("qnn_htp", {"precision": "16a4w_block", "qat": True, "block_size": 16}),
}


@pytest.mark.parametrize(("backend", "options"), QAT.values(), ids=QAT.keys())
def test_qat_weights_are_integers_after_convert(backend: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ConvLinear()
    prepared, converted = _quantize(model, _image, quantplug.get_quantizer(backend, **options), qat=True)
    _assert_integer_constants(converted)
    stored = integer_constants(converted)
    weights = [t for t in stored if fetch_attr(converted, t).dim() >= 2]
    assert len(weights) >= (3 if backend == "qnn_htp" or options["preset"] == "int8" else 2), stored
    kinds = {e["tensor"]: e["kind"] for e in encodings(converted)}
    for target in weights:
        assert kinds[target.replace(".", "_")] == "constant", target
    if "16a4w_block" in options.values():  # per-block weights too
        assert any(e["granularity"] == "block" and e["kind"] == "constant" for e in encodings(converted))
    # the integers are those the fake-quantized training graph computed with: the same outputs
    # up to the rounding of the int32 bias and of the output's step (1/256 of its range)
    x = _image(_gen(9))
    with torch.no_grad():
        fake, real = prepared(*x), converted(*x)
    assert float((fake - real).abs().max()) < 4 / 256 * float(fake.abs().max() + 1)


class ConstantSubgraphs(nn.Module):
    """A weight scaled and used transposed by a matmul (``x @ W.t()`` alone is a linear now:
    ``_quantplug.rewrites.hand_written_linear``), and an LSTM whose initial state is ``zeros``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16) / 4)
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, (self.w * 0.5).t())
        out, _ = self.lstm(y)
        return out


def _sequence(gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(2, 6, 16, generator=gen),)


@pytest.mark.parametrize("precision", ["8a8w", "16a16w"])
def test_constants_computed_in_the_graph_are_folded(precision: str) -> None:
    torch.manual_seed(0)
    model = ConstantSubgraphs().eval()
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision=precision)
    prepared, converted = _quantize(model, _sequence, q)
    assert constants_quantized_at_run_time(prepared) == [], "prepare quantized nothing yet"
    _assert_integer_constants(converted)
    transposed = [t for t in integer_constants(converted) if fetch_attr(converted, t).shape == (16, 8)]
    assert transposed, integer_constants(converted)
    x = _sequence(_gen(3))
    with torch.no_grad():
        ref, out = model(*x), converted(*x)
    # the LSTM is quantized too (qnn_htp unrolls it), calibrated on two sequences: 17 dB and up
    assert float((ref - out).pow(2).mean() / ref.pow(2).mean()) < 2e-2


class AddBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


class OutputOfBuffer:
    """A PT2E-style quantizer annotating only a buffer's output (its consumer stays float)."""

    def annotate(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        from _quantplug.observers.minmax import MinMaxObserver
        from quantplug import QuantizationSpec, annotate_node

        spec = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-127,
            quant_max=127,
            qscheme=torch.per_tensor_symmetric,
            observer_or_fake_quant_ctr=MinMaxObserver.with_args(),
        )
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                annotate_node(node, output_qspec=spec)
        return gm

    def validate(self, gm: torch.fx.GraphModule) -> None:
        pass


def test_a_quantized_buffer_output_reaches_its_unannotated_consumers() -> None:
    """A constant group's node key (a buffer annotated with an output spec) is quantized for every
    consumer, not only for annotated edges (it used to reach an unannotated add as float)."""
    model = AddBuffer().eval()
    _, converted = _quantize(model, lambda g: (torch.randn(2, 8, generator=g),), OutputOfBuffer())
    _assert_integer_constants(converted)
    (stored,) = integer_constants(converted)
    assert fetch_attr(converted, stored).dtype == torch.int8
    add = next(n for n in converted.graph.nodes if n.target == torch.ops.aten.add.Tensor)
    assert "dequantize" in str(add.args[1].target)
    x = torch.zeros(1, 8)
    expected = torch.round(model.offset / (1 / 127)) * (1 / 127)  # symmetric, max |offset| = 1
    torch.testing.assert_close(converted(x)[0], expected, rtol=0, atol=1e-6)


class NoGradTable(nn.Module):
    """A table computed from a buffer and fixed positions in a no-grad region (Llama's rotary
    embeddings): torch.export wraps it in a ``wrap_with_set_grad_enabled`` subgraph."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            table = torch.cos(torch.arange(6, dtype=torch.float32)[:, None] * self.freq)
        return x * table


def test_constants_computed_in_a_no_grad_region_are_folded() -> None:
    torch.manual_seed(0)
    model = NoGradTable().eval()
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    prepared, converted = _quantize(model, _sequence, q)
    assert any("wrap_with_set_grad_enabled" in str(n.target) for n in prepared.graph.nodes)
    _assert_integer_constants(converted)
    assert not any("wrap_with_set_grad_enabled" in str(n.target) for n in converted.graph.nodes)
    x = _sequence(_gen(3))
    with torch.no_grad():
        ref, out = model(*x), converted(*x)
    assert float((ref - out).pow(2).mean() / ref.pow(2).mean()) < 1e-2


class RunningState(nn.Module):
    """A buffer the model updates in place at every forward (a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x + self.state)
        self.state.copy_(self.state + 0.25)
        return y


@pytest.mark.parametrize("precision", ["8a8w", "16a8w"])
def test_a_buffer_the_model_writes_is_not_frozen_into_integers(precision: str) -> None:
    """Only what no op writes is a constant: a state the model updates in place stays a buffer
    that the converted program reads at every forward, where the one copy_ writes; folded into
    integers at convert it would be frozen at its value after calibration. Its reads stay float
    (quantized on the range of the calibration calls they would clamp later values)."""
    torch.manual_seed(0)
    model = RunningState().eval()
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision=precision)
    _, converted = _quantize(model, lambda g: (torch.randn(4, 8, generator=g),), q)
    (state,) = [n for n in converted.graph.nodes if n.op == "get_attr" and n.target == "state"]
    assert state.users and not any("quantize" in str(u.target) for u in state.users)  # read live, float
    assert any(u.target == torch.ops.aten.copy_.default for u in state.users)  # and written
    assert not [t for t in integer_constants(converted) if t.startswith("state")]


class DashedBlock(nn.Module):
    """Module names that are no identifiers (torchvision's RegNet: ``trunk_output.block1.block1-0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("block1-0", nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(getattr(self, "block1-0")(x).mean((2, 3)))


def test_stored_integers_are_named_by_identifiers_and_lower() -> None:
    """The integer tensors (of batch-norm-folded weights too) get attribute names that generated
    code can use as arguments: lowering re-exports the program and lifts them to inputs."""
    torch.manual_seed(0)
    model = DashedBlock().eval()
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    _, converted = _quantize(model, _image, quantizer)
    targets = [str(n.target) for n in converted.graph.nodes if n.op == "get_attr"]
    assert targets and all(t.isidentifier() for t in targets), targets
    assert quantplug.lower(converted, quantizer).files["model.onnx"]


class TwiceReadBias(nn.Module):
    """One weight and bias read by two linears, on the same input or on a scaled copy."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.nn.functional.linear(x * self.scale, self.fc.weight, self.fc.bias)


def _row(gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(4, 8, generator=gen),)


@pytest.mark.parametrize(("scale", "stored"), [(1.0, 1), (3.0, 2)])
def test_a_constant_read_under_equal_qparams_is_stored_once(scale: float, stored: int) -> None:
    """Each read of a bias gets its own derived group (input scale times weight scale); reads
    whose qparams are equal hold the same integers, which are stored once (a GRU's ``b_hn`` at
    every unrolled step), and reads whose qparams differ keep their own."""
    torch.manual_seed(0)
    model = TwiceReadBias(scale).eval()
    quantizer = quantplug.get_quantizer("qnn_htp", precision="8a8w")
    _, converted = _quantize(model, _row, quantizer)
    biases = [n for n in converted.graph.nodes if n.op == "get_attr" and str(n.target).startswith("fc_bias")]
    assert len(biases) == stored, [str(n.target) for n in biases]
    _assert_integer_constants(converted)
    reads = [dq for n in biases for dq in n.users]
    assert len(reads) == 2  # each read still dequantizes on its own, with its own scale
    for dq in reads:  # ...to the float bias, within half its step
        args = [fetch_attr(converted, str(a.target)) if isinstance(a, torch.fx.Node) else a for a in dq.args]
        step = args[1] if isinstance(args[1], float) else args[1].max()
        assert float((dq.target(*args) - model.fc.bias).abs().max()) <= step / 2 + 1e-12


@pytest.fixture(scope="module")
def constant_graphs() -> list[torch.fx.GraphModule]:
    """Exported graphs holding every kind of constant: parameters, a transposed weight, an LSTM's
    ``zeros`` state (an op without inputs) and a no-grad region's table."""
    torch.manual_seed(0)
    return [
        torch.export.export(model.eval(), _sequence(_gen())).module()
        for model in (ConstantSubgraphs(), NoGradTable())
    ]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.randoms(use_true_random=False))
def test_constant_test_answers_as_constant_nodes_in_any_order(
    constant_graphs: list[torch.fx.GraphModule], order: Any
) -> None:
    """convert asks only its quantizes: the lazy test gives the whole-graph analysis' answer for
    every node, whichever nodes are asked first, and reads only the parameters it reaches."""
    for gm in constant_graphs:
        _check_constant_test(gm, order)


def _check_constant_test(gm: torch.fx.GraphModule, order: Any) -> None:
    nodes = list(gm.graph.nodes)
    expected = constant_nodes(gm.graph, module_attr(gm))
    assert any(n.op == "call_function" for n in expected)  # computed constants, not only get_attr
    read: list[str] = []

    def attr(target: str) -> Any:
        read.append(target)
        return module_attr(gm)(target)

    test = constant_test(attr)
    first = next(n for n in nodes if n.op == "call_function" and n not in expected)
    assert not test(first) and read == [], "an activation's first input decides it"
    order.shuffle(nodes)
    assert [test(n) for n in nodes] == [n in expected for n in nodes]
    assert set(read) == {str(n.target) for n in nodes if n.op == "get_attr"}
