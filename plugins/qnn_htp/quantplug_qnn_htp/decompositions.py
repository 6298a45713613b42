"""Composite ops rewritten, before annotation, into ops HTP runs one by one (issue 17.1).

The QNN converter reads an ONNX model; a PyTorch op that the ONNX exporter expands into several
ONNX ops (scaled dot-product attention, rsqrt, rms_norm...) would leave the
tensors between those ONNX ops without an encoding, computed in float or refused by the
converter. Each rewrite here produces ops that export to one ONNX op each, so every tensor gets
the precision's quantization and each op's HTP constraints apply:

* ``scaled_dot_product_attention`` -> ``mul(q, scale)``, ``matmul(q, k^T)``, the mask
  (``masked_fill(scores, ~mask, -inf)`` for boolean masks and ``is_causal``, ``add`` for float
  masks), ``softmax``, ``matmul(p, v)``; grouped-query attention repeats the K/V heads with
  ``unsqueeze/expand/reshape`` (as ExecuTorch's ``DecomposeScaledDotProductAttention``). The
  ``-inf`` constants then go through ``lift_scalars`` and ``mark_masks``, so the 16-bit mask
  handling (``MaskAwareObserver``) applies to them. The scale multiplies ``q`` once (ExecuTorch
  multiplies both ``q`` and ``k^T`` by its square root: one more quantized tensor).
* ``x @ W + b`` (``matmul``/``mm`` with a constant ``[in, out]`` weight, then the add of a constant
  bias) -> ``addmm``, a FullyConnected quantized as a linear (the rule in ``linear_rules``);
  without a bias -> ``addmm`` with a zero bias (``x @ W.T``, Falcon's, is a ``linear`` by then:
  ``quantplug.flow.hand_written_linear``);
* ``addmm`` that is not a fully connected layer (a non-constant ``mat2`` or bias, or
  ``alpha``/``beta`` other than 1) -> ``mm`` + ``add`` (+ ``mul``), ExecuTorch's
  ``DecomposeAddmm``; ``baddbmm`` -> ``bmm`` + ``add`` (+ ``mul``).
* ``rsqrt`` -> ``sqrt`` + ``reciprocal`` (ONNX has no Rsqrt); a float ``floor_divide`` -> ``div`` + ``floor``;
  ``square`` and ``pow(x, 2)``/``pow(x, 3)`` -> ``mul``s; ``rms_norm`` -> ``mul/mean/add/rsqrt/mul`` (ONNX
  opset 21 has no RMSNormalization).
* ``layer_norm``/``group_norm``/``instance_norm`` without affine parameters -> the same op with
  constant ones (and zeros) as weight (and bias): the exporter would make them after the Q/DQ.
* ``conv1d/2d/3d`` without bias -> the same conv with a constant zero bias (the exporter would
  make one after the Q/DQ; as a constant it gets the derived int32 bias grid).
* ``adaptive_avg_pool2d(x, 1)`` on a non-contiguous ``x`` -> ``mean(x, [-2, -1], keepdim=True)``
  (the exporter otherwise adds a stride-restoring Gather after its ReduceMean).
* ``im2col`` (``nn.Unfold``) -> ``pad``, ``flatten``, ``index_select`` of constant positions,
  ``reshape``: data movement only, so the values stay on the input's grid.

The pass ``cast_bool_operands`` (its own step, after ``decompose``) uses the same builder: a
boolean operand of float arithmetic gets an explicit ``to(dtype)``.

Every new node carries the original's stack and debug handle; shapes and dtypes (``meta["val"]``)
are recomputed on fake tensors. (A linear on a 3-D input, which the exporter writes as
``Transpose + MatMul + Add``, keeps its quantization: ``fully_connected.linear_to_2d`` reshapes it
around a 2-D ``Gemm`` at lowering, where it changes nothing numerically.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug.backend import BackendContext, kept_meta

aten = torch.ops.aten

#: node meta naming the decomposition a node was created by (kept through prepare and convert)
DECOMPOSED_FROM_KEY = "qnn_htp_decomposed_from"
#: node meta marking a per-row statistic (mean square, variance, rms, 1/rms): its rule observes
#: the absolute range, since a moving average clips the rows with the smallest or largest values
#: and the clipped factor then scales the whole row wrongly
ABSOLUTE_RANGE_KEY = "qnn_htp_absolute_range"


def _val(arg: Any) -> Any:
    if isinstance(arg, Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val(a) for a in arg)
    return arg


def _fake_mode(values: Sequence[Any]) -> Any:
    from torch._guards import detect_fake_mode

    flat: list[Any] = []
    for v in values:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    return detect_fake_mode([v for v in flat if isinstance(v, torch.Tensor)])


class _Builder:
    """Inserts nodes before ``anchor`` with the anchor's provenance and recomputed ``val``."""

    def __init__(self, gm: GraphModule, anchor: Node, label: str) -> None:
        self.gm = gm
        self.anchor = anchor
        self.label = label
        self.meta = kept_meta(anchor)
        #: when a list, every node made is appended to it (what one part of a rewrite made)
        self.created: list[Node] | None = None

    def _finish(self, node: Node, value: Any) -> Node:
        if self.created is not None:
            self.created.append(node)
        node.meta.update(self.meta)
        node.meta[DECOMPOSED_FROM_KEY] = self.label
        node.meta["val"] = value
        return node

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        vals = [_val(a) for a in args]
        kvals = {k: _val(v) for k, v in kwargs.items()}
        mode = _fake_mode([*vals, *kvals.values()])
        if mode is not None:
            with mode:
                value = target(*vals, **kvals)
        else:
            value = target(*vals, **kvals)
        with self.gm.graph.inserting_before(self.anchor):
            node = self.gm.graph.call_function(target, tuple(args), kwargs)
        return self._finish(node, value)

    def constant(self, prefix: str, tensor: torch.Tensor, *, exact: bool = False) -> Node:
        """A ``get_attr`` of a new buffer holding ``tensor`` (a static mask, for example), named
        ``prefix`` and a number, or with ``exact`` ``prefix`` itself while that name is free."""
        name, i = prefix, 0
        if not exact or hasattr(self.gm, name):
            while hasattr(self.gm, f"{prefix}{i}"):
                i += 1
            name = f"{prefix}{i}"
        self.gm.register_buffer(name, tensor)
        with self.gm.graph.inserting_before(self.anchor):
            node = self.gm.graph.get_attr(name)
        like = _val(self.anchor)
        mode = _fake_mode([like])
        return self._finish(node, mode.from_tensor(tensor) if mode is not None else tensor)

    def replace(self, new: Node) -> None:
        self.anchor.replace_all_uses_with(new)
        self.gm.graph.erase_node(self.anchor)


