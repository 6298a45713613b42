"""Sequential layer inputs (``sequential=True``): each layer's collectors see the inputs the quantized
model computes, with the layers before it quantized as chosen (AdaRound, AIMET's SeqMSE, GPTQ as
published), from a bounded store of calibration batches."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

import quantplug
from _quantplug.algorithms.collectors import InputSample
from _quantplug.algorithms.guard import GUARD_BATCHES, GUARD_BYTES
from _quantplug.algorithms.sequential import (
    InputStore,
    activation_quantizer,
    fake_quantize_per_tensor,
    stages,
)
from _quantplug.algorithms.spec import WeightChoice, WeightGrid, WeightSite
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from tests.core.kernel_code import simd

BATCH = 8


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        with torch.no_grad():
            for layer in (self.fc1, self.fc2):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.3)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class Recorder(quantplug.Algorithm):
    """Records each layer's collected inputs; optionally zeroes the first layer's weight."""

    name = "recorder"

    def __init__(self, sequential: bool, zero_first: bool = False) -> None:
        self.sequential = sequential
        self.zero_first = zero_first
        self.seen: dict[str, torch.Tensor] = {}

    def collector(self, site: WeightSite) -> InputSample | None:
        return InputSample(max_rows=10_000) if site.has_layer else None

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        self.seen[site.node] = collected
        if self.zero_first and site.node == "linear":
            return WeightChoice(codes=grid.expand(grid.zero_point, site.weight.shape).to(torch.int64))
        return None


def run(algorithm: Recorder, data: torch.Tensor, precision: str = "8a8w") -> GraphModule:
    """Without the algorithm guard: zeroing a weight is a choice the guard would refuse."""
    model = Mlp().eval()
    ep = torch.export.export(model, (data[:BATCH],))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision=precision)
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms([algorithm], guard=False))
    for i in range(0, len(data), BATCH):
        prepared(data[i : i + BATCH])
    converted: GraphModule = quantplug.convert(prepared)
    return converted


def quantized_input_of_second_linear(converted: GraphModule, data: torch.Tensor) -> torch.Tensor:
    """What the converted (Q/DQ) program feeds its second linear layer, over all of ``data``."""
    linears = [n for n in converted.graph.nodes if str(n.target) == "aten.linear.default"]
    second = linears[1]
    rows: list[torch.Tensor] = []

    class Probe(Interpreter):
        def run_node(self, n: Node) -> Any:
            if n is second:
                args, _ = self.fetch_args_kwargs_from_env(n)
                rows.append(args[0].detach().reshape(-1, args[0].shape[-1]))
            return super().run_node(n)

    with torch.no_grad():
        for i in range(0, len(data), BATCH):
            Probe(converted).run(data[i : i + BATCH])
    return torch.cat(rows)


def data() -> torch.Tensor:
    return torch.randn(4 * BATCH, 16, generator=torch.Generator().manual_seed(1))


def test_sequential_inputs_are_what_the_quantized_model_computes() -> None:
    x = data()
    sequential = Recorder(sequential=True)
    converted = run(sequential, x, precision="8a4w")
    expected = quantized_input_of_second_linear(converted, x)
    got = sequential.seen["linear_1"]
    step = float(expected[expected > 0].min())  # the smallest positive level of the 8-bit relu output
    assert got.shape == expected.shape
    # the converted bias is int32 (step: input scale x weight scale), the simulated one float: an
    # output near a rounding boundary (here ~2 % of them) may land one level away
    assert float((got - expected).abs().max()) <= 2 * step
    assert float((got != expected).float().mean()) < 0.05
    floating = Recorder(sequential=False)
    run(floating, x, precision="8a4w")
    assert float((floating.seen["linear_1"] - expected).abs().mean()) > 10 * float(
        (got - expected).abs().mean()
    )


def test_sequential_inputs_follow_the_codes_chosen_upstream() -> None:
    x = data()
    sequential = Recorder(sequential=True, zero_first=True)
    run(sequential, x)
    rows = sequential.seen["linear_1"]  # fc1 has all-zero weights: every row is relu(bias), quantized
    assert torch.equal(rows, rows[:1].expand_as(rows))
    floating = Recorder(sequential=False, zero_first=True)
    run(floating, x)
    assert not torch.equal(floating.seen["linear_1"], floating.seen["linear_1"][:1].expand_as(rows))


def test_sequential_prepared_module_keeps_a_bounded_input_store() -> None:
    model = Mlp().eval()
    x = torch.randn(BATCH, 16)
    ep = torch.export.export(model, (x,))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="8a8w")
    algorithms = quantplug.Algorithms([("gptq", {"sequential": True})], held_out="calibration")
    prepared = quantplug.prepare(ep, quantizer, algorithms=algorithms)  # every batch stored
    store = prepared.meta[RUN_KEY].inputs
    assert isinstance(store, InputStore)
    for _ in range(store.max_batches + 5):
        prepared(x)
    assert len(store.batches) == store.max_batches and store.seen == store.max_batches + 5
    floating = [("gptq", {"sequential": False})]
    unguarded = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(floating, guard=False))
    assert unguarded.meta[RUN_KEY].inputs is None  # float inputs, no guard: nothing stored
    guarded = quantplug.prepare(ep, quantizer, algorithms=floating).meta[RUN_KEY].inputs
    assert isinstance(guarded, InputStore)  # the guard's batches only
    assert (guarded.max_batches, guarded.max_bytes) == (GUARD_BATCHES, GUARD_BYTES)


def test_input_store_byte_cap() -> None:
    store = InputStore(max_batches=100, max_bytes=3 * 4 * 10)
    for _ in range(10):
        store(torch.zeros(10), 3)
    assert len(store.batches) == 3 and store.batches[0][1] == 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.up = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)
        return self.up(self.o(a) + x)


def test_stages_put_parallel_layers_together_and_chains_in_order() -> None:
    gm = torch.fx.symbolic_trace(Attention())
    names = {str(n.target): n.name for n in gm.graph.nodes if n.op == "call_module"}
    consumers = [names["up"], names["v"], names["o"], names["q"], names["k"]]
    got = stages(list(gm.graph.nodes), [[name] for name in consumers])
    assert [sorted(consumers[i] for i in stage) for stage in got] == [
        sorted([names["q"], names["k"], names["v"]]),
        [names["o"]],
        [names["up"]],
    ]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=100), min_size=2, max_size=12))
def test_stages_of_a_random_dag_respect_every_dependency(parents: list[int]) -> None:
    """Node i reads node ``parents[i] % i`` (a random DAG): a layer's stage is later than the stage
    of every layer it depends on, and a layer with no layer upstream is in the first stage."""
    graph = torch.fx.Graph()
    nodes: list[Node] = [graph.placeholder("x")]
    for i, p in enumerate(parents, start=1):
        nodes.append(graph.call_function(torch.relu, (nodes[p % i],)))
    graph.output(nodes[-1])
    consumers = [n.name for n in nodes[1:]]
    got = stages(list(graph.nodes), [[name] for name in consumers])
    stage_of = {consumers[k]: s for s, stage in enumerate(got) for k in stage}
    assert sorted(k for stage in got for k in stage) == list(range(len(consumers)))
    for i, p in enumerate(parents, start=1):
        parent = nodes[p % i]
        if parent.name in stage_of:
            assert stage_of[nodes[i].name] == stage_of[parent.name] + 1
        else:
            assert stage_of[nodes[i].name] == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), min_size=2, max_size=14),
    st.lists(st.integers(0, 4), min_size=14, max_size=14),
)
def test_stages_of_weights_applied_at_several_nodes_follow_their_dependencies(
    edges: list[tuple[int, int]], owners: list[int]
) -> None:
    """Nodes of a random DAG belong to up to five weights (a weight tied across steps applies at
    several nodes). Against a brute-force closure of "some node of A is upstream of some node
    of B": a weight comes after every weight it depends on, and weights depending on each other
    (a cycle through their nodes) share a stage."""
    graph = torch.fx.Graph()
    nodes: list[Node] = [graph.placeholder("x")]
    for i, (a, b) in enumerate(edges, start=1):
        nodes.append(graph.call_function(torch.add, (nodes[a % i], nodes[b % i])))
    graph.output(nodes[-1])
    sites: dict[int, list[str]] = {}
    for node, owner in zip(nodes[1:], owners):
        sites.setdefault(owner, []).append(node.name)
    keys = sorted(sites)
    consumers = [sites[k] for k in keys]
    ancestors: dict[str, set[str]] = {}
    for node in nodes:
        ancestors[node.name] = set().union(*({a.name} | ancestors[a.name] for a in node.all_input_nodes))
    site_of = {name: k for k, names in enumerate(consumers) for name in names}
    direct = {
        (site_of[a], k)
        for k, names in enumerate(consumers)
        for n in names
        for a in ancestors[n]
        if a in site_of
    }
    closure = set(direct)
    while True:
        more = {(a, d) for a, b in closure for c, d in closure if b == c} - closure
        if not more:
            break
        closure |= more
    got = stages(list(graph.nodes), consumers)
    stage_of = {k: s for s, stage in enumerate(got) for k in stage}
    assert sorted(stage_of) == list(range(len(consumers)))
    for a, b in closure:
        if a == b:
            continue
        if (b, a) in closure:
            assert stage_of[a] == stage_of[b]
        else:
            assert stage_of[a] < stage_of[b]


def test_an_unrolled_recurrence_is_one_stage_after_its_input_projection() -> None:
    """``h_t = tanh(ih_t + W_hh h_{t-1})`` over 20 steps with a projection after: three stages
    (the input projection, the 20 tied steps, the projection), not one per step."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ih = graph.call_function(torch.neg, (x,))
    h = graph.placeholder("h0")
    steps = []
    for _ in range(20):
        step = graph.call_function(torch.add, (ih, h))
        steps.append(step.name)
        h = graph.call_function(torch.tanh, (step,))
    head = graph.call_function(torch.neg, (h,))
    graph.output(head)
    assert stages(list(graph.nodes), [[head.name], steps, [ih.name]]) == [[2], [1], [0]]
    # two weights applied at one node (a product of two constants) share its stage
    assert stages(list(graph.nodes), [[head.name], [head.name], steps]) == [[2], [0, 1]]


