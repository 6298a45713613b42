"""One small real graph per ATen op, for the conformance kit (ONNX's "node tests").

Most samples are FX graphs built directly around one call of the op, with the node targets,
argument structure and ``meta["val"]`` an exported graph has: inputs are placeholders, weights and
indices constants (``get_attr``), tuple results read through ``operator.getitem``. Building them
takes milliseconds and reaches ops ``torch.export`` never emits in a given version (in-place and
``*_copy`` variants), which backends still claim. Ops that live inside a module's state
(recurrent layers) are exported from ``nn`` modules instead.

Each input has a value range suited to its op (positive for ``log``/``sqrt``, inside ``(-1, 1)``
for ``asin``...); batches are drawn from a seeded generator, so a sample's numbers are the same
on every machine and every run.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule

from _quantplug.graph.op_names import op_name

aten = torch.ops.aten


@dataclass(frozen=True)
class In:
    """A float input of the graph (a placeholder), uniform in ``[low, high]``."""

    shape: tuple[int, ...]
    low: float = -3.0
    high: float = 3.0


@dataclass(frozen=True)
class Const:
    """A constant (``get_attr``): float weights, integer indices (``values``) or a bool mask."""

    shape: tuple[int, ...] = ()
    low: float = -1.0
    high: float = 1.0
    values: tuple[int, ...] | None = None  # long indices, reshaped to ``shape`` when given
    mask: bool = False  # a bool tensor (every other element True)

    def tensor(self) -> torch.Tensor:
        if self.values is not None:
            return torch.tensor(self.values, dtype=torch.long).reshape(self.shape or (len(self.values),))
        if self.mask:
            n = 1
            for s in self.shape:
                n *= s
            return (torch.arange(n) % 2 == 0).reshape(self.shape)
        gen = torch.Generator().manual_seed(1234)
        return torch.rand(self.shape, generator=gen) * (self.high - self.low) + self.low


@dataclass(frozen=True)
class Call:
    """One call of ``op`` with ``args`` (``In``/``Const`` where tensors go, lists allowed)."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    random: bool = False  # the op draws random numbers: outputs are not compared


@dataclass
class Sample:
    """A ready graph and how to feed it: ``batch(seed)`` gives one tuple of inputs."""

    op: str
    model: torch.nn.Module
    input_specs: tuple[In, ...] = ()
    example: tuple[torch.Tensor, ...] | None = None
    random: bool = False
    factory: Callable[[], tuple[Any, tuple[Any, ...]]] | None = None

    def batch(self, seed: int) -> tuple[torch.Tensor, ...]:
        if self.example is not None:  # a module sample: its inputs, perturbed per seed
            gen = torch.Generator().manual_seed(seed)
            return tuple(
                x + 0.1 * torch.randn(x.shape, generator=gen) if x.is_floating_point() and seed else x.clone()
                for x in self.example
            )
        gen = torch.Generator().manual_seed(seed)
        return tuple(_uniform(s, gen) for s in self.input_specs)


def _uniform(spec: In, gen: torch.Generator) -> torch.Tensor:
    """Uniform in ``[low, high]``, both ends included: every batch covers the input's range, as
    a calibration set should (a few uniform draws would understate it)."""
    value = torch.rand(spec.shape, generator=gen) * (spec.high - spec.low) + spec.low
    flat = value.view(-1)
    if flat.numel() >= 2:
        flat[0], flat[-1] = spec.low, spec.high
    return value