def _shape(node: Any) -> tuple[Any, ...]:
    val = _val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _static(dims: Sequence[Any]) -> bool:
    return all(isinstance(d, int) for d in dims)


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_constant(node: Any) -> bool:
    return isinstance(node, Node) and node.op == "get_attr"


# --- scaled dot-product attention ------------------------------------------------------------------


def _size(b: _Builder, x: Node, dim: int) -> Any:
    """Dimension ``dim`` of ``x`` as an argument: the int, or a ``sym_size`` node where it is
    dynamic (a SymInt itself in an argument list is a name the generated code does not define)."""
    size = _shape(x)[dim]
    return size if isinstance(size, int) else b.call(aten.sym_size.int, x, dim % len(_shape(x)))


def _repeat_heads(b: _Builder, x: Node, repeats: int, heads: int) -> Node:
    """``[B, Hk, S, D] -> [B, Hk * repeats, S, D]``, each K/V head repeated (GQA)."""
    expanded = b.call(aten.expand.default, b.call(aten.unsqueeze.default, x, 2), [-1, -1, repeats, -1, -1])
    shape = [_size(b, x, 0), heads * repeats, _size(b, x, 2), _size(b, x, 3)]
    return b.call(aten.reshape.default, expanded, shape)


def _causal_mask(b: _Builder, q: Node, k: Node) -> Node:
    """Boolean ``[L, S]``, True where attention is *not* allowed (above the diagonal)."""
    length, source = _shape(q)[-2], _shape(k)[-2]
    if isinstance(length, int) and isinstance(source, int):
        return b.constant("_qnn_causal_mask_", torch.ones(length, source, dtype=torch.bool).triu(1))
    ones = b.call(aten.new_ones.default, q, [_size(b, q, -2), _size(b, k, -2)], dtype=torch.bool)
    return b.call(aten.triu.default, ones, 1)


