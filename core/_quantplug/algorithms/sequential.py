"""Sequential layer inputs: each layer's statistics from the model with the layers before it quantized.

AdaRound (Nagel et al. 2020, sec. 4), AIMET's SeqMSE and GPTQ as published (Frantar et al. 2023,
sec. 3) optimise a layer for the inputs it will see in the quantized model: the layers before it
already quantized with what was chosen for them, activations quantized. Float inputs ignore the
error that arrives from upstream; sequential inputs let each layer's choice see it.

An algorithm asks for it with the attribute ``sequential = True``. Then its collectors are not fed
during calibration; instead prepare stores a bounded number of the calibration batches
(:class:`InputStore`: the model's inputs, at most :data:`STORE_BATCHES` batches and
:data:`STORE_BYTES` bytes), and convert, stage by stage (:func:`stages`: layers whose inputs depend
on no layer still to choose), re-runs them through a simulation of the quantized model
(:class:`QuantizedSimulation`: every activation observer fake-quantizes with its calibrated
encoding, every weight reads its current codes) to feed fresh collectors of that stage's layers.
Memory: the stored batches plus one stage's collectors (Hessians), never the activations.

On several processes each rank stores the first batches of its share; ``sync_observers`` merges
the stores (:func:`merged_store`: round robin over the ranks under the same caps, which is the one
process's store for round-robin sharding), so every rank's sequential pass runs the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg

from _quantplug.algorithms.weight_matrix import single_thread
from _quantplug.annotation.spec_view import is_per_channel, spec_range
from _quantplug.errors import AlgorithmError
from _quantplug.graph.attrs import behind_parked
from _quantplug.graph.mutation import private_inputs, writes_an_input, written_args
from _quantplug.meta import observer_gid
from _quantplug.observers import kernels

#: at most this many calibration batches are kept for the sequential pass
STORE_BATCHES = 32
#: ... and at most this many bytes of them
STORE_BYTES = 256 * 2**20


def fits(count: int, stored: int, size: int, max_batches: int, max_bytes: int) -> bool:
    """Whether a batch of ``size`` bytes joins a store holding ``count`` batches of ``stored`` bytes."""
    return count < max_batches and (count == 0 or stored + size <= max_bytes)


def batch_bytes(inputs: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


#: with the algorithm guard on and no held-out batches given, every ``HELD_OUT_EVERY``-th
#: calibration batch (the 4th, 8th, ...) is kept from the algorithms and the guard judges on those
#: (:class:`HeldOutSplit`). Judged on the batches the algorithms fitted, a choice that fits them
#: and nothing else passes: SeqMSE on the trained LSTM of ``bench/trained`` at 16a4w_block lowered
#: the calibration error and raised the test perplexity (issue 45). With fewer batches than this,
#: nothing is held out and the guard judges on the calibration batches.
HELD_OUT_EVERY = 4


def calibration_position(seen: int) -> int:
    """The position (from 1) in the whole calibration of a process's ``seen``-th batch: under
    ``torch.distributed``, rank ``r`` of ``N`` calibrating round-robin shards
    (``quantplug.distributed.shard``, ``quantize --nproc``) sees batch ``(seen - 1) * N + r + 1``,
    so the ranks hold out and store the batches one process does, and merge them in its order."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (seen - 1) * dist.get_world_size() + dist.get_rank() + 1
    return seen


class HeldOutSplit:
    """Which calibration batches the algorithms do not see: the store of the program's inputs
    sets :attr:`holding` for each batch, the algorithms' taps skip the batches held out, and the
    held-out batches (flat inputs, within the caps) are what the guard judges on."""

    def __init__(self, every: int, max_batches: int, max_bytes: int) -> None:
        self.every = every
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.holding = False
        self.batches: list[tuple[Any, ...]] = []
        self.positions: list[int] = []  # of the held-out batches kept (calibration_position)
        self.bytes = 0

    def hold(self, position: int, inputs: tuple[Any, ...]) -> bool:
        """Whether the batch at ``position`` (:func:`calibration_position`) is held out; kept if it
        fits the caps."""
        self.holding = position % self.every == 0
        if self.holding:
            size = batch_bytes(inputs)
            if fits(len(self.batches), self.bytes, size, self.max_batches, self.max_bytes):
                self.batches.append(_detached(inputs))
                self.positions.append(position)
                self.bytes += size
        return self.holding