def build_call(call: Call) -> Sample:
    """The graph ``inputs -> op -> outputs`` with real ``meta["val"]`` on every node."""
    root = nn.Module()
    graph = Graph()
    specs: list[In] = []
    concrete_inputs: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(0)

    def lower(a: Any) -> tuple[Any, Any]:
        """(graph argument, concrete value) of one argument."""
        if isinstance(a, In):
            value = _uniform(a, gen)
            node = graph.placeholder(f"x{len(specs)}")
            node.meta["val"] = value
            specs.append(a)
            concrete_inputs.append(value)
            return node, value
        if isinstance(a, Const):
            value = a.tensor()
            name = f"c{len(root._buffers)}"
            root.register_buffer(name, value)
            node = graph.get_attr(name)
            node.meta["val"] = value
            return node, value
        if isinstance(a, (list, tuple)):
            pairs = [lower(x) for x in a]
            return type(a)(p[0] for p in pairs), type(a)(p[1] for p in pairs)
        return a, a

    lowered = [lower(a) for a in call.args]
    kw = {k: lower(v) for k, v in call.kwargs.items()}
    # in-place ops write their first argument: compute meta on clones
    values = [_clone(v) for _, v in lowered]
    result = call.op(*values, **{k: _clone(v) for k, (_, v) in kw.items()})
    node = graph.call_function(call.op, tuple(n for n, _ in lowered), {k: n for k, (n, _) in kw.items()})
    node.meta["val"] = result
    outputs = []
    if isinstance(result, (tuple, list)):
        for i, item in enumerate(result):
            if isinstance(item, torch.Tensor):
                piece = graph.call_function(operator.getitem, (node, i))
                piece.meta["val"] = item
                outputs.append(piece)
    else:
        outputs.append(node)
    graph.output(tuple(outputs))
    gm = GraphModule(root, graph, class_name="ConformanceSample")
    return Sample(op_name(call.op), gm, tuple(specs), random=call.random)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def module_sample(op: str, factory: Callable[[], tuple[Any, tuple[Any, ...]]]) -> Sample:
    """A sample exported from a module (recurrent layers, a vendor's own samples)."""
    model, inputs = factory()
    return Sample(op, model.eval(), example=tuple(inputs), factory=factory)


# --- the catalogue ------------------------------------------------------------------------------

X = In((2, 8))
POS = In((2, 8), 0.25, 4.0)
UNIT = In((2, 8), -0.9, 0.9)
IMG = In((1, 4, 6, 6))
SEQ = In((1, 2, 8))
VOL = In((1, 2, 4, 4, 4))


def _unary(op: Any, x: In = X, *extra: Any, **kwargs: Any) -> Call:
    return Call(op, (x, *extra), kwargs)


def _binary(op: Any, a: In = X, b: In = X) -> Call:
    return Call(op, (a, b))


CATALOGUE: dict[str, Call] = {}


def _add(*calls: Call) -> None:
    for c in calls:
        CATALOGUE[op_name(c.op)] = c