def decompose_sdpa(b: _Builder, node: Node) -> Node | None:
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = _arg(node, 3, "attn_mask", None)
    dropout = float(_arg(node, 4, "dropout_p", 0.0) or 0.0)
    causal = bool(_arg(node, 5, "is_causal", False))
    scale: Any = node.kwargs.get("scale")
    if dropout != 0.0 or not all(isinstance(t, Node) for t in (q, k, v)):
        return None  # training-time dropout: leave the op whole (it stays float, with a reason)
    q_shape, k_shape = _shape(q), _shape(k)
    if len(q_shape) < 2 or len(k_shape) < 2:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(q_shape[-1]) if isinstance(q_shape[-1], int) else None
    if scale is None:
        return None
    if len(q_shape) == 4 and len(k_shape) == 4 and q_shape[1] != k_shape[1]:
        if not (isinstance(q_shape[1], int) and isinstance(k_shape[1], int)) or q_shape[1] % k_shape[1]:
            return None
        repeats = q_shape[1] // k_shape[1]
        k, v = _repeat_heads(b, k, repeats, k_shape[1]), _repeat_heads(b, v, repeats, k_shape[1])  # type: ignore[arg-type]
    scaled_q = b.call(aten.mul.Tensor, q, float(scale))
    scores = b.call(aten.matmul.default, scaled_q, b.call(aten.transpose.int, k, -2, -1))
    if causal:
        blocked = _causal_mask(b, q, k)  # type: ignore[arg-type]
        scores = b.call(aten.masked_fill.Scalar, scores, blocked, float("-inf"))
    if isinstance(mask, Node):
        mask_val = _val(mask)
        if isinstance(mask_val, torch.Tensor) and mask_val.dtype == torch.bool:
            scores = b.call(
                aten.masked_fill.Scalar, scores, b.call(aten.logical_not.default, mask), float("-inf")
            )
        else:
            scores = b.call(aten.add.Tensor, scores, mask)
    probs = b.call(aten.softmax.int, scores, -1)
    return b.call(aten.matmul.default, probs, v)


# --- linear, addmm, baddbmm ------------------------------------------------------------------------


def _scaled(b: _Builder, x: Node, factor: Any) -> Node:
    return x if factor == 1 else b.call(aten.mul.Tensor, x, factor)


def is_fully_connected_addmm(node: Node) -> bool:
    """``addmm(bias, x, W)`` that is a fully connected layer: constant 2-D ``W``, constant bias
    of ``W``'s output size, ``alpha = beta = 1`` (HF GPT-2's ``Conv1D``)."""
    bias, mat2 = node.args[0], node.args[2]
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
        return False
    if not (_is_constant(mat2) and _is_constant(bias)):
        return False
    w_shape, b_shape = _shape(mat2), _shape(bias)
    return len(w_shape) == 2 and len(b_shape) >= 1 and math.prod(b_shape) == w_shape[1] == b_shape[-1]


def decompose_addmm(b: _Builder, node: Node) -> Node | None:
    if is_fully_connected_addmm(node):
        return None  # one FullyConnected (the rule quantizes W and a derived bias, as for linear)
    bias, mat1, mat2 = node.args[0], node.args[1], node.args[2]
    product = _scaled(b, b.call(aten.mm.default, mat1, mat2), node.kwargs.get("alpha", 1))
    return b.call(aten.add.Tensor, product, _scaled(b, bias, node.kwargs.get("beta", 1)))  # type: ignore[arg-type]