def _detached(inputs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs)


class InputStore(nn.Module):
    """A calibration tap on the program's inputs: keeps the first batches, within the caps (with
    a :class:`HeldOutSplit`, the first of those the algorithms see)."""

    def __init__(
        self,
        max_batches: int = STORE_BATCHES,
        max_bytes: int = STORE_BYTES,
        split: HeldOutSplit | None = None,
    ) -> None:
        super().__init__()
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.batches: list[tuple[Any, ...]] = []
        self.positions: list[int] = []  # of the stored batches (calibration_position)
        self.bytes = 0
        self.seen = 0
        self.split = split

    def forward(self, *inputs: Any) -> None:
        self.seen += 1
        position = calibration_position(self.seen)
        if self.split is not None and self.split.hold(position, inputs):
            return
        size = batch_bytes(inputs)
        if not fits(len(self.batches), self.bytes, size, self.max_batches, self.max_bytes):
            return
        self.batches.append(_detached(inputs))
        self.positions.append(position)
        self.bytes += size

    def replace_(
        self, batches: list[tuple[Any, ...]], seen: int, positions: Sequence[int] | None = None
    ) -> None:
        """Hold ``batches`` (the merge of every rank's store, at ``positions``) instead of this rank's."""
        self.batches = batches
        self.positions = list(positions) if positions is not None else list(range(1, len(batches) + 1))
        self.bytes = sum(batch_bytes(b) for b in batches)
        self.seen = seen


def merged_store(
    sizes: Sequence[Sequence[int]],
    max_batches: int,
    max_bytes: int,
    positions: Sequence[Sequence[int]] | None = None,
) -> list[tuple[int, int]]:
    """Which stored batches of every rank make the merged store: ``(rank, index)`` in order.

    ``sizes[r]`` are the bytes of rank ``r``'s stored batches, in the order it stored them. The
    ranks' batches are taken round robin (rank 0's first, rank 1's first, ..., rank 0's second...)
    under the caps one process applies. With the round-robin sharding of
    :func:`quantplug.distributed.shard` and ``quantize --nproc`` (rank ``r`` calibrates batches
    ``r, r + N, ...``) that order is the data's order, so the merged store is exactly the batches one
    process stores, unless a byte cap bound on some rank (a rank keeps what fits its own cap: it
    may have skipped a batch one process keeps). Ranks that shard otherwise get a deterministic
    store of each rank's first batches.

    With ``positions`` (each stored batch's :func:`calibration_position`), the batches are taken in
    that order instead: with the guard's held-out split (:class:`HeldOutSplit`) a rank's stored
    batches skip some positions, and round robin would no longer be the data's order.
    """
    candidates = [
        (rank, index)
        for index in range(max((len(s) for s in sizes), default=0))
        for rank in range(len(sizes))
    ]
    candidates = [(rank, index) for rank, index in candidates if index < len(sizes[rank])]
    if positions is not None:
        candidates.sort(key=lambda pair: (positions[pair[0]][pair[1]], pair[0]))
    chosen: list[tuple[int, int]] = []
    stored = 0
    for rank, index in candidates:
        size = int(sizes[rank][index])
        if fits(len(chosen), stored, size, max_batches, max_bytes):
            chosen.append((rank, index))
            stored += size
    return chosen


