"""Structure that keeps prepare/convert/calibration fast; no wall-clock assertions.

Each test pins down a property whose loss would show up as a slowdown in ``python -m bench``:
one code generation per stage, no ``ep.module()`` on the way in, O(1) attribute naming,
``calculate_qparams`` once per observer, constants observed only at convert (and into copies),
and the exactness of every faster stand-in for a torch/torchao routine (so the speed does not
cost parity with torchao).
"""

from __future__ import annotations

import contextlib
import struct
import warnings
from collections import Counter
from collections.abc import Iterator
from operator import attrgetter
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

import quantplug
from _quantplug.graph.working_copy import AttrNamer, working_copy
from _quantplug.meta import STATE_KEY, observer_children, observer_target
from _quantplug.observers import kernels
from _quantplug.observers.copies import fresh_copy
from _quantplug.peers.torchao_observers import accelerate, calculate_qparams_many

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """conv-bn-relu, then a few linear blocks: weights, biases, fusions, residual adds."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(self.blocks(y))


def _inputs(seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),)


def _program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    model = Net().eval()
    mean, var = model.bn.running_mean, model.bn.running_var
    assert mean is not None and var is not None
    with torch.no_grad():  # non-trivial batch-norm statistics
        mean.uniform_(-0.5, 0.5)
        var.uniform_(0.5, 2.0)
    return torch.export.export(model, _inputs(0))


def _x86() -> Any:
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    return x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config())


def _xnnpack() -> Any:
    xnn = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    return xnn.XNNPACKQuantizer().set_global(xnn.get_symmetric_quantization_config(is_per_channel=True))


QUANTIZERS = {
    "reference": lambda: quantplug.get_quantizer("reference"),
    "x86": _x86,
    "xnnpack": _xnnpack,
}


def _calibrated(quantizer: Any, batches: int = 3) -> GraphModule:
    prepared = quantplug.prepare(_program(), quantizer)
    with torch.no_grad():
        for seed in range(1, batches + 1):
            prepared(*_inputs(seed))
    return prepared


@pytest.fixture
def recompiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real code generation (the lazy kind's too) while the test runs, an empty graph's
    (a shell GraphModule that receives its graph afterwards) included."""
    calls: list[str] = []
    original = GraphModule.recompile

    def counting(self: GraphModule) -> Any:
        calls.append(type(self).__name__)
        return original(self)

    monkeypatch.setattr(GraphModule, "recompile", counting)
    return calls


# ----------------------------------------------------------------------------- one codegen per stage


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_prepare_and_convert_generate_code_once_each(name: str, recompiles: list[str]) -> None:
    ep = _program()
    quantizer = QUANTIZERS[name]()
    recompiles.clear()
    prepared = quantplug.prepare(ep, quantizer)
    assert len(recompiles) == 1, f"prepare generated code {len(recompiles)} times"
    with torch.no_grad():
        prepared(*_inputs(1))  # already compiled: calling it generates nothing
    assert len(recompiles) == 1
    recompiles.clear()
    quantplug.convert(prepared)
    assert len(recompiles) == 1, f"convert generated code {len(recompiles)} times"