_add(
    # elementwise, one input
    *(
        _unary(op)
        for op in (
            aten.abs.default,
            aten.neg.default,
            aten.sin.default,
            aten.cos.default,
            aten.atan.default,
            aten.square.default,
            aten.sigmoid.default,
            aten.sigmoid_.default,
            aten.tanh.default,
            aten.tanh_.default,
            aten.relu.default,
            aten.relu_.default,
            aten.relu6.default,
            aten.gelu.default,
            aten.silu.default,
            aten.silu_.default,
            aten.hardswish.default,
            aten.hardswish_.default,
            aten.hardsigmoid.default,
            aten.hardsigmoid_.default,
            aten.elu.default,
            aten.leaky_relu.default,
            aten.leaky_relu_.default,
            aten.clone.default,
            aten.alias.default,
            aten.contiguous.default,
        )
    ),
    _unary(aten.exp.default, In((2, 8), -2.0, 2.0)),
    _unary(aten.log.default, POS),
    _unary(aten.sqrt.default, POS),
    _unary(aten.rsqrt.default, POS),
    _unary(aten.asin.default, UNIT),
    # rounding: a step function amplifies input rounding near its steps; keep the batch's ends
    # (which every batch contains) off the steps, and use more values
    _unary(aten.round.decimals, In((4, 16), -2.96, 2.96), decimals=1),
    *(
        _unary(op, In((4, 16), -2.7, 2.7))
        for op in (aten.ceil.default, aten.floor.default, aten.round.default, aten.sign.default)
    ),
    _unary(aten.hardtanh.default, X, -1.0, 1.0),
    _unary(aten.hardtanh_.default, X, -1.0, 1.0),
    _unary(aten.clamp.default, X, -1.0, 1.0),
    _unary(aten.clamp_min.default, X, 0.0),
    _unary(aten.clamp_max.default, X, 0.5),
    _unary(aten.softmax.int, X, -1),
    _unary(aten._softmax.default, X, -1, False),
    _unary(aten._safe_softmax.default, X, -1),
    _unary(aten.log_softmax.int, X, -1),
    _unary(aten._log_softmax.default, X, -1, False),
    _unary(aten.dropout.default, X, 0.5, False),
    _unary(aten.to.dtype, X, torch.float16),
    _unary(aten.cumsum.default, X, 1),
    Call(aten.prelu.default, (X, Const((8,), 0.1, 0.3))),
    # elementwise, two inputs
    *(
        _binary(op)
        for op in (
            aten.add.Tensor,
            aten.add_.Tensor,
            aten.sub.Tensor,
            aten.rsub.Tensor,
            aten.mul.Tensor,
            aten.mul_.Tensor,
            aten.maximum.default,
            aten.minimum.default,
            aten.max.other,
            aten.min.other,
            aten.eq.Tensor,
            aten.ne.Tensor,
            aten.ge.Tensor,
            aten.gt.Tensor,
            aten.le.Tensor,
            aten.lt.Tensor,
        )
    ),
    _binary(aten.div.Tensor, X, POS),
    _binary(aten.divide.Tensor, X, POS),
    _binary(aten.floor_divide.default, In((2, 8), 0.0, 8.0), In((2, 8), 1.0, 2.0)),
    _binary(aten.pow.Tensor_Tensor, In((2, 8), 0.5, 2.0), In((2, 8), -1.0, 1.0)),
    Call(aten.where.self, (Const((2, 8), mask=True), X, X)),
    Call(aten.where.ScalarSelf, (Const((2, 8), mask=True), 0.5, X)),
    Call(aten.masked_fill.Tensor, (X, Const((2, 8), mask=True), Const((), 0.5, 0.5))),
    *(
        Call(op, (Const((2, 8), mask=True), Const((2, 8), mask=True)))
        for op in (
            aten.__and__.Tensor,
            aten.__or__.Tensor,
            aten.__xor__.Tensor,
            aten.bitwise_or.Tensor,
            aten.bitwise_xor.Tensor,
            aten.logical_and.default,
        )
    ),
    # made from nothing (or from a shape)
    Call(aten.arange.default, (8.0,), {"dtype": torch.float32}),
    Call(aten.arange.start, (0.0, 8.0), {"dtype": torch.float32}),
    Call(aten.arange.start_step, (0.0, 8.0, 0.5), {"dtype": torch.float32}),
    Call(aten.full.default, ([2, 8], 0.5), {"dtype": torch.float32}),
    Call(aten.ones.default, ([2, 8],), {"dtype": torch.float32}),
    Call(aten.zeros.default, ([2, 8],), {"dtype": torch.float32}),
    Call(aten.scalar_tensor.default, (1.5,), {"dtype": torch.float32}),
    Call(aten.rand.default, ([2, 8],), {"dtype": torch.float32}, random=True),
    Call(aten.randn.default, ([2, 8],), {"dtype": torch.float32}, random=True),
    _unary(aten.full_like.default, X, 0.5),
    _unary(aten.ones_like.default),
    _unary(aten.zeros_like.default),
    # shape and data movement
    _unary(aten.view.default, X, [4, 4]),
    _unary(aten._unsafe_view.default, X, [4, 4]),
    _unary(aten.view_copy.default, X, [4, 4]),
    _unary(aten.reshape.default, X, [16]),
    _unary(aten.permute.default, X, [1, 0]),
    _unary(aten.permute_copy.default, X, [1, 0]),
    _unary(aten.transpose.int, X, 0, 1),
    _unary(aten.swapaxes.default, X, 0, 1),
    _unary(aten.t.default),
    _unary(aten.flatten.using_ints, In((2, 4, 2)), 1, 2),
    _unary(aten.unflatten.int, X, 1, [2, 4]),
    _unary(aten.squeeze.default, In((2, 1, 8))),
    _unary(aten.squeeze.dim, In((2, 1, 8)), 1),
    _unary(aten.squeeze.dims, In((2, 1, 8)), [1]),
    _unary(aten.squeeze_copy.dim, In((2, 1, 8)), 1),
    _unary(aten.squeeze_copy.dims, In((2, 1, 8)), [1]),
    _unary(aten.unsqueeze.default, X, 1),
    _unary(aten.unsqueeze_copy.default, X, 1),
    _unary(aten.expand.default, In((2, 1)), [2, 8]),
    _unary(aten.expand_copy.default, In((2, 1)), [2, 8]),
    Call(aten.expand_as.default, (In((1, 8)), X)),
    _unary(aten.repeat.default, X, [2, 1]),
    _unary(aten.flip.default, X, [1]),
    _unary(aten.roll.default, X, [1], [1]),
    _unary(aten.narrow.default, X, 1, 0, 4),
    _unary(aten.slice.Tensor, X, 1, 0, 4),
    _unary(aten.slice_copy.Tensor, X, 1, 0, 4),
    _unary(aten.select.int, X, 1, 0),
    _unary(aten.select_copy.int, X, 1, 0),
    Call(aten.index_select.default, (X, 1, Const((3,), values=(0, 2, 5)))),
    _unary(aten.pad.default, X, [1, 1], "constant", 0.0),
    _unary(aten.constant_pad_nd.default, X, [1, 1], 0.0),
    _unary(aten.reflection_pad1d.default, SEQ, [1, 1]),
    _unary(aten.reflection_pad2d.default, IMG, [1, 1, 1, 1]),
    _unary(aten.pixel_shuffle.default, In((1, 4, 3, 3)), 2),
    _unary(aten.pixel_unshuffle.default, In((1, 1, 4, 4)), 2),
    _unary(aten.channel_shuffle.default, In((1, 4, 3, 3)), 2),
    Call(aten.cat.default, ([X, In((2, 8), -1.0, 1.0)], 1)),
    Call(aten.concat.default, ([X, In((2, 8), -1.0, 1.0)], 1)),
    Call(aten.stack.default, ([X, In((2, 8), -1.0, 1.0)], 0)),
    _unary(aten.split.Tensor, X, 4, 1),
    _unary(aten.split_with_sizes.default, X, [4, 4], 1),
    _unary(aten.split_with_sizes_copy.default, X, [4, 4], 1),
    _unary(aten.chunk.default, X, 2, 1),
    _unary(aten.unbind.int, X, 0),
    Call(aten.gather.default, (X, 1, Const((2, 4), values=(0, 3, 5, 7, 1, 2, 4, 6)))),
    Call(aten.index.Tensor, (In((4, 8)), [Const((3,), values=(0, 2, 3))])),
    Call(aten.index_put.default, (In((4, 8)), [Const((2,), values=(0, 2))], In((2, 8)), False)),
    Call(aten.index_put_.default, (In((4, 8)), [Const((2,), values=(0, 2))], In((2, 8)), False)),
    Call(aten.index_copy.default, (In((4, 8)), 0, Const((2,), values=(1, 3)), In((2, 8)))),
    Call(aten.index_copy_.default, (In((4, 8)), 0, Const((2,), values=(1, 3)), In((2, 8)))),
    Call(aten.scatter.src, (X, 1, Const((2, 4), values=(0, 3, 5, 7, 1, 2, 4, 6)), In((2, 4)))),
    Call(aten.scatter.value, (X, 1, Const((2, 4), values=(0, 3, 5, 7, 1, 2, 4, 6)), 0.5)),
    Call(aten.scatter_add.default, (X, 1, Const((2, 4), values=(0, 3, 5, 7, 1, 2, 4, 6)), In((2, 4)))),
    Call(
        aten.scatter_reduce.two,
        (X, 1, Const((2, 4), values=(0, 3, 5, 7, 1, 2, 4, 6)), In((2, 4)), "sum"),
    ),
    Call(aten.slice_scatter.default, (X, In((2, 4)), 1, 0, 4)),
    # reductions
    _unary(aten.amax.default, X, [1], True),
    _unary(aten.amin.default, X, [1], True),
    _unary(aten.argmax.default, X, 1),
    _unary(aten.argmin.default, X, 1),
    _unary(aten.max.dim, X, 1),
    _unary(aten.min.dim, X, 1),
    _unary(aten.mean.default),
    _unary(aten.mean.dim, X, [1], True),
    _unary(aten.sum.default),
    _unary(aten.sum.dim_IntList, X, [1], True),
    _unary(aten.linalg_vector_norm.default, X, 2, [1], True),
    _unary(aten.topk.default, X, 3),
    _unary(aten.sort.default, X),
    # matrix products
    Call(aten.linear.default, (X, Const((4, 8), -0.4, 0.4), Const((4,), -0.1, 0.1))),
    Call(aten.matmul.default, (X, In((8, 4)))),
    Call(aten.mm.default, (X, In((8, 4)))),
    Call(aten.bmm.default, (In((2, 3, 4)), In((2, 4, 5)))),
    Call(aten.addmm.default, (Const((4,), -0.1, 0.1), X, Const((8, 4), -0.4, 0.4))),
    Call(aten.baddbmm.default, (In((2, 3, 5)), In((2, 3, 4)), In((2, 4, 5)))),
    Call(aten.cdist.default, (In((2, 4, 3)), In((2, 5, 3)))),
    # convolutions
    Call(aten.conv1d.default, (SEQ, Const((4, 2, 3), -0.4, 0.4), Const((4,), -0.1, 0.1))),
    Call(aten.conv2d.default, (IMG, Const((3, 4, 3, 3), -0.3, 0.3), Const((3,), -0.1, 0.1))),
    Call(aten.conv2d.padding, (IMG, Const((3, 4, 3, 3), -0.3, 0.3), Const((3,), -0.1, 0.1), [1, 1], "same")),
    Call(aten.conv3d.default, (VOL, Const((3, 2, 2, 2, 2), -0.3, 0.3), Const((3,), -0.1, 0.1))),
    Call(aten.conv_transpose1d.default, (SEQ, Const((2, 4, 3), -0.4, 0.4), Const((4,), -0.1, 0.1))),
    Call(aten.conv_transpose2d.input, (IMG, Const((4, 3, 3, 3), -0.3, 0.3), Const((3,), -0.1, 0.1))),
    Call(aten.conv_transpose3d.input, (VOL, Const((2, 3, 2, 2, 2), -0.3, 0.3), Const((3,), -0.1, 0.1))),
    Call(
        aten.convolution.default,
        (
            IMG,
            Const((3, 4, 3, 3), -0.3, 0.3),
            Const((3,), -0.1, 0.1),
            [1, 1],
            [0, 0],
            [1, 1],
            False,
            [0, 0],
            1,
        ),
    ),
    # pooling
    _unary(aten.max_pool1d.default, SEQ, [2]),
    _unary(aten.max_pool2d.default, IMG, [2, 2]),
    _unary(aten.max_pool2d_with_indices.default, IMG, [2, 2]),
    _unary(aten.max_pool3d.default, VOL, [2, 2, 2]),
    _unary(aten.avg_pool1d.default, SEQ, [2]),
    _unary(aten.avg_pool2d.default, IMG, [2, 2]),
    _unary(aten.avg_pool3d.default, VOL, [2, 2, 2]),
    _unary(aten.adaptive_avg_pool1d.default, SEQ, [4]),
    _unary(aten.adaptive_avg_pool2d.default, IMG, [1, 1]),
    _unary(aten.adaptive_avg_pool3d.default, VOL, [1, 1, 1]),
    _unary(aten.adaptive_max_pool2d.default, IMG, [2, 2]),
    # normalization
    Call(
        aten.batch_norm.default,
        (
            IMG,
            Const((4,), 0.5, 1.5),
            Const((4,), -0.2, 0.2),
            Const((4,), -0.5, 0.5),
            Const((4,), 0.5, 2.0),
            False,
            0.1,
            1e-5,
            True,
        ),
    ),
    Call(aten.group_norm.default, (IMG, 2, Const((4,), 0.5, 1.5), Const((4,), -0.2, 0.2), 1e-5, True)),
    Call(
        aten.instance_norm.default,
        (IMG, Const((4,), 0.5, 1.5), Const((4,), -0.2, 0.2), None, None, True, 0.1, 1e-5, True),
    ),
    Call(aten.layer_norm.default, (X, [8], Const((8,), 0.5, 1.5), Const((8,), -0.2, 0.2), 1e-5, True)),
    Call(aten.native_layer_norm.default, (X, [8], Const((8,), 0.5, 1.5), Const((8,), -0.2, 0.2), 1e-5)),
    Call(aten.rms_norm.default, (X, [8], Const((8,), 0.5, 1.5), 1e-6)),
    # resampling
    _unary(aten.upsample_nearest1d.vec, SEQ, None, [2.0]),
    _unary(aten.upsample_nearest2d.vec, IMG, None, [2.0, 2.0]),
    _unary(aten.upsample_nearest2d.default, IMG, [12, 12]),
    _unary(aten.upsample_bilinear2d.vec, IMG, None, False, [2.0, 2.0]),
    _unary(aten.upsample_bilinear2d.default, IMG, [12, 12], False),
    _unary(aten.upsample_linear1d.vec, SEQ, None, False, [2.0]),
    _unary(aten.upsample_bicubic2d.vec, IMG, None, False, [2.0, 2.0]),
    Call(aten.grid_sampler.default, (IMG, In((1, 4, 4, 2), -1.0, 1.0), 0, 0, False)),
    _unary(aten.im2col.default, In((1, 2, 4, 4)), [2, 2], [1, 1], [0, 0], [1, 1]),
    _unary(aten.col2im.default, In((1, 8, 9)), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]),
    # lookups and attention
    Call(aten.embedding.default, (Const((10, 4), -1.0, 1.0), Const((2, 3), values=(0, 3, 9, 1, 1, 4)))),
    Call(aten.scaled_dot_product_attention.default, (In((1, 2, 4, 8)), In((1, 2, 4, 8)), In((1, 2, 4, 8)))),
)