def stages(graph_nodes: Sequence[Node], consumers: Sequence[Sequence[str]]) -> list[list[int]]:
    """Indices of ``consumers`` (the layer nodes of each weight, in graph order or not) grouped in
    stages: a weight's stage is one more than the latest stage among the weights upstream of any
    of its nodes, so a stage's inputs depend only on earlier stages (query/key/value projections
    share one).

    A weight applied at several nodes can depend on itself or on weights that depend on it (an
    unrolled recurrence: ``W_hh`` at step t reads step t-1's; a projected LSTM's ``W_hh`` and
    ``W_hr`` read each other). Weights on such a cycle share a stage, so the steps read each
    other rounded to nearest until the stage is chosen: one stage per cycle, not one per step.
    """
    owners: dict[str, list[int]] = {}  # node -> the weights applied there (two may share one)
    for k, names in enumerate(consumers):
        for name in dict.fromkeys(names):
            owners.setdefault(name, []).append(k)
    count = len(consumers)
    deps = [0] * count  # weight -> bit set of the weights upstream of any of its nodes
    upstream: dict[Node, int] = {}  # node -> bit set of the weights its value depends on
    for node in graph_nodes:
        bits = 0
        for arg in node.all_input_nodes:
            bits |= upstream.get(arg, 0)
        mine = owners.get(node.name, ())
        for k in mine:
            deps[k] |= bits
        for k in mine:
            bits |= 1 << k
        upstream[node] = bits
    reach = list(deps)  # the transitive closure, by fixed point (bit sets: cheap for any model)
    changed = True
    while changed:
        changed = False
        for k in range(count):
            merged = reach[k]
            for d in _bits(reach[k]):
                merged |= reach[d]
            if merged != reach[k]:
                reach[k], changed = merged, True
    # a weight upstream of k that k is not upstream of has strictly fewer weights up to it, so
    # visiting by that count sees every such weight's level first
    level: dict[int, int] = {}
    for k in sorted(range(count), key=lambda k: ((reach[k] | 1 << k).bit_count(), k)):
        outside = [d for d in _bits(reach[k]) if d != k and not reach[d] >> k & 1]
        level[k] = 1 + max((level[d] for d in outside), default=-1)
    grouped: dict[int, list[int]] = {}
    for k in range(count):
        grouped.setdefault(level[k], []).append(k)
    return [grouped[key] for key in sorted(grouped)]


def _bits(value: int) -> list[int]:
    return [i for i in range(value.bit_length()) if value >> i & 1]


def fake_quantize_activation(x: torch.Tensor, spec: Any, qparams: tuple[Any, Any] | None) -> torch.Tensor:
    """``x`` through the quantize/dequantize pair its group's calibrated encoding gives it
    (identity where there is none: floating-point or dynamic specs, derived groups)."""
    quantizer = activation_quantizer(spec, qparams)
    return x if quantizer is None else quantizer(x)


