"""Q/DQ nodes through ONNX export, each one kept and found exactly.

Exported as ops, ``quantize``/``dequantize`` nodes are at the mercy of the exporter: identical
initializers are merged and then identical ``DequantizeLinear`` nodes (two freshly initialised
LayerNorms), small constants are folded (a quantized bias becomes a float constant), and names
change along the way, so that mapping them back by name loses some. Here each static Q/DQ node
of the converted program becomes a *site*: before export it is replaced by
``quantplug::qdq_site(x, key, dtype)``, an opaque op the exporter translates to a single
placeholder node and cannot fold, merge or decompose; the key survives any re-tracing. After
translation, :func:`insert_qdq` replaces each placeholder with the real ``QuantizeLinear`` or
``DequantizeLinear`` built from the program's own qparams, with initializers of its own. Every
encoding's ONNX tensors are therefore known by construction.

A range narrower than its integer type (``int16 [-32767, 32767]``, the symmetric 16-bit grid of
``qnn_htp``) has no place in ONNX's Q/DQ parameters: by default it lives in the encodings only
(each entry's ``quant_min``/``quant_max``, which a backend writes into its encodings file) and the
``QuantizeLinear`` saturates to its type, so the model stays pure Q/DQ: only Q/DQ nodes read or
write integer tensors. That is what Qualcomm's converter expects (Q/DQ pairs around float ops),
and what ONNX Runtime runs: it has no 16-bit ``Clip`` kernel (``NOT_IMPLEMENTED: Where(16)``,
issue 45.2). Inside the calibrated range both compute the same codes; beyond it the model may
use the codes between the narrowed and the full range (``-32768``). ``clip_narrowed_ranges=True``
adds an integer ``Clip`` after such a ``QuantizeLinear`` instead, for a model whose ONNX
arithmetic must equal the program's everywhere (not runnable by ONNX Runtime at 16 bits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from _quantplug.annotation.dtypes import storage_dtype
from _quantplug.errors import LoweringError
from _quantplug.graph.attrs import attr_value
from _quantplug.lowering.onnx.provenance import describe
from _quantplug.observers import block_ops as qp_ops
from _quantplug.observers.per_block import block_grid_shape, resolve_block_size

qd = torch.ops.quantized_decomposed

STATIC_QUANTIZE = (qd.quantize_per_tensor.default, qd.quantize_per_channel.default, qp_ops.quantize_per_block)
STATIC_DEQUANTIZE = (
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_channel.default,
    qp_ops.dequantize_per_block,
)


@torch.library.custom_op("quantplug::qdq_site", mutates_args=())
def _qdq_site(x: torch.Tensor, key: int, dtype: torch.dtype) -> torch.Tensor:
    """Stands for the Q/DQ node ``key`` during ONNX export (the values are never used)."""
    return x.to(dtype)


@_qdq_site.register_fake
def _(x, key, dtype):  # type: ignore[no-untyped-def]
    return torch.empty_like(x, dtype=dtype)


qdq_site = torch.ops.quantplug.qdq_site.default


def _t_qdq_site(x: Any, key: int, dtype: int) -> Any:
    """ONNX translation of a site: a placeholder node :func:`insert_qdq` turns into Q/DQ nodes.

    Added to the exporter's recorder directly when it exposes its node list (an ``Identity``
    through onnxscript costs a schema conversion, half a millisecond per site)."""
    import onnx_ir as ir
    from onnxscript import evaluator, opset18

    recorder = evaluator.default()
    nodes = getattr(recorder, "nodes", None)
    if isinstance(nodes, list):
        node = ir.Node("", "Identity", [x], num_outputs=1)
        nodes.append(node)
        return node.outputs[0]
    return opset18.Identity(x)


@dataclass(frozen=True)
class Site:
    """One static Q/DQ node of the program, with its qparams as values."""

    key: int
    node: str  # the node's name in the converted program
    quantize: bool
    granularity: str  # "tensor", "channel" or "block"
    scale: Any  # float (per tensor) or tensor
    zero_point: Any
    quant_min: int
    quant_max: int
    dtype: torch.dtype  # the integer container
    axis: int = 0
    block_size: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()  # the quantized tensor's shape (per-block grids need it)
    out_dtype: torch.dtype = torch.float32  # a dequantize's float type
    #: a tensor computed at run time (not a constant) on a 4-bit grid in an 8-bit container: its
    #: Q/DQ pair uses ONNX's INT4/UINT4 type (opset 21), which holds the range itself
    four_bit: bool = False


_GRANULARITY = {
    qd.quantize_per_tensor.default: "tensor",
    qd.dequantize_per_tensor.default: "tensor",
    qd.quantize_per_channel.default: "channel",
    qd.dequantize_per_channel.default: "channel",
    qp_ops.quantize_per_block: "block",
    qp_ops.dequantize_per_block: "block",
}


def find_sites(gm: GraphModule) -> list[Site]:
    """Every static Q/DQ node of ``gm``, in graph order (its index is its key)."""
    sites: list[Site] = []
    for node in gm.graph.nodes:
        granularity = _GRANULARITY.get(node.target) if node.op == "call_function" else None
        if granularity is not None:
            sites.append(_site(gm, node, granularity, key=len(sites)))
    return sites


def _site(gm: GraphModule, node: Node, granularity: str, key: int) -> Site:
    args = [attr_value(gm, a) for a in node.args]
    quantize = node.target in STATIC_QUANTIZE
    src = node.args[0]
    src_val = attr_value(gm, src) if isinstance(src, Node) and src.op == "get_attr" else None
    if src_val is None and isinstance(src, Node):
        src_val = src.meta.get("val")
        if src_val is None and src.target in STATIC_QUANTIZE and isinstance(src.args[0], Node):
            src_val = src.args[0].meta.get("val")  # convert's quantize keeps its input's shape
    shape = (
        tuple(int(d) for d in src_val.shape) if isinstance(src_val, torch.Tensor) and _static(src_val) else ()
    )
    fields: dict[str, Any] = {"scale": args[1], "zero_point": args[2]}
    if granularity == "tensor":  # (x, scale, zero_point, qmin, qmax, dtype)
        fields.update(scale=float(args[1]), zero_point=int(args[2]))
        qmin, qmax, dtype = args[3:6]
    elif granularity == "channel":  # (x, scale, zero_point, axis, qmin, qmax, dtype)
        fields["axis"] = int(args[3])
        qmin, qmax, dtype = args[4:7]
    else:  # (x, scale, zero_point, block_size, qmin, qmax, dtype)
        if not shape:
            raise LoweringError(
                f"per-block node {node.name!r} quantizes {describe(node)}, whose shape is dynamic; "
                "per-block grids need a static shape: export that dimension as static"
            )
        fields["block_size"] = tuple(int(b) for b in args[3])
        qmin, qmax, dtype = args[4:7]
    container = storage_dtype(dtype)
    out_dtype = torch.float32
    if not quantize:
        if isinstance(src_val, torch.Tensor) and not src_val.dtype.is_floating_point:
            container = src_val.dtype  # what the dequantize actually reads
        val = node.meta.get("val")
        requested = node.kwargs.get("out_dtype")
        out_dtype = requested if isinstance(requested, torch.dtype) else torch.float32
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            out_dtype = val.dtype
    if container not in _INT_TYPES:
        raise LoweringError(
            f"{describe(node)} is quantized to {container} (node {node.name!r}), which ONNX "
            f"QuantizeLinear/DequantizeLinear cannot hold; use an 8- or 16-bit grid (or 4/2-bit in an "
            "8-bit container) for it"
        )
    reads_constant = not quantize and isinstance(src, Node) and src.op == "get_attr"
    four_bit = not reads_constant and _fits_four_bits(container, int(qmin), int(qmax))
    if out_dtype != torch.float32 and out_dtype not in _FLOAT_TYPES:
        raise LoweringError(
            f"{describe(node)} is dequantized to {out_dtype} (node {node.name!r}), which ONNX lacks; "
            "run that part of the model in float32, float16 or bfloat16"
        )
    return Site(
        key=key,
        node=node.name,
        quantize=quantize,
        granularity=granularity,
        quant_min=int(qmin),
        quant_max=int(qmax),
        dtype=container,
        shape=shape,
        out_dtype=out_dtype,
        four_bit=four_bit,
        **fields,
    )


def _fits_four_bits(container: torch.dtype, qmin: int, qmax: int) -> bool:
    """An 8-bit container holding a range ONNX's INT4 / UINT4 type holds (PT2E's 4-bit idiom)."""
    if container == torch.int8:
        return -8 <= qmin and qmax <= 7
    return container == torch.uint8 and 0 <= qmin and qmax <= 15


def _static(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape)


def mark_sites(graph: Graph, sites: Sequence[Site]) -> None:
    """Replace each site's node in ``graph`` (a copy of the program's) by ``qdq_site``."""
    by_name = {n.name: n for n in graph.nodes if n.op == "call_function"}
    values = _SiteValues()
    for site in sites:
        node = by_name.get(site.node)
        if node is None:
            raise LoweringError(f"internal error: Q/DQ node {site.node!r} missing from the copied program")
        x = node.args[0]
        dtype = site.dtype if site.quantize else site.out_dtype
        node.target = qdq_site
        node.args = (x, site.key, dtype)
        node.kwargs = {}
        val, x_val = node.meta.get("val"), x.meta.get("val") if isinstance(x, Node) else None
        if not (isinstance(val, torch.Tensor) and val.dtype == dtype):
            node.meta.pop("val", None)
            like = values.like(x_val, dtype)
            if like is not None:
                node.meta["val"] = like


class _SiteValues:
    """``qdq_site``'s output values: ``x``'s shape in the site's dtype, as fake tensors.

    A fake tensor costs a dispatch through its mode (a fifth of a millisecond); sites of one
    static shape and dtype (every activation of a width, in most models) share one, which only
    the exporter reads (for the ONNX value's type and shape).
    """

    def __init__(self) -> None:
        self._made: dict[tuple[Any, ...], torch.Tensor] = {}

    def like(self, x_val: Any, dtype: torch.dtype) -> torch.Tensor | None:
        mode = getattr(x_val, "fake_mode", None)
        if mode is None or not isinstance(x_val, torch.Tensor):
            return None
        key = (id(mode), tuple(x_val.shape), x_val.stride(), x_val.device, dtype) if _static(x_val) else None
        made = self._made.get(key) if key is not None else None
        if made is None:
            with mode:  # qdq_site's fake, undispatched
                made = torch.empty_like(x_val, dtype=dtype)
            if key is not None:
                self._made[key] = made
        return made


# --------------------------------------------------------------------------------- in the ONNX graph


@dataclass
class PlacedSite:
    """Where a site ended up in the ONNX model (names of its node and tensors)."""

    site: Site
    node: str  # QuantizeLinear / DequantizeLinear
    input: str  # the tensor it reads
    output: str  # what consumers read (after a Clip or Cast)
    scale: str
    zero_point: str


def insert_qdq(
    model: Any, sites: Sequence[Site], *, clip_narrowed_ranges: bool = False, opset: int = 21
) -> dict[int, PlacedSite]:
    """Turn each ``qdq_site`` placeholder of ``model`` (an ``onnx_ir.Model`` straight from
    translation) into its Q/DQ nodes; return where each site is, by key.

    The placeholder node itself becomes the last of them (so its output keeps its name, type
    and readers); the others are inserted before it. ``clip_narrowed_ranges``: an integer
    ``Clip`` after each ``QuantizeLinear`` whose range is narrower than its type (see the
    module's docstring); otherwise the model holds no integer op but Q/DQ. A 4-bit grid computed
    at run time takes ONNX's 4-bit type from ``opset`` 21 on; below it, where only an 8-bit type
    exists, its ``QuantizeLinear`` is clipped whatever ``clip_narrowed_ranges`` says (saturating
    at 8 bits would not be one code off but sixteen times the range).
    """
    names = _NameSource(model.graph)
    placed: dict[int, PlacedSite] = {}
    for node in list(model.graph):
        fx_node = node.meta.get("node")
        if fx_node is not None and getattr(fx_node, "target", None) is qdq_site:
            site = sites[int(fx_node.args[1])]
            if site.four_bit and opset < 21:
                site = dataclasses.replace(site, four_bit=False)
                clip = True
            else:
                clip = clip_narrowed_ranges
            placed[site.key] = _place(model.graph, node, site, names, clip)
    return placed


class _NameSource:
    """Fresh value and node names (two namespaces): ours must not clash with the exporter's."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.taken = {v.name for v in graph.inputs} | set(graph.initializers)
        self.nodes: set[str] = set()
        for node in graph:
            self.taken.update(v.name for v in node.outputs if v.name)
            if node.name and getattr(node.meta.get("node"), "target", None) is not qdq_site:
                self.nodes.add(node.name)

    def new(self, base: str) -> str:
        return self._fresh(base, self.taken)

    def node(self, base: str) -> str:
        return self._fresh(base, self.nodes)

    @staticmethod
    def _fresh(base: str, taken: set[str]) -> str:
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        return name

    def initializer(self, base: str, array: Any) -> Any:
        import onnx_ir as ir

        name = self.new(base)
        value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
        self.graph.register_initializer(value)
        return value


_FLOAT_TYPES = {torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16", torch.float64: "DOUBLE"}
_INT_TYPES = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.uint16: "uint16",
    torch.int16: "int16",
    torch.int32: "int32",
}


def _onnx_params(site: Site) -> tuple[Any, Any, dict[str, int]]:
    """(scale, zero point) as numpy arrays in ONNX's layout, and the node's attributes."""
    import numpy as np

    np_dtype = np.dtype(_INT_TYPES[site.dtype])
    if site.four_bit:
        import ml_dtypes

        np_dtype = np.dtype(ml_dtypes.int4 if site.dtype == torch.int8 else ml_dtypes.uint4)
    if site.granularity == "tensor":
        return np.array(site.scale, np.float32), np.array(site.zero_point, np_dtype), {}
    if site.granularity == "channel":
        scale = site.scale.detach().to(torch.float32).reshape(-1).numpy()
        zero = site.zero_point.detach().reshape(-1).numpy().astype(np_dtype)
        return scale, zero, {"axis": site.axis}
    scale_t, zero_t, axis, block = onnx_block_form(site.scale, site.zero_point, site.block_size, site.shape)
    scale = scale_t.detach().to(torch.float32).numpy()
    zero = zero_t.detach().numpy().astype(np_dtype)
    attrs = {"axis": axis}
    if block:
        attrs["block_size"] = block
    elif scale.ndim == 0:
        attrs = {}
    return scale, zero, attrs


def _full_range(dtype: torch.dtype, four_bit: bool = False) -> tuple[int, int]:
    if four_bit:
        return (-8, 7) if dtype == torch.int8 else (0, 15)
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


@dataclass
class _Step:
    op_type: str
    inputs: list[Any]  # ir.Value, or an int: the output of that earlier step
    attrs: dict[str, Any]
    name: str
    dtype: Any  # the output's ir.DataType


def _place(graph: Any, marker: Any, site: Site, names: _NameSource, clip_narrowed: bool) -> PlacedSite:
    import numpy as np
    import onnx_ir as ir

    x = marker.inputs[0]
    scale, zero, attrs = _onnx_params(site)
    s = names.initializer(f"{site.node}_scale", scale)
    z = names.initializer(f"{site.node}_zero_point", zero)
    steps: list[_Step] = []
    if site.quantize:
        container = ir.DataType.from_numpy(zero.dtype)
        source: Any = x
        if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
            steps.append(
                _Step("Cast", [x], {"to": ir.DataType.FLOAT}, f"{site.node}_cast", ir.DataType.FLOAT)
            )
            source = 0
        steps.append(_Step("QuantizeLinear", [source, s, z], attrs, site.node, container))
        if clip_narrowed and (site.quant_min, site.quant_max) != _full_range(site.dtype, site.four_bit):
            lo = names.initializer(f"{site.node}_min", np.array(site.quant_min, zero.dtype))
            hi = names.initializer(f"{site.node}_max", np.array(site.quant_max, zero.dtype))
            steps.append(_Step("Clip", [len(steps) - 1, lo, hi], {}, f"{site.node}_clip", container))
    else:
        steps.append(_Step("DequantizeLinear", [x, s, z], attrs, site.node, ir.DataType.FLOAT))
        if site.out_dtype != torch.float32:
            dtype = getattr(ir.DataType, _FLOAT_TYPES[site.out_dtype])
            steps.append(_Step("Cast", [0], {"to": dtype}, f"{site.node}_cast", dtype))
    made: list[Any] = []
    for i, step in enumerate(steps):
        inputs = [made[v].outputs[0] if isinstance(v, int) else v for v in step.inputs]
        if i < len(steps) - 1:
            node = ir.node(step.op_type, inputs, step.attrs, name=names.node(step.name))
            out = node.outputs[0]
            out.name = names.new(f"{node.name}_out")
            out.type, out.shape = ir.TensorType(step.dtype), marker.outputs[0].shape
            graph.insert_before(marker, node)
        else:
            node = _morph(marker, step.op_type, inputs, step.attrs, names.node(step.name))
            if site.quantize:  # the integer type is the site's (INT4 for a 4-bit grid), not the placeholder's
                node.outputs[0].type = ir.TensorType(step.dtype)
        made.append(node)
    qdq = made[1] if steps[0].op_type == "Cast" and site.quantize else made[0]
    return PlacedSite(
        site=site,
        node=qdq.name,
        input=qdq.inputs[0].name,
        output=marker.outputs[0].name,
        scale=s.name,
        zero_point=z.name,
    )


def _morph(node: Any, op_type: str, inputs: Sequence[Any], attrs: dict[str, Any], name: str) -> Any:
    """Make ``node`` (the placeholder) an ``op_type`` node in place: its output stays as it is."""
    import onnx_ir as ir

    node.op_type = op_type
    node.domain = ""
    node.resize_inputs(len(inputs))
    for i, value in enumerate(inputs):
        if node.inputs[i] is not value:
            node.replace_input_with(i, value)
    for attr in ir.convenience.convert_attributes(attrs):
        node.attributes.add(attr)
    node.name = name
    node.metadata_props.clear()  # the exporter's notes describe the placeholder op
    return node


def onnx_block_form(
    scale: torch.Tensor, zero_point: torch.Tensor, block_size: Sequence[int], shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """quantplug per-block qparams as ONNX Q/DQ inputs: ``(scale, zero_point, axis, block)``.

    ``block == 0`` means per-axis (1-D scale along ``axis``) or, with a 0-d scale, per-tensor;
    otherwise the scale has the tensor's rank, ``ceil(dim / block)`` entries on ``axis`` and the
    full size on every other axis (repeated from quantplug's compact block grid).
    """
    dims = tuple(int(d) for d in shape)
    block = resolve_block_size(block_size, dims)
    grid = block_grid_shape(block, dims)
    scale = scale.reshape(grid) if scale.numel() > 1 else scale.reshape(())
    zero_point = zero_point.reshape(grid) if zero_point.numel() > 1 else zero_point.reshape(())
    varying = [i for i, g in enumerate(grid) if g > 1]
    if not varying:
        return scale.reshape(()), zero_point.reshape(()), 0, 0
    if len(varying) == 1 and block[varying[0]] == 1:
        axis = varying[0]
        return scale.reshape(-1), zero_point.reshape(-1), axis, 0
    blocked = [i for i in varying if block[i] > 1]
    if blocked:
        axis = max(blocked, key=lambda i: (block[i], i))
        size = block[axis]
    else:  # scales vary only along axes of 1-wide blocks: the block is a whole axis (one scale
        # per row of each expert of a [experts, out, in] weight) or, if none, a single element
        spanning = [i for i, g in enumerate(grid) if g == 1 and dims[i] > 1]
        axis = spanning[-1] if spanning else len(dims) - 1
        size = dims[axis] if spanning else 1
    spread_s, spread_z = scale, zero_point
    if spread_s.dim() == 0:
        spread_s = spread_s.reshape([1] * len(dims))
        spread_z = spread_z.reshape([1] * len(dims))
    for i in range(len(dims)):
        if i == axis:
            continue
        reps = dims[i] // spread_s.shape[i]
        if reps > 1:
            spread_s = spread_s.repeat_interleave(reps, dim=i)
            spread_z = spread_z.repeat_interleave(reps, dim=i)
    return spread_s.contiguous(), spread_z.contiguous(), axis, size