#: a tuple-returning op whose pieces show ``operator.getitem``
CATALOGUE["_operator.getitem"] = CATALOGUE["aten.split.Tensor"]


class _Recurrent(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def _recurrent(kind: str) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def factory() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        layer: nn.Module
        with torch.random.fork_rng(devices=[]):  # fixed weights; the process's RNG is left alone
            torch.manual_seed(0)
            if kind == "lstm":
                layer = nn.LSTM(4, 8, batch_first=True)
            elif kind == "gru":
                layer = nn.GRU(4, 8, batch_first=True)
            else:
                layer = nn.RNN(4, 8, nonlinearity=kind, batch_first=True)
        return _Recurrent(layer).eval(), (torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)),)

    return factory


MODULES: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "aten.lstm.input": _recurrent("lstm"),
    "aten.gru.input": _recurrent("gru"),
    "aten.rnn_tanh.input": _recurrent("tanh"),
    "aten.rnn_relu.input": _recurrent("relu"),
}


def sample_for(op: str, overrides: Any = None) -> Sample | None:
    """The sample of ``op``: the backend's own (``ConformanceProfile.samples``), else built in."""
    if overrides is not None and op in overrides:
        return module_sample(op, overrides[op])
    if op in MODULES:
        return module_sample(op, MODULES[op])
    call = CATALOGUE.get(op)
    if call is None:
        return None
    sample = build_call(call)
    sample.op = op
    return sample


def known_ops() -> Sequence[str]:
    return sorted({*CATALOGUE, *MODULES})