def decompose_baddbmm(b: _Builder, node: Node) -> Node | None:
    bias, batch1, batch2 = node.args[0], node.args[1], node.args[2]
    product = _scaled(b, b.call(aten.bmm.default, batch1, batch2), node.kwargs.get("alpha", 1))
    return b.call(aten.add.Tensor, product, _scaled(b, bias, node.kwargs.get("beta", 1)))  # type: ignore[arg-type]


def _fully_connected(b: _Builder, x: Node, weight: Node, bias: Node) -> Node:
    """``x @ W + bias`` with a constant ``W [in, out]`` as ``addmm(bias, x2d, W)``, with
    ``reshape`` around it for inputs of rank > 2 (dynamic leading sizes read by ``sym_size``)."""
    w_shape, x_shape = _shape(weight), _shape(x)
    flat = x if len(x_shape) == 2 else b.call(aten.reshape.default, x, [-1, w_shape[0]])
    out = b.call(aten.addmm.default, bias, flat, weight)
    if len(x_shape) == 2:
        return out
    return b.call(aten.view.default, out, [*(_size(b, x, i) for i in range(len(x_shape) - 1)), w_shape[1]])


def _constant_weight(product: Node) -> Node | None:
    """The constant 2-D second operand of a ``matmul``/``mm`` whose first has rank 2 or more
    (``W.T`` arrives folded), else None."""
    if product.target not in (aten.matmul.default, aten.mm.default) or not _is_constant(product.args[1]):
        return None
    weight = product.args[1]
    fits = len(_shape(weight)) == 2 and len(_shape(product.args[0])) >= 2
    return weight if fits else None  # type: ignore[return-value]


def _bias_of(add: Node, product: Node) -> Node | None:
    """The constant bias ``add(product, bias)`` adds to every output feature, else None."""
    if add.target is not aten.add.Tensor or add.args[0] is not product or add.kwargs.get("alpha", 1) != 1:
        return None
    bias, weight = add.args[1], product.args[1]
    b_shape, w_shape = _shape(bias), _shape(weight)
    if not (_is_constant(bias) and b_shape and b_shape[-1] == w_shape[1] == math.prod(b_shape)):
        return None
    return bias  # type: ignore[return-value]


def recompose_matmul_weight(b: _Builder, node: Node) -> Node | None:
    """``x @ W`` with a constant 2-D ``W`` and no bias after it (a weight stored ``[in, out]``, or
    computed from a parameter; Falcon's ``x @ self.weight.T`` is a ``linear`` by then:
    ``quantplug.flow.hand_written_linear``) -> ``addmm`` with a zero bias, a
    FullyConnected whose weight gets the precision's weight grid. As a MatMul, the weight took
    the activation grid: 16-bit per tensor at ``16a4w_block``, not 4-bit per block. With a bias
    added after it, ``recompose_linear_add`` makes the FullyConnected."""
    weight = _constant_weight(node)
    if weight is None or (len(node.users) == 1 and _bias_of(next(iter(node.users)), node) is not None):
        return None
    value = _val(weight)
    zeros = b.constant("_qnn_fc_bias_", torch.zeros(int(value.shape[1]), dtype=value.dtype))
    return _fully_connected(b, node.args[0], weight, zeros)  # type: ignore[arg-type]


def recompose_linear_add(b: _Builder, node: Node) -> Node | None:
    """``add(matmul(x, W), bias)`` with a constant ``W [in, out]`` and a constant bias of ``out``
    values (``x @ W + b``) -> ``addmm(bias, x2d, W)``, a FullyConnected quantized as a linear
    (``reshape`` around it for inputs of rank > 2); the product must have no other user."""
    product = node.args[0]
    if not isinstance(product, Node) or len(product.users) != 1 or _constant_weight(product) is None:
        return None
    bias = _bias_of(node, product)
    return None if bias is None else _fully_connected(b, product.args[0], product.args[1], bias)  # type: ignore[arg-type]


# --- elementwise ----------------------------------------------------------------------------------


def _statistic(node: Any) -> Any:
    if isinstance(node, Node) and node.op == "call_function":
        node.meta[ABSOLUTE_RANGE_KEY] = True
    return node