def quantized_sqnr(algorithms: list[Any]) -> float:
    """Output SQNR at per-block 4-bit weights: each layer has a scale per block to choose, where
    16a4w's per-tensor linear weights leave SeqMSE one number per layer (its gain there, +0.3 dB
    sequential on this 2-layer net, is one grid point's luck, not a measure of the mode)."""
    x = data()
    model = Mlp().eval()
    ep = torch.export.export(model, (x[:BATCH],))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w_block")
    prepared = quantplug.prepare(ep, quantizer, algorithms=algorithms or None)
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    converted = quantplug.convert(prepared)
    with torch.no_grad():
        ref, out = model(x), converted(x)
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.mark.parametrize("algorithm", ["seq_mse", "gptq", "adaround"])
def test_weight_algorithms_run_sequentially_and_beat_the_default(algorithm: str) -> None:
    options: dict[str, Any] = {"sequential": True}
    if algorithm == "adaround":
        options["iterations"] = 100
    assert quantized_sqnr([(algorithm, options)]) > quantized_sqnr([]) + 0.5


#: values ATen's fake-quantize kernel handles apart (non-finite, huge, signed zeros, subnormal)
SPECIAL = (0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1e-45)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([(0, 255), (-128, 127), (0, 65535), (-7, 7), (-(2**31), 2**31 - 1)]),
    st.integers(-6, 1),
    st.booleans(),
    st.booleans(),
)
def test_simulated_activations_are_atens_fake_quantize_value_for_value(
    seed: int, grid: tuple[int, int], exponent: int, shifted: bool, special: bool
) -> None:
    """The simulation's per-tensor fake quantization (the guard's trials, sequential inputs) gives
    ``torch.fake_quantize_per_tensor_affine``'s values bit for bit, signs of zeros included: on
    rounding ties, beyond the grid, on non-finite and huge values (where it hands over to ATen),
    on a grid too wide for float32 to count."""
    g = torch.Generator().manual_seed(seed)
    qmin, qmax = grid
    scale = float(torch.rand(1, generator=g).float() * 10.0**exponent + 1e-12)
    zero_point = int(torch.randint(qmin, qmax + 1, (1,), generator=g)) if shifted else 0
    ties = (torch.randint(-300, 300, (64,), generator=g).float() + 0.5) * scale
    x = torch.cat([torch.randn(448, generator=g) * scale * 200, ties])
    if special:
        x[:40] = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (40,), generator=g)]
    expected = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax)
    got = fake_quantize_per_tensor(x, scale, zero_point, qmin, qmax)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))
    # as the simulation calls it: through an observer's quantizer, its scale's inverse made once
    spec = SimpleNamespace(dtype=torch.int64, quant_min=qmin, quant_max=qmax, qscheme=torch.per_tensor_affine)
    quantize = activation_quantizer(spec, (torch.tensor([scale]), torch.tensor([zero_point])))
    assert quantize is not None
    for _ in range(2):
        got = quantize(x)
        assert torch.equal(got, expected)
        assert torch.equal(torch.signbit(got), torch.signbit(expected))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([(0, 255), (-128, 127), (0, 65535), (-32768, 32767)]),
    st.integers(-6, 1),
    st.sampled_from([(37,), (4, 9, 16), (2, 3, 8, 5)]),
    st.sampled_from(["contiguous", "permuted", "parameter", "slice", "sliced transpose", "broadcast"]),
    st.booleans(),
)
def test_the_native_fake_quantize_is_the_torch_path_bit_for_bit(
    seed: int, grid: tuple[int, int], exponent: int, shape: tuple[int, ...], layout: str, avx2: bool
) -> None:
    """The one-pass kernel the guard's trials fake-quantize with gives the torch path's values and
    layout (a permuted activation keeps its strides; a slice or a broadcast gets the dense layout
    torch's result takes), signs of zeros included, on its 8-lane and scalar code, for a
    parameter as for a tensor; it declines (the torch path runs) where a product is NaN, infinite
    or huge."""
    from _quantplug.observers import kernels

    native = kernels.fake_quantize_available()  # else the torch path twice: the same values
    g = torch.Generator().manual_seed(seed)
    qmin, qmax = grid
    scale = float(torch.rand(1, generator=g).float() * 10.0**exponent + 1e-12)
    zero_point = int(torch.randint(qmin, qmax + 1, (1,), generator=g)) if qmin == 0 else 0
    x = torch.randn(shape, generator=g) * scale * 300
    x.view(-1)[:5] = (torch.randint(-300, 300, (5,), generator=g).float() + 0.5) * scale  # ties
    x.view(-1)[5:7] = torch.tensor([0.0, -0.0])
    if layout == "permuted":
        x = x.transpose(0, -1)
    elif layout == "parameter":
        x = nn.Parameter(x, requires_grad=False)
    elif layout == "slice":  # a rotary half: every other block of the last dimension
        x = torch.cat([x, x.flip(-1)], dim=-1)[..., 1 : 1 + shape[-1]]
    elif layout == "sliced transpose":
        x = torch.cat([x, -x], dim=-1).transpose(0, -1)[: shape[-1]]
    elif layout == "broadcast":  # GQA's expanded keys: a stride-0 dimension
        x = x.unsqueeze(1).expand(shape[0], 3, *shape[1:])
    inverse = float(1.0 / torch.tensor(scale))
    with simd(avx2) if native else contextlib.nullcontext():
        got = fake_quantize_per_tensor(x, scale, zero_point, qmin, qmax)
        assert (kernels.fake_quantize(x, inverse, scale, zero_point, qmin, qmax) is not None) == native
        made = kernels.fake_quantizer(inverse, scale, zero_point, qmin, qmax)  # as the simulation calls it
        once = made(x)
        assert (once is not None) == native
        if once is not None:
            assert torch.equal(once, got) and once.stride() == got.stride()
            assert torch.equal(torch.signbit(once), torch.signbit(got))
        with kernels.disabled():
            expected = fake_quantize_per_tensor(x, scale, zero_point, qmin, qmax)
        assert torch.equal(got, expected) and got.stride() == expected.stride()
        assert torch.equal(torch.signbit(got), torch.signbit(expected))
        for special in (float("nan"), float("inf"), 2.0**63 * scale):
            y = x.detach().clone()
            y[(-1,) * y.dim()] = special
            assert kernels.fake_quantize(y, inverse, scale, zero_point, qmin, qmax) is None
            assert made(y) is None


def test_a_build_without_the_fake_quantize_kernel_leaves_it_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A native build from an older source (no ``fake_quantize``) stays usable: the simulation's
    fake quantize runs its torch path, with the same values."""
    import types

    from _quantplug.observers import kernels

    old = types.ModuleType("_quantplug.observers._histogram_kernels")
    old.minmax = lambda *args: None  # type: ignore[attr-defined]
    monkeypatch.setattr(kernels, "_native", old)
    x = torch.randn(100, generator=torch.Generator().manual_seed(3))
    assert not kernels.fake_quantize_available()
    assert kernels.fake_quantize(x, 10.0, 0.1, 3, 0, 255) is None
    expected = torch.fake_quantize_per_tensor_affine(x, 0.1, 3, 0, 255)
    assert torch.equal(fake_quantize_per_tensor(x, 0.1, 3, 0, 255), expected)