def activation_quantizer(spec: Any, qparams: tuple[Any, Any] | None) -> Callable[[Any], Any] | None:
    """:func:`fake_quantize_activation` for one group's encoding, its scale and zero point read
    once (None: nothing to simulate). The simulation makes one per observer and runs it at every
    batch and trial: reading the encoding at every call was a fifth of the fake quantize's time."""
    if qparams is None:
        return None
    try:
        qmin, qmax = spec_range(spec)
    except Exception:  # a floating-point spec (fp16 "quantization"): nothing to simulate
        return None
    scale = torch.as_tensor(qparams[0]).detach().to(torch.float32)
    zero_point = torch.as_tensor(qparams[1]).detach().to(torch.int32)
    per_channel = scale.numel() > 1 and is_per_channel(spec)
    axis = int(getattr(spec, "ch_axis", 0) or 0)
    one_scale, one_zero = float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0])
    inverse = 1.0 / torch.tensor(one_scale, dtype=torch.float32)  # made once, not per call
    native = kernels.fake_quantizer(float(inverse), one_scale, one_zero, qmin, qmax)

    def torch_path(value: torch.Tensor) -> torch.Tensor:
        if per_channel:
            return torch.fake_quantize_per_channel_affine(
                value, scale, zero_point, axis % value.dim(), qmin, qmax
            )
        return fake_quantize_per_tensor(value, one_scale, one_zero, qmin, qmax, inverse, native=False)

    def quantize(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        same = x.dtype is torch.float32  # the usual case: no cast either way (two calls of 60k
        value = x if same else x.to(torch.float32)  # on an LLM's guard)
        out = None
        if not per_channel:  # one pass of the native kernel, where it applies
            out = native(value)
        if out is None:
            if value.numel() <= ELEMENTWISE_ONE_THREAD:
                with single_thread():
                    out = torch_path(value)
            else:
                out = torch_path(value)
        return out if same else out.to(x.dtype)

    return quantize


#: codes (``x / scale``) below this magnitude round, shift and clamp the same in float32 as in
#: ATen's int64 arithmetic (beyond it, or not finite, its cast to int64 is undefined behaviour)
EXACT_CODES = 2.0**62


def fake_quantize_per_tensor(
    value: torch.Tensor,
    scale: float,
    zero_point: int,
    qmin: int,
    qmax: int,
    inverse: torch.Tensor | None = None,
    native: bool = True,
) -> torch.Tensor:
    """``torch.fake_quantize_per_tensor_affine`` of a float32 ``value``, the same values, in one
    pass of the native kernel (:func:`~_quantplug.observers.kernels.fake_quantize`) or else five
    vectorized passes: ATen's kernel runs element by element, 3-10x slower on an LLM's activations,
    where the algorithm guard's trials spent a quarter of their time in it; the five passes and
    their min/max check cost 4-5x the kernel's one pass (110M Llama's guard: about 0.5 s of 11).

    The same float operations: ``value * (1.0f / scale)`` rounded half to even, the zero point
    added in float, clamped, shifted back and multiplied by the scale (ATen multiplies in double
    the float scale by a whole number: correctly rounded to float, as float32's product is).
    ATen's own kernel runs where those could differ: a grid or zero point float32 does not count
    exactly (2^24 and beyond), and codes that are not finite or beyond :data:`EXACT_CODES` (its
    int64 cast is undefined there: x86 maps them to ``quant_min``). ``inverse``: that ``1.0f / scale``
    as a float32 tensor, where the caller made it once (the guard fake-quantizes each activation
    once per trial: making it at every call was a sixth of the calls' time); ``native=False``: not
    the kernel (the caller tried it)."""
    if max(abs(qmin), abs(qmax), abs(zero_point)) < 2**24 and value.numel():
        if inverse is None:
            inverse = 1.0 / torch.tensor(scale, dtype=torch.float32)
        if native:
            done = kernels.fake_quantize(value, float(inverse), scale, zero_point, qmin, qmax)
            if done is not None:
                return done
        codes = torch.mul(value, inverse)
        low, high = torch.aminmax(codes)
        if -EXACT_CODES < float(low) and float(high) < EXACT_CODES:
            return codes.round_().add_(zero_point).clamp_(qmin, qmax).sub_(zero_point).mul_(scale)
    return torch.fake_quantize_per_tensor_affine(value, scale, zero_point, qmin, qmax)


#: activations of at most this many elements are fake-quantized on one thread: an LLM's are a
#: few tokens wide, where a parallel region costs more than the work (and on a busy machine waits
#: for a descheduled worker, milliseconds per activation); elementwise, the values are the same.
#: The torch path only: the native kernel (one pass) runs on the calling thread
ELEMENTWISE_ONE_THREAD = 1 << 18


#: the encoding of an observer the simulation leaves as it is (none calibrated)
_UNSIMULATED: tuple[Any, Any] = (None, None)


class _Done(Exception):
    """Raised once every layer input a pass wants has been seen (the rest of the model is not run)."""


class QuantizedSimulation(Interpreter):
    """The prepared program run as its quantized form would compute it, feeding layer inputs.

    Args:
        prepared: the calibrated prepared module (not modified).
        activation: ``gid -> (spec, qparams or None)`` for every observer in the graph.
        weights: ``get_attr target -> tensor`` read instead of the float weight (dequantized codes):
            the weights the algorithms changed.
        feeds: ``layer node name -> callables`` given that layer's arguments (as the node receives them).
        is_tap: which call_module nodes are calibration taps (skipped).
        rounded: ``get_attr target -> tensor or None``, what a weight not in ``weights`` reads (its
            rounding to nearest, made from the program's own tensor at each read, never stored;
            None: the program's tensor). Every other attribute is the program's own tensor.

    Memory: the program's parameters are shared, never copied; only the weights the algorithms
    changed are held (a model with a 1M-row embedding and one 64x64 layer GPTQ changes holds
    that layer, not the table: the table's copies cost 1.9 GB).
    """

    def __init__(
        self,
        prepared: GraphModule,
        activation: Mapping[int, tuple[Any, tuple[Any, Any] | None]],
        weights: Mapping[str, torch.Tensor],
        feeds: Mapping[str, Sequence[Callable[[Sequence[Any]], None]]],
        is_tap: Callable[[Node], bool],
        rounded: Callable[[str], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(prepared, garbage_collect_values=True)
        self.activation = activation
        self.weights = weights
        self.feeds = feeds
        self.is_tap = is_tap
        self.rounded = rounded
        self._left: set[str] = set()
        #: per observer: the encoding its quantizer was made from, and the quantizer
        self._quantizers: dict[int, tuple[Any, Callable[[Any], Any] | None]] = {}

    def run_batch(self, batch: Sequence[Any]) -> None:
        self._left = set(self.feeds)
        try:
            with torch.no_grad():
                self.run(*batch)
        except _Done:
            pass

    def outputs(self, batch: Sequence[Any]) -> Any:
        """The program's outputs for ``batch`` (what the guard compares; no layer input is fed)."""
        self._left = set()
        with torch.no_grad():
            return self.run(*batch)

    def run_node(self, n: Node) -> Any:
        if n.op == "call_module" and (self.is_tap(n) or (not n.users and observer_gid(n.target) is not None)):
            return None  # a tap, or an observer nothing reads (and a value no node uses stays in
            # the environment to the end of the run: a weight's rounded copy)
        if n.name in self._left:
            args, _ = self.fetch_args_kwargs_from_env(n)
            for feed in self.feeds[n.name]:
                feed(args)
            self._left.discard(n.name)
            if not self._left:
                raise _Done
        return super().run_node(n)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        replaced = self.weights.get(str(target))
        if replaced is None and self.rounded is not None:
            replaced = self.rounded(str(target))
        return replaced if replaced is not None else super().get_attr(target, args, kwargs)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        gid = observer_gid(target)
        if gid is not None:
            return self.observe(gid, args[0])
        return super().call_module(target, args, kwargs)

    def observe(self, gid: int, x: Any) -> Any:
        """What group ``gid``'s observer gives ``x`` in the simulation: ``x`` fake-quantized with
        its calibrated encoding. A constant's parked observer is not in ``activation``: its input
        (the weight as ``get_attr`` gave it) as is."""
        entry = self.activation.get(gid, _UNSIMULATED)
        made = self._quantizers.get(gid)
        if made is None or made[0] is not entry:  # made once per encoding
            made = self._quantizers[gid] = (entry, activation_quantizer(*entry))
        quantize = made[1]
        return x if quantize is None else quantize(x)


#: one node's step in :meth:`IncrementalOutputs._run_from`: the live values -> the node's value
Step = Callable[[dict[Node, Any]], Any]

#: argument values that hold no node and that the interpreter passes on as they are
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _arguments(values: Sequence[Any]) -> Callable[[dict[Node, Any]], list[Any]]:
    """``values`` (a node's args, or its kwargs' values) as the interpreter would hand them over
    (nodes replaced by their values, containers rebuilt by ``map_arg``), read from the live values:
    without the interpreter's checks and recursion for the usual arguments, a node or a constant."""
    template = list(values)
    nodes = [(i, v) for i, v in enumerate(template) if isinstance(v, Node)]
    nested = [(i, v) for i, v in enumerate(template) if not isinstance(v, (Node, *_PLAIN))]
    if not nested:

        def load(env: dict[Node, Any]) -> list[Any]:
            out = template.copy()
            for i, node in nodes:
                out[i] = env[node]
            return out

        return load

    def load_nested(env: dict[Node, Any]) -> list[Any]:
        out = template.copy()
        for i, node in nodes:
            out[i] = env[node]
        for i, value in nested:
            out[i] = map_arg(value, env.__getitem__)
        return out

    return load_nested


def _step(sim: QuantizedSimulation, node: Node) -> Step | None:
    """``node``'s step: what ``sim.run_node(node)`` computes (the same calls on the same values),
    without the interpreter's per-node dispatch, checks and context (110M Llama's guard runs 78k
    nodes over its 96 trials: 0.3-0.6 s of 10 s, thread time). None: ``sim.run_node`` itself
    (placeholders, the output, a node a pass feeds)."""
    if node.op == "call_module" and (
        sim.is_tap(node) or (not node.users and observer_gid(node.target) is not None)
    ):
        return lambda env: None
    if node.name in sim.feeds:
        return None
    args = _arguments(node.args)
    keys = list(node.kwargs)
    values = _arguments(list(node.kwargs.values()))
    target = node.target
    if node.op == "get_attr":
        name = str(target)
        return lambda env: sim.get_attr(name, (), {})
    if node.op == "call_function" and callable(target):
        if not keys:
            return lambda env: target(*args(env))
        return lambda env: target(*args(env), **dict(zip(keys, values(env))))
    if node.op == "call_module" and not keys and len(node.args) == 1:
        gid = observer_gid(target)
        if gid is not None:
            return lambda env: sim.observe(gid, args(env)[0])
    return None


def _reads_weight(node: Node) -> bool:
    """A ``get_attr`` node or a parked observer of one, whose value in a simulation is the
    weight the selection gives (rounded at each read): checkpoints keep neither."""
    return behind_parked(node).op == "get_attr"


class _Run:
    """One cached run of :class:`IncrementalOutputs`: the weights it read, per batch the live
    values at each checkpoint (references: the interpreter's own values, no copies; the weights
    live there as None, read again on resuming) and the outputs."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = dict(weights)
        self.checkpoints: list[dict[int, dict[Node, Any]]] = []
        self.outputs: list[Any] = []


class IncrementalOutputs:
    """The quantized simulation's outputs for many weight selections that differ in a few weights,
    each run resumed from the last node no changed weight reaches.

    The algorithm guard judges one weight site at a time (:meth:`ModelGuard.select`): every trial
    differs from a run already made in one site's weight (and bias). The nodes before the first
    one reading that weight compute what they computed then, so a trial resumes from a checkpoint
    (the live values before that node, kept from the earlier run) instead of re-running the whole
    program: an LLM's last layers cost their own share of a forward pass, not a whole one. Without
    it the guard cost one full simulated forward per changed site, 93 % of convert's time on a
    4-layer, 20M-parameter Llama with GPTQ.

    Checkpoints sit before each node that first reads a weight (one per weight site); they hold
    only the values still live there (the interpreter frees the rest), which in a transformer is
    the residual stream and a few shared tensors. The :data:`CACHED_RUNS` most recent runs are
    kept. Results are those of a full run: the same nodes compute the same values from the same
    inputs.

    Each node runs by a step made once (:func:`_step`: its target called on its arguments read
    from the live values), not by the interpreter's ``run_node``, whose per-node dispatch, checks
    and context cost a few microseconds on each of the tens of thousands of nodes a guard runs;
    the calls, and so the values, are the interpreter's.
    """

    #: runs kept to resume from (the guard's current selection and its latest trial)
    CACHED_RUNS = 2

    def __init__(self, simulation: QuantizedSimulation, batches: Sequence[Sequence[Any]]) -> None:
        self.simulation = simulation
        self.batches = batches
        self.nodes = list(simulation.graph.nodes)
        index = {n: i for i, n in enumerate(self.nodes)}
        self.reads: dict[str, list[Node]] = {}  # get_attr target -> its get_attr nodes
        self.first_use: dict[str, int] = {}  # get_attr target -> index of its first reader
        for n in self.nodes:
            if n.op == "get_attr":
                target = str(n.target)
                self.reads.setdefault(target, []).append(n)
                # a reader whose result nobody reads changes nothing; a weight's parked observer
                # (just before the weight's first reader) reads it as its readers do
                users = [index[u] for u in n.users if u.users or u.op == "output"]
                if users:
                    self.first_use[target] = min(self.first_use.get(target, len(self.nodes)), *users)
        # a value written in place after a checkpoint would reach the runs resumed from it: such
        # programs (an in-place op on a tensor they make, or on their input) run whole, each on
        # copies of its inputs where it writes them
        self.points = (
            frozenset() if any(written_args(n) for n in self.nodes) else frozenset(self.first_use.values())
        )
        self.private = writes_an_input(simulation.graph)
        self.runs: list[_Run] = []
        #: the nodes whose value is a weight (:func:`_reads_weight`), found once: a checkpoint asks
        #: of every live value at every trial
        self.weight_readers = frozenset(n for n in self.nodes if _reads_weight(n))
        #: each node's step (:func:`_step`) and the values that die after it, made once
        self.steps = [_step(simulation, n) for n in self.nodes]
        self.dead = [simulation.user_to_last_uses.get(n, []) for n in self.nodes]
        #: per checkpoint, the weights live there, in the order of the live values: which values
        #: are live before a node is fixed by the graph (each node's value stays until its last
        #: user ran), so a checkpoint copies the live values and blanks these, not asks of each
        live: dict[Node, None] = {}
        self.live_weights: dict[int, tuple[Node, ...]] = {}
        for i, n in enumerate(self.nodes):
            if i in self.points:
                self.live_weights[i] = tuple(v for v in live if v in self.weight_readers)
            live[n] = None
            for value in self.dead[i]:
                del live[value]

    def _start(self, run: _Run, weights: Mapping[str, torch.Tensor]) -> int | None:
        """The checkpoint ``run`` can resume from for ``weights`` (None: the same weights)."""
        changed = [t for t in run.weights.keys() | weights.keys() if run.weights.get(t) is not weights.get(t)]
        if not changed:
            return None
        first = min(self.first_use.get(t, len(self.nodes)) for t in changed)
        kept = run.checkpoints[0].keys() if run.checkpoints else ()
        return max((p for p in kept if p <= first), default=0)

    def __call__(self, weights: Mapping[str, torch.Tensor]) -> list[Any]:
        start, base = 0, None
        for run in self.runs:
            resume = self._start(run, weights)
            if resume is None:  # these weights ran last time or the time before
                self.runs.remove(run)
                self.runs.append(run)
                return run.outputs
            if resume > start:
                start, base = resume, run
        sim = self.simulation
        sim.weights = dict(weights)
        new = _Run(weights)
        for b, batch in enumerate(self.batches):
            env: dict[Node, Any] = {}
            if base is not None:
                env = dict(base.checkpoints[b][start])
                for n in self.live_weights[start]:  # weights read before the checkpoint, still live
                    # there: this selection's (a checkpoint may be an older run's)
                    env[n] = sim.get_attr(behind_parked(n).target, (), {})
            snapshots: dict[int, dict[Node, Any]] = {}
            output = self._run_from(env, start, private_inputs(batch) if self.private else batch, snapshots)
            if base is not None:  # the checkpoints before the resumed one are the base run's
                snapshots.update({p: v for p, v in base.checkpoints[b].items() if p < start})
            new.checkpoints.append(snapshots)
            new.outputs.append(output)
        self.runs.append(new)
        del self.runs[: -self.CACHED_RUNS]
        return new.outputs

    def _run_from(
        self, env: dict[Node, Any], start: int, batch: Sequence[Any], snapshots: dict[int, dict[Node, Any]]
    ) -> Any:
        sim = self.simulation
        sim._left = set()
        sim.env = env
        sim.args_iter = iter(sim.graph.process_inputs(*batch))
        nodes, steps, dead, points = self.nodes, self.steps, self.dead, self.points
        live_weights = self.live_weights
        with torch.no_grad():
            for i in range(start, len(nodes)):
                node = nodes[i]
                if i in points:  # a weight live there is read again on resuming, not kept:
                    # rounded at each read (QuantizedSimulation.rounded), kept it would be a copy
                    snapshot = snapshots[i] = env.copy()
                    for n in live_weights[i]:
                        snapshot[n] = None
                step = steps[i]
                env[node] = sim.run_node(node) if step is None else step(env)
                for value in dead[i]:
                    del env[value]
                if node.op == "output":
                    return sim.graph.process_outputs(env[node])
        raise AlgorithmError("the simulated program has no output node")