def decompose_rsqrt(b: _Builder, node: Node) -> Node | None:
    """``rsqrt(v)`` -> ``reciprocal(sqrt(v))``; ``v`` (a variance, in RMSNorm and LayerNorm
    written out by hand, as in HF Llama) and both results are per-row statistics."""
    _statistic(node.args[0])
    root = _statistic(b.call(aten.sqrt.default, node.args[0]))
    return _statistic(b.call(aten.reciprocal.default, root))


def decompose_floor_divide(b: _Builder, node: Node) -> Node | None:
    """Float ``a // b`` -> ``floor(a / b)``. An integer one (an index: Mixtral's router computes
    its experts' rows as ``token_index // top_k``) stays whole: ``div`` is true division, so the
    rewrite would turn the index into a float tensor, which ``index`` refuses."""
    value = _val(node)
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        return None
    return b.call(aten.floor.default, b.call(aten.div.Tensor, node.args[0], node.args[1]))


def decompose_square(b: _Builder, node: Node) -> Node | None:
    return b.call(aten.mul.Tensor, node.args[0], node.args[0])


def decompose_pow(b: _Builder, node: Node) -> Node | None:
    """``x ** 2`` -> ``x * x``, ``x ** 3`` -> ``x * x * x`` (GELU's tanh form): exact, and no
    quantized exponent."""
    x, exponent = node.args[0], node.args[1]
    if exponent not in (2, 3):
        return None
    square = b.call(aten.mul.Tensor, x, x)
    return square if exponent == 2 else b.call(aten.mul.Tensor, square, x)


def decompose_rms_norm(b: _Builder, node: Node) -> Node | None:
    x = node.args[0]
    dims = list(_arg(node, 1, "normalized_shape", ()))
    weight = _arg(node, 2, "weight", None)
    eps = _arg(node, 3, "eps", None)
    if not isinstance(x, Node) or not dims:
        return None
    if eps is None:
        eps = torch.finfo(_val(x).dtype).eps
    axes = list(range(-len(dims), 0))
    mean_sq = _statistic(b.call(aten.mean.dim, b.call(aten.mul.Tensor, x, x), axes, True))
    variance = _statistic(b.call(aten.add.Tensor, mean_sq, float(eps)))
    inv = _statistic(b.call(aten.reciprocal.default, _statistic(b.call(aten.sqrt.default, variance))))
    out = b.call(aten.mul.Tensor, x, inv)
    return b.call(aten.mul.Tensor, out, weight) if isinstance(weight, Node) else out


def decompose_global_avg_pool(b: _Builder, node: Node) -> Node | None:
    """``adaptive_avg_pool2d(x, 1)`` on a tensor that is not contiguous (channels-last strides, as
    after ConvNeXt's permuted blocks) -> ``mean(x, [-2, -1], keepdim=True)``: torch's ONNX
    translator writes such a pool as ReduceMean, Reshape and a Gather that restores the strides,
    and the tensors between them have no encoding. ``mean`` exports to ReduceMean alone and equals
    the pool exactly. A contiguous input exports to one pooling op and is left alone."""
    x = node.args[0]
    size = _arg(node, 1, "output_size", None)
    val = _val(x)
    if not isinstance(x, Node) or not isinstance(val, torch.Tensor) or val.dim() != 4:
        return None
    sizes = list(size) if isinstance(size, (list, tuple)) else [size, size]
    if sizes != [1, 1]:
        return None
    if val.is_contiguous():
        return None
    return b.call(aten.mean.dim, x, [-2, -1], True)