def test_prepare_does_not_unlift_through_ep_module(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = _program()

    def refuse(self: Any) -> Any:
        raise AssertionError("ep.module() called (3 code generations and a deep copy)")

    monkeypatch.setattr(torch.export.ExportedProgram, "module", refuse)
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference"))
    with torch.no_grad():
        prepared(*_inputs(1))
    quantplug.convert(prepared)


def test_working_copy_is_ep_module_without_the_guard() -> None:
    ep = _program()
    ours, theirs = working_copy(ep), ep.module()

    def described(gm: GraphModule) -> list[tuple[str, str, str]]:
        return [(n.name, n.op, str(n.target)) for n in gm.graph.nodes if n.name != "_guards_fn"]

    assert described(ours) == described(theirs)
    assert not any(n.name == "_guards_fn" for n in ours.graph.nodes)
    # the very same parameter and buffer objects, same persistence
    for (name, a), (name_b, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert name == name_b and a is b
    assert dict(ours.named_buffers()).keys() == dict(theirs.named_buffers()).keys()
    for name, buf in ours.named_buffers():
        assert buf is dict(theirs.named_buffers())[name]
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for seed in (1, 2):
        torch.testing.assert_close(ours(*_inputs(seed)), theirs(*_inputs(seed)), rtol=0, atol=0)
    # keyword call and pytree outputs like ep.module()
    assert ours.code.count("tree_flatten_spec") == 1


def test_lifted_inputs_become_get_attrs_the_graph_knows() -> None:
    """The placeholders of weights turned into get_attr nodes in place are filed as such: found
    by op in graph order, their names taken (a new node asking for one gets a suffix)."""
    graph = working_copy(_program()).graph
    attrs = [n for n in graph.nodes if n.op == "get_attr"]
    assert attrs and graph.find_nodes(op="get_attr") == attrs
    assert graph.find_nodes(op="placeholder") == [n for n in graph.nodes if n.op == "placeholder"]
    assert all(graph._graph_namespace.create_name(n.name, None) != n.name for n in attrs)
    graph.lint()


def test_lifted_inputs_shortcut_gives_the_graph_of_the_edits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch.fx without the private tables the working copy inserts, moves and erases."""
    import _quantplug.graph.working_copy as wc

    def described(gm: GraphModule) -> list[tuple[str, str, str, Any]]:
        return [(n.name, n.op, str(n.target), n.type) for n in gm.graph.nodes]

    program = _program()
    shortcut = working_copy(program)
    monkeypatch.setattr(wc, "_become_get_attr", lambda *args: False)
    edits = working_copy(program)
    assert described(shortcut) == described(edits) and shortcut.code == edits.code


class Counting(nn.Module):
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.fc(x)


def test_working_copy_falls_back_for_buffer_mutations() -> None:
    # functionalized, the mutation is a BUFFER_MUTATION output: ep.module() writes it back with
    # copy_, and the direct copy leaves such programs to it
    ep = torch.export.export(Counting(), (torch.randn(2, 4),)).run_decompositions({})
    assert any(s.kind.name == "BUFFER_MUTATION" for s in ep.graph_signature.output_specs)
    gm = working_copy(ep)
    gm(torch.randn(2, 4))
    assert float(gm.get_buffer("count")) == 1.0
    assert any(n.op == "call_function" and "copy_" in str(n.target) for n in gm.graph.nodes)


def test_cyclic_gc_is_held_off_while_graphs_are_built() -> None:
    import gc

    seen: list[bool] = []

    class Recording:
        def __init__(self) -> None:
            self.inner = quantplug.get_quantizer("reference")

        def annotate(self, gm: GraphModule) -> GraphModule:
            seen.append(gc.isenabled())
            return self.inner.annotate(gm)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    assert gc.isenabled()
    prepared = quantplug.prepare(_program(), Recording())
    assert seen == [False] and gc.isenabled()
    with torch.no_grad():
        prepared(*_inputs(1))
    quantplug.convert(prepared)
    assert gc.isenabled()


# ----------------------------------------------------------------------------- naming


def test_observers_are_named_by_group_without_probing() -> None:
    prepared = _calibrated(quantplug.get_quantizer("reference"), batches=1)
    state = prepared.meta[STATE_KEY]
    names = [observer_target(g.gid) for g in state.groups]
    assert [name for name, _ in observer_children(prepared)] == names
    targets = {str(n.target) for n in prepared.graph.nodes if n.op == "call_module"}
    assert targets == set(names)  # every observer is called by a node (parked ones too)


class _Probed(nn.Module):
    """Counts attribute lookups that miss the instance dict (what ``hasattr`` probing costs)."""

    probes = 0

    def __getattr__(self, name: str) -> Any:
        type(self).probes += 1
        return super().__getattr__(name)


def test_attr_namer_is_constant_time_per_name() -> None:
    module = _Probed()
    for i in range(300):  # a crowded namespace: prefix0 .. prefix299 taken
        module.add_module(f"w_scale{i}", nn.Identity())
    namer = AttrNamer(module)
    _Probed.probes = 0
    first = namer("w_scale")
    first_probes = _Probed.probes
    _Probed.probes = 0
    names = [namer("w_scale") for _ in range(200)]
    assert first == "w_scale300" and first_probes <= 301
    assert _Probed.probes == 200  # one probe per later name, however many exist
    assert len(set(names)) == 200 and first not in names


# ----------------------------------------------------------------------------- calibration and convert


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_constant_observers_are_not_in_the_calibration_graph(name: str) -> None:
    prepared = _calibrated(QUANTIZERS[name]())
    state = prepared.meta[STATE_KEY]
    constant = [g for g in state.groups if g.constant]
    assert constant, "the model has weights: some groups must be constant"
    targets = {g.target for g in constant}
    parked = [n for n in prepared.graph.nodes if n.op == "call_module" and n.target in targets]
    for node in parked:  # parked: on the weight's edge, as torchao's, but the weight passes through
        assert node.args[0].op == "get_attr" and node.users
        value = attrgetter(str(node.args[0].target))(prepared)
        assert getattr(prepared, str(node.target))(value) is value
    # and calibration left their observers untouched (they are fed at convert, into copies)
    for group in constant:
        obs = getattr(prepared, group.target)
        min_val = getattr(obs, "min_val", None)
        if isinstance(min_val, torch.Tensor):
            assert min_val.numel() == 0 or not torch.isfinite(min_val).any()


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_convert_computes_each_observers_qparams_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import _quantplug.flow.convert as convert_module

    prepared = _calibrated(QUANTIZERS[name]())
    calls: Counter[int] = Counter()  # observer -> computations, one at a time or in a batch
    batching = []
    observers = [m for _, obs in observer_children(prepared) for m in obs.modules()]
    classes = {type(m) for m in observers if hasattr(m, "calculate_qparams")}
    for cls in classes:
        original = cls.__dict__.get("calculate_qparams") or cls.calculate_qparams

        def counting(self: Any, _original: Any = original) -> Any:
            if not batching:  # inside a batch, the batch is what counts
                calls[id(self)] += 1
            return _original(self)

        monkeypatch.setattr(cls, "calculate_qparams", counting)
    many = convert_module.calculate_qparams_many

    def counting_many(observers: Any) -> Any:
        calls.update(id(obs) for obs in observers)
        batching.append(True)
        try:
            return many(observers)
        finally:
            batching.pop()

    monkeypatch.setattr(convert_module, "calculate_qparams_many", counting_many)
    quantplug.convert(prepared)
    assert calls, "no observer computed qparams"
    assert max(calls.values()) == 1, f"some observer computed its qparams {max(calls.values())} times"
    # the cache is gone afterwards: the observers answer for themselves again
    assert not any("calculate_qparams" in m.__dict__ for m in observers)


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_convert_twice_is_identical_and_leaves_prepared_as_it_was(name: str) -> None:
    prepared = _calibrated(QUANTIZERS[name]())
    before = _buffers(prepared)
    code = prepared.code
    first = quantplug.convert(prepared)
    after = _buffers(prepared)
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), f"convert changed prepared state {key}"
    assert prepared.code == code
    second = quantplug.convert(prepared)
    assert first.code == second.code
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for key, value in first_state.items():
        assert torch.equal(value, second_state[key]), key
    for seed in (7, 8):
        torch.testing.assert_close(first(*_inputs(seed)), second(*_inputs(seed)), rtol=0, atol=0)


def test_fresh_copy_is_independent() -> None:
    from _quantplug.observers.minmax import PerChannelMinMaxObserver

    obs = PerChannelMinMaxObserver()
    copy: Any = fresh_copy(obs)
    copy(torch.randn(4, 3))
    assert int(copy.num_batches) == 1 and int(obs.num_batches) == 0
    assert obs.min_val.numel() == 0 and copy.min_val.numel() == 4


# ----------------------------------------------------------------------------- exact stand-ins


@pytest.mark.parametrize("path", ["native", "torch"])
def test_upscaled_histogram_is_torchaos_bit_for_bit(path: str) -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    if path == "native" and not kernels.available():
        pytest.skip("native kernels not built")
    with kernels.disabled() if path == "torch" else contextlib.nullcontext():
        _upscale_and_compare(ao)


def _upscale_and_compare(ao: Any) -> None:
    g = torch.Generator().manual_seed(4)
    for trial in range(300):
        bins, rate = [(2048, 16), (256, 16), (7, 3), (300, 4), (1, 16)][trial % 5]
        ref = ao.HistogramObserver(bins=bins)
        fast: Any = accelerate(ao.HistogramObserver(bins=bins))
        ref.upsample_rate = fast.upsample_rate = rate
        magnitude = float(10 ** torch.empty(1).uniform_(-4, 4, generator=g))
        width = magnitude * float(10 ** torch.empty(1).uniform_(-7, 1, generator=g))  # down to ulps
        lo = torch.randn((), generator=g) * magnitude
        hi = lo + torch.rand((), generator=g) * width + width * 1e-3
        old_lo = lo + (hi - lo) * torch.rand((), generator=g) * 0.5
        old_hi = old_lo + (hi - old_lo) * torch.rand((), generator=g)
        if trial % 7 == 0:
            old_lo, old_hi = lo, hi  # the same range
        # counts, then the fractions that earlier re-binnings leave
        hist = torch.randint(0, 5000, (bins,), generator=g).float()
        if trial % 2:
            hist = hist * torch.rand(bins, generator=g) / 16
        args = (hist, old_lo.clone(), old_hi.clone(), lo.clone(), hi.clone())
        assert _same_bits(fast._upscale_histogram(*args), ref._upscale_histogram(*args)), trial


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


HISTOGRAM_CONFIGS = [
    {},
    {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    {"dtype": torch.quint8, "reduce_range": True},
    {"bins": 256},
    {"bins": 300},
    {"dtype": torch.int16, "quant_min": -32768, "quant_max": 32767, "qscheme": torch.per_tensor_symmetric},
    {"dtype": torch.uint16, "quant_min": 0, "quant_max": 65535},
    {"eps": 0.05},  # its own eps: qparams computed together only with observers of the same one
]


def _histogram_batch(g: torch.Generator, kind: int, batch: int) -> torch.Tensor:
    """A calibration batch: normal values of some magnitude, growing with ``batch``, or else
    (by ``kind``) relu'd, constant, non-contiguous, with an inf (after the first batch) or, for
    kind 6, spread over nearly all of float32's range."""
    n = int(torch.randint(1, 20_000, (1,), generator=g))
    x = torch.randn(n, generator=g) * float(10 ** torch.empty(1).uniform_(-3, 3, generator=g)) * (1 + batch)
    if kind == 1:
        x = x.relu()
    elif kind == 2:
        x = torch.full((n,), float(x[0]))
    elif kind == 3:
        x = x.reshape(-1, 1).expand(-1, 3)  # not contiguous
    elif kind == 4 and batch:
        x[0] = float("inf")
    elif kind == 6:
        x = (torch.rand(n, generator=g) * 2 - 1) * 1.5e38
    return x


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize(
    "config", HISTOGRAM_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default"
)
def test_accelerated_torchao_histogram_observer_is_bit_identical(config: dict[str, Any], path: str) -> None:
    """The same states under the native kernels and the torch code paths (_quantplug.observers.kernels)."""
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    if path == "native" and not kernels.available():
        pytest.skip("native kernels not built")
    context = kernels.disabled() if path == "torch" else contextlib.nullcontext()
    g = torch.Generator().manual_seed(1)
    with context:
        _feed_and_compare(ao, config, g)


def _feed_and_compare(ao: Any, config: dict[str, Any], g: torch.Generator) -> None:
    for trial in range(40):
        ref, fast = ao.HistogramObserver(**config), accelerate(ao.HistogramObserver(**config))
        assert type(fast) is not ao.HistogramObserver and isinstance(fast, ao.HistogramObserver)
        fast.nonfinite = "ignore"  # the inf batches: torchao's own filtering (the default raises)
        for batch in range(int(torch.randint(1, 9, (1,), generator=g))):
            x = _histogram_batch(g, (trial + batch) % 6, batch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref(x)
                fast(x)
            for buf in ("histogram", "min_val", "max_val"):
                assert _same_bits(getattr(ref, buf), getattr(fast, buf)), (trial, batch, buf)
        s_ref, z_ref = ref.calculate_qparams()
        s_fast, z_fast = fast.calculate_qparams()
        assert _same_bits(s_ref, s_fast) and torch.equal(z_ref, z_fast), trial


def test_calculate_qparams_many_is_each_observers_calculate_qparams(monkeypatch: pytest.MonkeyPatch) -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.observers.minmax import MinMaxObserver
    from _quantplug.peers import torchao_observer_classes as torchao_fast
    from _quantplug.peers.torchao_observers import calculate_qparams_many

    g = torch.Generator().manual_seed(5)
    observers: list[Any] = []
    references: list[Any] = []  # torchao's own observer fed the same batches, or the observer itself
    for trial in range(150):
        config = HISTOGRAM_CONFIGS[trial % len(HISTOGRAM_CONFIGS)]
        ref, fast = ao.HistogramObserver(**config), accelerate(ao.HistogramObserver(**config))
        fast.nonfinite = "ignore"  # the inf batches: torchao's own filtering (the default raises)
        batches = 0 if trial % 23 == 0 else int(torch.randint(1, 5, (1,), generator=g))  # some unused
        huge = trial % 37 == 5  # a range of nearly 2**128 (torchao's search takes ~0.5 s after more)
        for batch in range(1 if huge else batches):
            x = _histogram_batch(g, 6 if huge else (trial + batch) % 6, batch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref(x)
                fast(x)
        observers.append(fast)
        references.append(ref)
        if trial % 10 == 0:  # other observers, fed or not, among them
            other = [
                ao.MinMaxObserver(),
                accelerate(ao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8)),
                ao.PerChannelMinMaxObserver(ch_axis=1),
                MinMaxObserver(),
                ao.HistogramObserver(),  # not accelerated
                accelerate(ao.HistogramObserver(bins=64, factory_kwargs={"dtype": torch.float64})),
            ][trial // 10 % 6]
            if trial % 20:
                other(torch.randn(5, 7, generator=g))
            observers.append(other)
            references.append(other)
    assert sum(type(o) is torchao_fast.HistogramObserver for o in observers) > 100

    def run(compute: Any) -> tuple[list[Any], list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = compute()
        return results, sorted(str(w.message) for w in caught)

    expected, expected_warnings = run(lambda: [r.calculate_qparams() for r in references])
    single, single_warnings = run(lambda: [o.calculate_qparams() for o in observers])
    many, many_warnings = run(lambda: calculate_qparams_many(observers))
    monkeypatch.setattr(torchao_fast, "_CHUNK_ELEMENTS", 3000)  # chunks of 1 to 11 rows
    small_chunks, _ = run(lambda: calculate_qparams_many(observers))
    assert expected_warnings and many_warnings == expected_warnings == single_warnings
    assert len(expected) == len(single) == len(many) == len(small_chunks) == len(observers)
    for i, (s_ref, z_ref) in enumerate(expected):
        for s, z in (single[i], many[i], small_chunks[i]):
            assert _same_bits(s, s_ref) and torch.equal(z, z_ref), (i, type(observers[i]))
            assert z.dtype == z_ref.dtype and z.shape == z_ref.shape, (i, type(observers[i]))
        for t in many[i]:  # computed together, stored apart
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), i


@contextlib.contextmanager
def _kernel_path(path: str) -> Iterator[None]:
    """The native kernels' AVX2 code, their scalar code, or the torch operations ("torch")."""
    if path == "torch":
        with kernels.disabled():
            yield
        return
    if not kernels.search_norms_available():
        pytest.skip("native kernels not built")
    from _quantplug.observers import _histogram_kernels as raw

    was = raw._use_avx2(path == "avx2")
    try:
        yield
    finally:
        raw._use_avx2(was)


@pytest.mark.parametrize("path", ["avx2", "scalar", "torch"])
def test_batched_quantization_errors_are_torchaos_bit_for_bit(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Native per-bin terms (AVX2 and scalar code; 300 bins: not a multiple of 8) or torch's."""
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.peers import torchao_observer_classes as torchao_fast

    with _kernel_path(path):
        _check_batched_errors(ao, torchao_fast, monkeypatch)


def _check_batched_errors(ao: Any, torchao_fast: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(8)
    for config in HISTOGRAM_CONFIGS:
        refs = []
        for trial in range(12):
            ref = ao.HistogramObserver(**config)
            for batch in range(1 + trial % 3):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ref(_histogram_batch(g, 6 if trial == 11 else (trial + batch) % 6, batch))
            if ref.min_val < ref.max_val:
                refs.append(ref)
        bins, dst_nbins = refs[0].bins, refs[0].dst_nbins
        widths = [(r.max_val.item() - r.min_val.item()) / bins for r in refs]
        searches = torchao_fast._Searches(torch.stack([r.histogram for r in refs]), widths, dst_nbins)
        owners, starts, dst_widths, expected = [], [], [], []
        for _ in range(150):
            owner = int(torch.randint(0, len(refs), (1,), generator=g))
            start, end = sorted(int(b) for b in torch.randint(0, bins, (2,), generator=g))
            owners.append(owner)
            starts.append(start)
            dst_widths.append(widths[owner] * (end - start + 1) / dst_nbins)
            expected.append(ao.HistogramObserver._compute_quantization_error(refs[owner], start, end))
        for chunk_elements in (1 << 17, 5 * bins):
            monkeypatch.setattr(torchao_fast, "_CHUNK_ELEMENTS", chunk_elements)
            errors = searches.errors(owners, starts, dst_widths)
            assert [struct.pack("d", e) for e in errors] == [struct.pack("d", e) for e in expected], config


@pytest.mark.parametrize("path", ["native", "python"])
def test_search_walk_tries_torchaos_candidates(path: str) -> None:
    """With every error accepted, the walk proposes torchao's ranges, in torchao's order (its
    steps in C where the kernels are built, or in Python)."""
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    if path == "native" and kernels.search_walk_native() is None:
        pytest.skip("native kernels not built")
    from _quantplug.peers import torchao_observer_classes as torchao_fast

    # torchao compares float32 cumulative counts with thresholds rounded to float32: here the
    # first threshold rounds onto cSum[0] and cSum[1] (then the start bin stays, else it moves)
    total = 1000001.0
    c0 = float(torch.tensor(1e-5 * total, dtype=torch.float32))
    assert c0 < 1e-5 * total
    crafted = ao.HistogramObserver(bins=4)
    crafted.histogram.copy_(torch.tensor([c0, c0 * 2**-30, total - 30.0, 20.0]))
    crafted.min_val.fill_(0.0)
    crafted.max_val.fill_(4.0)
    assert crafted.histogram.sum().item() == total
    refs = [crafted]
    g = torch.Generator().manual_seed(9)
    for trial in range(28):
        ref = ao.HistogramObserver(**HISTOGRAM_CONFIGS[trial % len(HISTOGRAM_CONFIGS)])
        for batch in range(1 + trial % 4):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # not constant: torchao's walk would take ~0.3 s
                ref(_histogram_batch(g, [0, 1, 3, 4, 5][(trial + batch) % 5], batch))
        refs.append(ref)
    for i, ref in enumerate(refs):
        tried: list[tuple[int, int]] = []
        limit = 2 if ref is crafted else 40  # (its 3rd candidate is ~50000 steps away)

        def error(start: int, end: int, tried: list[tuple[int, int]] = tried, limit: int = limit) -> float:
            tried.append((start, end))
            return -float(len(tried)) if len(tried) < limit else float("inf")

        ref._compute_quantization_error = error  # accept limit - 1 candidates, reject the next
        ao.HistogramObserver._non_linear_param_search(ref)
        bin_width = (ref.max_val.item() - ref.min_val.item()) / ref.bins
        with kernels.disabled() if path == "python" else contextlib.nullcontext():
            walk = torchao_fast._Searches(ref.histogram[None], [bin_width], ref.dst_nbins).walks[0]
        assert (walk.native is not None) == (path == "native")
        ours: list[tuple[int, int]] = []
        while len(ours) < len(tried):
            candidates = walk.peek(3)
            if not candidates:
                break
            for candidate in candidates:
                ours.append(candidate)
                walk.accept()
        assert ours[: len(tried)] == tried, i


def test_row_sums_and_cumsums_are_those_of_each_row() -> None:
    """The batched search sums [rows, bins] tensors along dim 1 where torchao sums 1-D tensors."""
    g = torch.Generator().manual_seed(6)
    for trial in range(2000):
        bins = [2048, 300, 256, 7, 1, 4099, 32768][trial % 7]
        rows = int(torch.randint(1, 10, (1,), generator=g)) if bins < 4099 else 2
        x = torch.randn(rows, bins, generator=g) * float(10 ** torch.empty(1).uniform_(-6, 6, generator=g))
        if trial % 3 == 0:
            x = x.abs() * (torch.rand(rows, bins, generator=g) < 0.3)  # a sparse histogram
        each = torch.stack([row.sum() for row in x])
        assert _same_bits(x.sum(dim=1), each), trial
        out = torch.empty(rows + 2)
        torch.sum(x, dim=1, out=out[1 : rows + 1])
        assert _same_bits(out[1 : rows + 1], each), trial
        assert _same_bits(x.cumsum(dim=1), torch.stack([row.cumsum(dim=0) for row in x])), trial


def test_float64_floor_division_is_torchs() -> None:
    pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.peers.torchao_observer_classes import _FloorDiv

    g = torch.Generator().manual_seed(7)
    for trial in range(300):
        top = [255, 65535, 127][trial % 3]
        rows, bins = 6, 500
        divisor = torch.rand(rows, 1, generator=g) * float(
            10 ** torch.empty(1).uniform_(-30, 30, generator=g)
        )
        divisor[0] = 0.0 if trial % 5 == 0 else divisor[0]
        q = (torch.rand(rows, bins, generator=g) * 2.2 - 0.1) * top  # quotients across [0, top]
        if trial % 2:
            q = q.round()  # on integers, then just below or above them
            q = q + (torch.randint(-2, 3, (rows, bins), generator=g) * q.abs() * 2**-24)
        x = (q * divisor).to(torch.float32)
        x[:, :4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
        expected = torch.div(x, divisor, rounding_mode="floor").clamp(0, top)
        out = torch.empty(rows, bins)
        floor_div = _FloorDiv(divisor, top, exact=True)
        assert torch.allclose(floor_div(x, slice(None), out=out), expected, rtol=0, atol=0, equal_nan=True), (
            trial
        )


PER_CHANNEL_CONFIGS: list[dict[str, Any]] = [
    {"dtype": torch.qint8, "qscheme": torch.per_channel_symmetric},
    {"dtype": torch.quint8, "qscheme": torch.per_channel_affine},
    {"dtype": torch.quint8, "qscheme": torch.per_channel_affine, "reduce_range": True},
    {"dtype": torch.quint8, "qscheme": torch.per_channel_symmetric},
    {"dtype": torch.qint8, "qscheme": torch.per_channel_affine, "quant_min": -100, "quant_max": 100},
    {"dtype": torch.qint8, "qscheme": torch.per_channel_symmetric, "eps": 1e-3},
]


def test_accelerated_torchao_per_channel_observer_is_bit_identical() -> None:
    """One at a time and batched (``calculate_qparams_many`` groups observers of one config)."""
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    g = torch.Generator().manual_seed(2)
    refs, fasts = [], []
    for trial in range(80):
        kwargs = {"ch_axis": trial % 2, **PER_CHANNEL_CONFIGS[trial % len(PER_CHANNEL_CONFIGS)]}
        ref = ao.PerChannelMinMaxObserver(**kwargs)
        fast: Any = accelerate(ao.PerChannelMinMaxObserver(**kwargs))
        w = torch.randn(int(torch.randint(1, 64, (1,), generator=g)), 9, generator=g)
        if trial % 7 == 0:
            w = w.abs() * 1e-9  # scales at eps
        for x in (w, w * 2 - 1):
            ref(x)
            fast(x)
        assert torch.equal(ref.min_val, fast.min_val) and torch.equal(ref.max_val, fast.max_val)
        (s_ref, z_ref), (s_fast, z_fast) = ref.calculate_qparams(), fast.calculate_qparams()
        assert _same_bits(s_ref, s_fast) and torch.equal(z_ref, z_fast)
        refs.append(ref)
        fasts.append(fast)
    batched = calculate_qparams_many(fasts)
    for ref, (s_fast, z_fast) in zip(refs, batched):
        s_ref, z_ref = ref.calculate_qparams()
        assert _same_bits(s_ref, s_fast) and torch.equal(z_ref, z_fast) and z_ref.dtype == z_fast.dtype
        assert s_fast.untyped_storage().nbytes() == s_fast.numel() * s_fast.element_size()  # own storage


def test_weight_quantization_matches_the_decomposed_op() -> None:
    from _quantplug.flow.convert import QParams, _quantize_tensor

    qd = torch.ops.quantized_decomposed
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        shape = [(64, 32), (16, 8, 3, 3), (7, 30)][trial % 3]
        axis = trial % len(shape) if trial % 2 else 0
        w = torch.randn(shape, generator=g) * 3
        scale = torch.rand(shape[axis], generator=g) * 0.05 + 1e-4
        zp = torch.randint(-10, 10, (shape[axis],), generator=g) * (trial % 2)
        for qmin, qmax, dtype in ((-128, 127, torch.int8), (0, 255, torch.uint8)):
            expected = qd.quantize_per_channel.default(w, scale, zp, axis, qmin, qmax, dtype)
            qp = QParams(scale, zp, qmin, qmax, dtype, "channel", axis=axis)
            assert torch.equal(_quantize_tensor(w, qp), expected)
        point = int(zp[0])
        expected = qd.quantize_per_tensor.default(w, float(scale[0]), point, -128, 127, torch.int8)
        qp = QParams(scale[:1], zp[:1], -128, 127, torch.int8, "tensor")
        assert torch.equal(_quantize_tensor(w, qp), expected)
        # a float64 zero point widens the sum: rounded, shifted and clamped in float64, as the
        # formula computes it out of place (not in the float32 product's memory)
        wide = zp.to(torch.float64) + 1e-9  # lost in a float32 sum: -3 + 1e-9 truncates to -2
        shape = [1] * w.dim()
        shape[axis] = -1
        sum64 = torch.round(w * (1.0 / scale).view(shape)) + wide.view(shape)
        expected = torch.clamp(sum64, -128, 127).to(torch.int8)
        qp = QParams(scale, wide, -128, 127, torch.int8, "channel", axis=axis)
        assert torch.equal(_quantize_tensor(w, qp), expected)


@pytest.mark.parametrize("name", ["x86", "xnnpack"])
def test_indexed_partition_matching_gives_the_same_annotations(name: str) -> None:
    from _quantplug.peers.torchao_matching import fast_partition_matching

    ep = _program()

    def annotations(gm: GraphModule) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for node in gm.graph.nodes:
            ann = node.meta.get("quantization_annotation")
            if ann is None:
                out.append((node.name,))
                continue
            inputs = tuple((k.name, repr(v)) for k, v in ann.input_qspec_map.items())
            out.append((node.name, inputs, repr(ann.output_qspec), ann._annotated))
        return out

    results = []
    for fast in (False, True):
        quantizer = QUANTIZERS[name]()
        gm = working_copy(ep)
        gm = quantizer.transform_for_annotation(gm) or gm
        if fast:
            with fast_partition_matching(gm):
                quantizer.annotate(gm)
        else:
            quantizer.annotate(gm)
        results.append(annotations(gm))
    assert results[0] == results[1]
    assert any(len(a) > 1 for a in results[1])
    # and the originals are back in place
    from torch.fx.passes.utils import source_matcher_utils

    assert source_matcher_utils.get_source_partitions.__module__ == source_matcher_utils.__name__


def test_observers_saw_data_together_is_each_ones_answer() -> None:
    """One comparison for all torchao-style ranges where none is +inf; each one's own otherwise."""
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.observers.factory import observer_saw_data, observers_saw_data

    fed = [ao.HistogramObserver(), ao.PerChannelMinMaxObserver(ch_axis=0), ao.MinMaxObserver()]
    for obs in fed:
        obs(torch.randn(3, 5))
    unfed = [ao.HistogramObserver(), ao.PerChannelMinMaxObserver(ch_axis=0), ao.MinMaxObserver()]
    for observers in (fed, fed + unfed[:1], unfed[1:] + fed, unfed):
        assert observers_saw_data(observers) == [observer_saw_data(o) for o in observers]
    assert observers_saw_data(fed) == [True, True, True]
    assert observers_saw_data(unfed) == [False, False, False]