def decompose_im2col(b: _Builder, node: Node) -> Node | None:
    """``im2col`` (``nn.Unfold``: ConvBERT's span-based convolution, patch extraction) ->
    ``pad``, ``flatten``, ``index_select`` of constant positions, ``reshape``. QNN has no im2col and
    torch's ONNX translator writes one as a chain of Pad, Gathers and Reshapes whose intermediate
    tensors have no encoding. This rewrite moves the same values with ops that export to one ONNX
    op each, all data movement: the gathered rows share the padded tensor's encoding, and the
    zero padding lies inside every calibrated range, so the quantized program computes what
    ``im2col`` of the quantized input does. Spatial sizes must be static (the positions are a
    constant); a 3-D (unbatched) input is left alone."""
    x = node.args[0]
    shape = _shape(x)
    if not isinstance(x, Node) or len(shape) != 4 or not _static(shape[1:]):
        return None
    kh, kw = (int(v) for v in _arg(node, 1, "kernel_size", ()))
    dh, dw = (int(v) for v in _arg(node, 2, "dilation", ()))
    ph, pw = (int(v) for v in _arg(node, 3, "padding", ()))
    sh, sw = (int(v) for v in _arg(node, 4, "stride", ()))
    _, channels, height, width = (int(v) for v in shape)
    padded_h, padded_w = height + 2 * ph, width + 2 * pw
    out_h = (padded_h - dh * (kh - 1) - 1) // sh + 1
    out_w = (padded_w - dw * (kw - 1) - 1) // sw + 1
    if out_h <= 0 or out_w <= 0:
        return None
    # position of (kernel row i, kernel column j, output row r, output column c) in the padded
    # plane, in im2col's order: kernel offsets (i, j) outer, output positions (r, c) inner
    rows = (torch.arange(kh) * dh).view(kh, 1, 1, 1) + (torch.arange(out_h) * sh).view(1, 1, out_h, 1)
    cols = (torch.arange(kw) * dw).view(1, kw, 1, 1) + (torch.arange(out_w) * sw).view(1, 1, 1, out_w)
    positions = (rows * padded_w + cols).reshape(-1)
    padded = b.call(aten.pad.default, x, [pw, pw, ph, ph], "constant", 0.0) if ph or pw else x
    flat = b.call(aten.flatten.using_ints, padded, 2)  # [batch, channels, padded plane]
    gathered = b.call(aten.index_select.default, flat, 2, b.constant("im2col_positions", positions))
    return b.call(aten.reshape.default, gathered, [-1, channels * kh * kw, out_h * out_w])


#: norm op -> (index of its weight argument, of its bias argument, whether ONNX needs the bias):
#: ONNX's GroupNormalization and InstanceNormalization require both, LayerNormalization the scale
_NORM_PARAMETERS: dict[Any, tuple[int, int, bool]] = {
    aten.layer_norm.default: (2, 3, False),
    aten.group_norm.default: (2, 3, True),
    aten.instance_norm.default: (1, 2, True),
}


def materialize_norm_parameters(b: _Builder, node: Node) -> Node | None:
    """A norm without affine parameters (``LayerNorm(elementwise_affine=False)``, ``GroupNorm(
    affine=False)``, ``InstanceNorm2d()``) -> the same norm with an all-ones weight (and an
    all-zeros bias where ONNX requires one) as constants. The ONNX exporter otherwise makes them
    itself (``Expand(1.0, Shape(x))``, ``CastLike``) after every quantize/dequantize, so the
    converter would see a quantized norm reading float tensors without an encoding; as program
    constants they are quantized as the norm's weight and bias (exactly: 1 and 0 are on every
    grid), and the result is the same."""
    weight_at, bias_at, needs_bias = _NORM_PARAMETERS[node.target]
    x = node.args[0]
    val = _val(x)
    weight = _arg(node, weight_at, "weight", None)
    bias = _arg(node, bias_at, "bias", None)
    missing_bias = bias is None and needs_bias
    if not isinstance(x, Node) or not isinstance(val, torch.Tensor) or not (weight is None or missing_bias):
        return None
    if node.target == aten.layer_norm.default:
        shape = tuple(int(d) for d in _val(node.args[1]))
    else:
        shape = (int(val.shape[1]),)
    args = list(node.args) + [None] * (bias_at + 1 - len(node.args))
    args[weight_at] = weight
    args[bias_at] = bias
    if weight is None:
        args[weight_at] = b.constant("_norm_weight", torch.ones(shape, dtype=val.dtype))
    if missing_bias:
        args[bias_at] = b.constant("_norm_bias", torch.zeros(shape, dtype=val.dtype))
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("weight", "bias")}
    return b.call(node.target, *args, **kwargs)


#: convolutions whose bias-less form the ONNX exporter writes with a bias it makes itself
_CONVOLUTIONS = (
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.conv1d.padding,
    aten.conv2d.padding,
    aten.conv3d.padding,
)


def materialize_conv_bias(b: _Builder, node: Node) -> Node | None:
    """A convolution without bias (DenseNet's, a pre-activation ResNet's: any conv not followed by
    a batch norm quantplug folds into it) -> the same conv with a constant all-zeros bias. The ONNX
    exporter writes ``conv2d(x, w, None)`` as ``Conv(x, w, Expand(CastLike(0, x), Shape(w)[:1]))``:
    a float bias made after the last quantize/dequantize, which the converter would see without
    an encoding. As a program constant it gets the derived int32 bias grid (zero is exact on it)."""
    weight = node.args[1] if len(node.args) > 1 else None
    if _arg(node, 2, "bias", None) is not None or not isinstance(weight, Node):
        return None
    w = _val(weight)
    if not isinstance(w, torch.Tensor) or not _static(w.shape):
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    args[2] = b.constant("_conv_bias", torch.zeros(int(w.shape[0]), dtype=w.dtype))
    kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    return b.call(node.target, *args, **kwargs)


Decomposition = Callable[[_Builder, Node], "Node | None"]

#: op -> its rewrite (which returns None to keep a node as it is)
DECOMPOSITIONS: dict[Any, Decomposition] = {
    aten.scaled_dot_product_attention.default: decompose_sdpa,
    aten.addmm.default: decompose_addmm,
    aten.matmul.default: recompose_matmul_weight,
    aten.mm.default: recompose_matmul_weight,
    aten.add.Tensor: recompose_linear_add,
    aten.baddbmm.default: decompose_baddbmm,
    aten.rsqrt.default: decompose_rsqrt,
    aten.floor_divide.default: decompose_floor_divide,
    aten.square.default: decompose_square,
    aten.pow.Tensor_Scalar: decompose_pow,
    aten.rms_norm.default: decompose_rms_norm,
    aten.adaptive_avg_pool2d.default: decompose_global_avg_pool,
    aten.im2col.default: decompose_im2col,
    **dict.fromkeys(_NORM_PARAMETERS, materialize_norm_parameters),
    **dict.fromkeys(_CONVOLUTIONS, materialize_conv_bias),
}


def decompose_composites(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Rewrite every composite op of :data:`DECOMPOSITIONS` in place (see the module docstring)."""
    changed = False
    for node in list(gm.graph.nodes):
        rewrite = DECOMPOSITIONS.get(node.target) if node.op == "call_function" else None
        if rewrite is None:
            continue
        builder = _Builder(gm, node, f"{node.name} ({node.target})")
        new = rewrite(builder, node)
        if new is not None:
            builder.replace(new)
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


#: arithmetic whose boolean operand torch promotes to the other operand's float type
_PROMOTING = frozenset(
    {
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.rsub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.maximum.default,
        aten.minimum.default,
    }
)


def cast_bool_operands(gm: GraphModule, context: BackendContext | None = None) -> None:
    """Make the promotion of a boolean operand of float arithmetic an explicit ``to(dtype)``.

    RecurrentGemma resets its recurrence with ``reset + ~reset * a`` (``reset`` a boolean mask).
    torch promotes the mask to float inside the op; the ONNX exporter writes that as a Cast the
    program never had, whose float output fed a quantized Mul/Add with no encoding, and strict
    lowering refused it. As an explicit ``to`` (a QNN Cast), its output is quantized like any
    activation: 0 and 1 are on every grid."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _PROMOTING:
            continue
        out = _val(node)
        if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
            continue
        args = list(node.args)
        for i, arg in enumerate(args[:2]):
            val = _val(arg)
            if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
                args[i] = _Builder(gm, node, f"{node.name} ({node.target})").call(
                    aten.to.dtype, arg, out.dtype
                )
                changed = True
        node.args = tuple(args)
    if changed:
        gm.recompile()
