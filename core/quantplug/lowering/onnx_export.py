"""Exporting a converted (Q/DQ) program to a QDQ ONNX model, for any backend.

``export_qdq_onnx(quantized, example_inputs, path)`` re-exports the reference quantized program
with ``torch.export`` and turns it into ONNX with ``torch.onnx.export(..., dynamo=True)``: every
``quantize``/``dequantize`` node becomes a ``QuantizeLinear``/``DequantizeLinear`` node (opset 21
by default, needed for 16-bit, 4-bit and blocked grids) and every quantized weight is stored as an
integer initializer. The result maps the ONNX tensor names back to quantplug's encodings
(``quantplug.flow.inspect.encodings``), which is what backends writing an encodings file beside
the model need.

What the stock exporter lacks, this module adds as ONNX translations:

* quantplug's per-block ops (``quantplug::quantize_per_block`` / ``dequantize_per_block``):
  rewritten first into ONNX's own form (one blocked axis, the scale spread over the other axes;
  or per axis / per tensor when that is what the blocks amount to), then exported as
  ``DequantizeLinear(..., axis, block_size)``;
* dynamic quantization (``choose_qparams*``, per-token ``quantize``/``dequantize``): spelled out
  with reductions and elementwise ops, with the arithmetic of ``quantized_decomposed``;
* per-tensor ``quantize`` on a narrowed range (e.g. ``[-127, 127]``): a ``Clip`` after
  ``QuantizeLinear`` (which saturates to the whole dtype).

The core does not depend on ONNX: ``onnx`` and ``onnxscript`` are imported when this module's
functions run, and their absence is a ``LoweringError`` saying what to install.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug import ops as qp_ops
from quantplug.errors import LoweringError
from quantplug.flow.inspect import fetch_attr

qd = torch.ops.quantized_decomposed

#: opset that has 16-bit and 4-bit Q/DQ types and blocked quantization
DEFAULT_OPSET = 21
MIN_OPSET = 13
_NEEDS_21 = "16-bit, 4-bit and per-block Q/DQ need ONNX opset >= 21"

STATIC_QUANTIZE = (qd.quantize_per_tensor.default, qd.quantize_per_channel.default, qp_ops.quantize_per_block)
STATIC_DEQUANTIZE = (
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_channel.default,
    qp_ops.dequantize_per_block,
)


# --------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class OnnxTensorInfo:
    """A graph input or output of the ONNX model."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str  # numpy-style name: "float32", "int64"...


@dataclass
class OnnxExportResult:
    """The exported model and where each quantplug encoding lives in it.

    ``encodings`` is ``quantplug.flow.inspect.encodings(program)`` with an ``"onnx"`` entry added
    to each item (``None`` when the tensor did not survive export, e.g. dead code):

    * ``tensor``: the float tensor the encoding describes: the input of the ``QuantizeLinear``
      for activations, the output of the ``DequantizeLinear`` for constants (weights, biases);
    * ``quantized``: the integer tensor: the ``QuantizeLinear`` output, or the integer
      initializer of a constant;
    * ``dequantized``: the outputs of the ``DequantizeLinear`` nodes that read ``quantized``;
    * ``scale`` / ``zero_point``: the names of the scale and zero-point inputs of the Q (or DQ);
    * ``node``: the ``QuantizeLinear`` (activations) or ``DequantizeLinear`` (constants) node.

    ``tensor_encodings`` maps every one of those tensor names (``tensor``, ``quantized`` and each
    ``dequantized``) to its entry.
    """

    model: Any  # onnx.ModelProto
    opset: int
    inputs: list[OnnxTensorInfo]
    outputs: list[OnnxTensorInfo]
    encodings: list[dict[str, Any]]
    tensor_encodings: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: Path | None = None
    #: the ``torch.export`` capture of the program that was exported, when it is the given
    #: program unchanged (no per-block rewrite): a writer may save it instead of exporting again
    exported_program: Any = None

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def unmapped(self) -> list[str]:
        """quantplug encoding nodes with no tensor in the ONNX model."""
        return [e["node"] for e in self.encodings if e.get("onnx") is None]

    def model_bytes(self) -> bytes:
        return bytes(self.model.SerializeToString())

    def save(self, path: str | Path) -> Path:
        """Write the model to ``path`` (weights past 2 GB go to a ``.data`` file beside it)."""
        return _save_model(self.model, Path(path))


# --------------------------------------------------------------------------------- entry point


def export_qdq_onnx(
    quantized: GraphModule,
    example_inputs: Sequence[torch.Tensor] | None = None,
    path: str | Path | None = None,
    *,
    opset: int = DEFAULT_OPSET,
    optimize: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    custom_translations: Mapping[Callable[..., Any], Callable[..., Any]] | None = None,
) -> OnnxExportResult:
    """Export a converted (Q/DQ) program to a QDQ ONNX model.

    Args:
        quantized: the output of :func:`quantplug.convert` (or a lowering pass's rewrite of it).
        example_inputs: inputs to trace with; default: random tensors shaped like the program's
            inputs (``quantplug.flow.inspect.example_inputs``). Shapes are fixed by these.
        path: where to write the ``.onnx`` file (optional; the model is returned either way).
        opset: ONNX opset (>= 21 when the program has 16-bit, 4-bit or per-block tensors).
        optimize: let the exporter fold constants and drop dead nodes (Q/DQ nodes are kept).
        input_names / output_names: ONNX graph input/output names (default: the program's).
        custom_translations: extra ``{torch op: onnxscript function}`` for ops of your own.

    Raises:
        LoweringError: ``onnx``/``onnxscript`` are missing, the opset is too low, or an op has no
            ONNX translation (the message names the op and the node).
    """
    onnx = require_onnx()
    if opset < MIN_OPSET:
        raise LoweringError(f"ONNX opset {opset} is too old for QDQ models; use opset >= {MIN_OPSET}")
    if not isinstance(quantized, GraphModule):
        raise LoweringError(
            "export_qdq_onnx expects the GraphModule returned by quantplug.convert(), "
            f"got {type(quantized).__name__}"
        )
    from quantplug.flow.inspect import encodings as read_encodings
    from quantplug.flow.inspect import example_inputs as make_inputs

    args = tuple(example_inputs) if example_inputs is not None else make_inputs(quantized)
    _check_opset(quantized, opset)
    table = read_encodings(quantized)
    program = _for_export(quantized)
    with warnings.catch_warnings(), _quiet_exporter_logs():
        warnings.simplefilter("ignore")
        try:
            exported = torch.export.export(program, args)
        except Exception as exc:
            raise LoweringError(
                f"torch.export could not re-capture the quantized program for ONNX export: "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        name_map = _match_qdq_names(program, exported.graph_module)
        translations: dict[Callable[..., Any], Callable[..., Any]] = {
            **translation_table(),
            **(custom_translations or {}),
        }
        _check_translatable(exported, translations, opset)
        try:
            onnx_program = torch.onnx.export(
                exported,
                args,
                dynamo=True,
                opset_version=opset,
                custom_translation_table=translations,
                optimize=optimize,
                input_names=list(input_names) if input_names is not None else None,
                output_names=list(output_names) if output_names is not None else None,
                verbose=False,
            )
        except Exception as exc:
            raise _export_error(exc, exported) from exc
    if onnx_program is None:
        raise LoweringError("torch.onnx.export returned no ONNX program")
    model = onnx_program.model_proto
    _fix_opset(model, opset)
    result = OnnxExportResult(
        model=model,
        opset=opset,
        inputs=_value_infos(onnx, model.graph.input, model.graph.initializer),
        outputs=_value_infos(onnx, model.graph.output, ()),
        encodings=[dict(e) for e in table],
    )
    _map_encodings(result, name_map)
    if program is quantized:
        result.exported_program = exported
    if path is not None:
        result.path = result.save(path)
    return result


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """The exporter logs warnings about optional packages (torchvision) it skips: not ours to show."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def require_onnx() -> Any:
    """Import ``onnx`` and ``onnxscript`` (the exporter's dependencies) or say what to install."""
    try:
        import onnx
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise LoweringError(
            f"ONNX export needs the 'onnx' and 'onnxscript' packages ({exc}); "
            "install them with `pip install onnx onnxscript`"
        ) from exc
    return onnx


# --------------------------------------------------------------------------------- preparing the program


def _check_opset(gm: GraphModule, opset: int) -> None:
    if opset >= 21:
        return
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (qp_ops.quantize_per_block, qp_ops.dequantize_per_block):
            raise LoweringError(f"{_NEEDS_21}; node {node.name!r} is per-block (opset {opset} requested)")
        dtype = _qdq_dtype(node)
        if dtype in (torch.uint16, torch.int16):
            raise LoweringError(f"{_NEEDS_21}; node {node.name!r} uses {dtype} (opset {opset} requested)")


def _qdq_dtype(node: Node) -> torch.dtype | None:
    if node.target in (qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default):
        return node.args[5] if len(node.args) > 5 else None  # type: ignore[return-value]
    if node.target in (qd.quantize_per_channel.default, qd.dequantize_per_channel.default):
        return node.args[6] if len(node.args) > 6 else None  # type: ignore[return-value]
    return None


def _for_export(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` with per-block Q/DQ rewritten into ONNX's form (others untouched)."""
    blocks = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in (qp_ops.quantize_per_block, qp_ops.dequantize_per_block)
    ]
    if not blocks:
        return gm
    from quantplug.flow.graph_copy import working_copy

    program = working_copy(gm)
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in (
            qp_ops.quantize_per_block,
            qp_ops.dequantize_per_block,
        ):
            _rewrite_block_node(program, node)
    program.graph.eliminate_dead_code()
    program.recompile()
    return program


def _attr(gm: GraphModule, node: Any) -> torch.Tensor:
    if not (isinstance(node, Node) and node.op == "get_attr"):
        raise LoweringError(f"per-block qparams must be constants (get_attr), got {node}")
    value: torch.Tensor = fetch_attr(gm, str(node.target))
    return value


def _shape_of(gm: GraphModule, node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    if isinstance(node, Node) and node.op == "get_attr":
        return tuple(_attr(gm, node).shape)
    raise LoweringError(f"cannot tell the shape of {node} (no recorded value)")


def onnx_block_form(
    scale: torch.Tensor, zero_point: torch.Tensor, block_size: Sequence[int], shape: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """quantplug per-block qparams as ONNX Q/DQ inputs: ``(scale, zero_point, axis, block)``.

    ``block == 0`` means per-axis (1-D scale along ``axis``) or, with a 0-d scale, per-tensor;
    otherwise the scale has the tensor's rank, ``ceil(dim / block)`` entries on ``axis`` and the
    full size on every other axis (repeated from quantplug's compact block grid).
    """
    from quantplug.observers.per_block import block_grid_shape, resolve_block_size

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
    axis = max(blocked, key=lambda i: (block[i], i)) if blocked else len(dims) - 1
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
    return spread_s.contiguous(), spread_z.contiguous(), axis, block[axis] if blocked else 1


def _rewrite_block_node(gm: GraphModule, node: Node) -> None:
    x, scale_node, zp_node, block_size, qmin, qmax, dtype = node.args[:7]
    shape = _shape_of(gm, x)
    scale, zero_point, axis, block = onnx_block_form(
        _attr(gm, scale_node),
        _attr(gm, zp_node),
        [int(b) for b in block_size],  # type: ignore[union-attr,arg-type]
        shape,
    )
    from quantplug.annotation.dtypes import storage_dtype

    container = storage_dtype(dtype) if isinstance(dtype, torch.dtype) else torch.int8
    names = []
    for prefix, value in (
        ("onnx_scale", scale.to(torch.float32)),
        ("onnx_zero_point", zero_point.to(container)),
    ):
        i = 0
        while hasattr(gm, f"{scale_node.name}_{prefix}{i}"):  # type: ignore[union-attr]
            i += 1
        name = f"{scale_node.name}_{prefix}{i}"  # type: ignore[union-attr]
        gm.register_buffer(name, value)
        names.append(name)
    with gm.graph.inserting_before(node):
        s = gm.graph.get_attr(names[0])
        z = gm.graph.get_attr(names[1])
    target = _onnx_dequantize if node.target == qp_ops.dequantize_per_block else _onnx_quantize
    node.target = target
    node.args = (x, s, z, axis, block, qmin, qmax, dtype if node.target == _onnx_quantize else torch.float32)
    node.kwargs = {}


# ONNX-shaped Q/DQ as torch ops (so the rewritten program still runs and exports)


def _expand_onnx_param(param: torch.Tensor, x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    if param.dim() == 0:
        return param
    if block == 0:
        shape = [1] * x.dim()
        shape[axis] = -1
        return param.reshape(shape)
    return param.repeat_interleave(block, dim=axis).narrow(axis, 0, x.shape[axis])


@torch.library.custom_op("quantplug::onnx_quantize_linear", mutates_args=())
def _onnx_quantize_op(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    block: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    s = _expand_onnx_param(scale.float(), x, axis, block)
    z = _expand_onnx_param(zero_point.float(), x, axis, block)
    return torch.clamp(torch.round(x.float() / s) + z, quant_min, quant_max).to(zero_point.dtype)


@_onnx_quantize_op.register_fake
def _(x, scale, zero_point, axis, block, quant_min, quant_max, dtype):  # type: ignore[no-untyped-def]
    return torch.empty_like(x, dtype=zero_point.dtype)


@torch.library.custom_op("quantplug::onnx_dequantize_linear", mutates_args=())
def _onnx_dequantize_op(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    block: int,
    quant_min: int,
    quant_max: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    s = _expand_onnx_param(scale.float(), q, axis, block)
    z = _expand_onnx_param(zero_point.float(), q, axis, block)
    return ((q.float() - z) * s).to(out_dtype)


@_onnx_dequantize_op.register_fake
def _(q, scale, zero_point, axis, block, quant_min, quant_max, out_dtype):  # type: ignore[no-untyped-def]
    return torch.empty_like(q, dtype=out_dtype)


_onnx_quantize = torch.ops.quantplug.onnx_quantize_linear.default
_onnx_dequantize = torch.ops.quantplug.onnx_dequantize_linear.default


# --------------------------------------------------------------------------------- translations


def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """The ONNX translations this module adds to the stock exporter's (torch op -> function)."""
    return {
        _onnx_quantize: _t_onnx_quantize_linear,
        _onnx_dequantize: _t_onnx_dequantize_linear,
        qd.quantize_per_tensor.default: _t_quantize_per_tensor,
        qd.quantize_per_tensor.tensor: _t_quantize_per_tensor_tensor,
        qd.dequantize_per_tensor.tensor: _t_dequantize_per_tensor_tensor,
        qd.choose_qparams.tensor: _t_choose_qparams_tensor,
        qd.choose_qparams_symmetric.tensor: _t_choose_qparams_symmetric_tensor,
        qd.choose_qparams_per_token_asymmetric.default: _t_choose_qparams_per_token_asymmetric,
        qd.quantize_per_token.default: _t_quantize_per_token,
        qd.dequantize_per_token.default: _t_dequantize_per_token,
    }


# The functions below are onnxscript trace-only translations: the exporter calls them with
# ``ir.Value`` tensors (parameters annotated ``Any``) and Python attributes (annotated ``int`` /
# ``float``; torch dtypes arrive as ONNX data type numbers). They build nodes with ``opset21``.

_FLOAT = 1
_INT64 = 7
_DOUBLE = 11


def _op() -> Any:
    from onnxscript import opset21

    return opset21


def _const(value: Any, onnx_dtype: int) -> Any:
    import numpy as np
    import onnx_ir as ir

    array = np.array(value, dtype=ir.DataType(onnx_dtype).numpy())
    return _op().Constant(value=ir.tensor(array))


def _full_range(onnx_dtype: int) -> tuple[int, int]:
    import numpy as np
    import onnx_ir as ir

    info = np.iinfo(ir.DataType(onnx_dtype).numpy())
    return int(info.min), int(info.max)


def _clip_to_range(q: Any, quant_min: int, quant_max: int, dtype: int) -> Any:
    """QuantizeLinear saturates to the dtype; a narrower [quant_min, quant_max] needs a Clip."""
    if (quant_min, quant_max) == _full_range(dtype):
        return q
    return _op().Clip(q, _const(quant_min, dtype), _const(quant_max, dtype))


def _scalar(value: Any, onnx_dtype: int) -> Any:
    """A 1-element tensor as a float/int scalar of ``onnx_dtype``."""
    op = _op()
    return op.Reshape(op.Cast(value, to=onnx_dtype), _const([], _INT64))


def _t_onnx_quantize_linear(
    x: Any, scale: Any, zero_point: Any, axis: int, block: int, quant_min: int, quant_max: int, dtype: int
) -> Any:
    op = _op()
    if block:
        q = op.QuantizeLinear(x, scale, zero_point, axis=axis, block_size=block)
    else:
        q = op.QuantizeLinear(x, scale, zero_point, axis=axis)
    return _clip_to_range(q, quant_min, quant_max, dtype)


def _t_onnx_dequantize_linear(
    q: Any, scale: Any, zero_point: Any, axis: int, block: int, quant_min: int, quant_max: int, out_dtype: int
) -> Any:
    op = _op()
    if block:
        y = op.DequantizeLinear(q, scale, zero_point, axis=axis, block_size=block)
    else:
        y = op.DequantizeLinear(q, scale, zero_point, axis=axis)
    return y if out_dtype in (-1, _FLOAT) else op.Cast(y, to=out_dtype)


def _t_quantize_per_tensor(
    x: Any, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: int
) -> Any:
    q = _op().QuantizeLinear(x, _const(scale, _FLOAT), _const(zero_point, dtype))
    return _clip_to_range(q, quant_min, quant_max, dtype)


def _t_quantize_per_tensor_tensor(
    x: Any, scale: Any, zero_point: Any, quant_min: int, quant_max: int, dtype: int
) -> Any:
    q = _op().QuantizeLinear(x, _scalar(scale, _FLOAT), _scalar(zero_point, dtype))
    return _clip_to_range(q, quant_min, quant_max, dtype)


def _t_dequantize_per_tensor_tensor(
    q: Any, scale: Any, zero_point: Any, quant_min: int, quant_max: int, dtype: int, out_dtype: int = -1
) -> Any:
    op = _op()
    y = op.DequantizeLinear(q, _scalar(scale, _FLOAT), _scalar(zero_point, dtype))
    return y if out_dtype in (-1, _FLOAT) else op.Cast(y, to=out_dtype)


def _tensor_min_max(x: Any, keep_last: bool) -> tuple[Any, Any]:
    op = _op()
    if keep_last:
        axes = _const([-1], _INT64)
        return op.ReduceMin(x, axes, keepdims=1), op.ReduceMax(x, axes, keepdims=1)
    return op.ReduceMin(x, keepdims=0), op.ReduceMax(x, keepdims=0)


def _t_choose_qparams_tensor(
    x: Any, quant_min: int, quant_max: int, eps: float, dtype: int
) -> tuple[Any, Any]:
    """Per-tensor asymmetric qparams, as ``torch.ao...determine_qparams`` computes them."""
    op = _op()
    lo, hi = _tensor_min_max(op.Cast(x, to=_FLOAT), keep_last=False)
    zero = _const(0.0, _FLOAT)
    lo, hi = op.Min(lo, zero), op.Max(hi, zero)
    scale = op.Max(op.Div(op.Sub(hi, lo), _const(float(quant_max - quant_min), _FLOAT)), _const(eps, _FLOAT))
    zp = op.Sub(_const(float(quant_min), _FLOAT), op.Round(op.Div(lo, scale)))
    zp = op.Clip(zp, _const(float(quant_min), _FLOAT), _const(float(quant_max), _FLOAT))
    return op.Cast(scale, to=_DOUBLE), op.Cast(zp, to=_INT64)


def _t_choose_qparams_symmetric_tensor(
    x: Any, quant_min: int, quant_max: int, eps: float, dtype: int
) -> tuple[Any, Any]:
    op = _op()
    lo, hi = _tensor_min_max(op.Cast(x, to=_FLOAT), keep_last=False)
    zero = _const(0.0, _FLOAT)
    amax = op.Max(op.Neg(op.Min(lo, zero)), op.Max(hi, zero))
    scale = op.Max(op.Div(amax, _const(float(quant_max - quant_min) / 2, _FLOAT)), _const(eps, _FLOAT))
    mid = 128 if _full_range(dtype) == (0, 255) else 0
    return op.Cast(scale, to=_DOUBLE), _const(mid, _INT64)


def _t_choose_qparams_per_token_asymmetric(x: Any, dtype: int) -> tuple[Any, Any]:
    """Per-token (last dim) int8 qparams with the arithmetic of ``quantized_decomposed``."""
    op = _op()
    qmin, qmax = -128.0, 127.0
    xf = op.Cast(x, to=_FLOAT)
    lo, hi = _tensor_min_max(xf, keep_last=True)
    zero = _const(0.0, _FLOAT)
    lo, hi = op.Min(lo, zero), op.Max(hi, zero)
    eps = float(torch.finfo(torch.float32).eps)
    scale = op.Max(op.Div(op.Sub(hi, lo), _const(qmax - qmin, _FLOAT)), _const(eps, _FLOAT))
    d_lo, d_hi = op.Div(lo, scale), op.Div(hi, scale)
    from_min = op.Add(_const(qmin, _FLOAT), d_lo)
    from_max = op.Add(_const(qmax, _FLOAT), d_hi)
    zp = op.Where(
        op.Greater(op.Add(from_min, from_max), zero),
        op.Sub(_const(qmin, _FLOAT), d_lo),
        op.Sub(_const(qmax, _FLOAT), d_hi),
    )
    zp = op.Round(op.Clip(zp, _const(qmin, _FLOAT), _const(qmax, _FLOAT)))
    return op.Cast(scale, to=_DOUBLE), op.Cast(zp, to=_INT64)


def _t_quantize_per_token(
    x: Any, scales: Any, zero_points: Any, quant_min: int, quant_max: int, dtype: int
) -> Any:
    """``round(x * (1 / scale) + zero_point)`` clamped, in double precision like the torch op."""
    op = _op()
    inv = op.Div(_const(1.0, _DOUBLE), op.Cast(scales, to=_DOUBLE))
    y = op.Add(op.Mul(op.Cast(x, to=_DOUBLE), inv), op.Cast(zero_points, to=_DOUBLE))
    y = op.Clip(op.Round(y), _const(float(quant_min), _DOUBLE), _const(float(quant_max), _DOUBLE))
    return op.Cast(y, to=dtype)


def _t_dequantize_per_token(
    q: Any,
    scales: Any,
    zero_points: Any,
    quant_min: int,
    quant_max: int,
    dtype: int,
    output_dtype: int = _FLOAT,
) -> Any:
    op = _op()
    centered = op.Sub(op.Cast(q, to=_INT64), op.Cast(zero_points, to=_INT64))
    y = op.Mul(op.Cast(centered, to=_DOUBLE), op.Cast(scales, to=_DOUBLE))
    return op.Cast(y, to=_FLOAT if output_dtype in (-1, None) else output_dtype)


# --------------------------------------------------------------------------------- errors


_NODE_PATTERN = re.compile(r"translating node %([\w.]+)")
_OP_PATTERN = re.compile(
    r"torch\.ops\.(\w+)\.(\w+)\.(\w+)|op='(\w+)\.(\w+)', overload='(\w+)'|\b(\w+)::(\w+)(?:\.(\w+))?"
)


def _op_label(target: Any) -> str:
    from quantplug.plugins.contract import op_name

    return op_name(target)


def _check_translatable(exported: torch.export.ExportedProgram, table: Mapping[Any, Any], opset: int) -> None:
    """Fail early, naming the op, when a custom (non-ATen) op has no ONNX translation.

    ATen ops the stock exporter lacks are usually decomposed by it; those errors are reported
    after the export attempt (``_export_error``).
    """
    try:
        from torch.onnx._internal.exporter import _registration

        registry = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, 18))
    except Exception:  # private API moved: rely on the export error instead
        return
    for node in exported.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in table or node.target.namespace in ("aten", "prims"):
            continue
        if registry.is_registered(node.target):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(node.target.name(), "CompositeImplicitAutograd"):
            continue
        raise LoweringError(
            f"op {_op_label(node.target)} (node {node.name!r}) has no ONNX translation; "
            "pass custom_translations={op: onnxscript_function} or keep that op out of the model"
        )


def _export_error(exc: Exception, exported: torch.export.ExportedProgram) -> LoweringError:
    """A LoweringError naming the op (and node) the exporter could not translate, when it can tell."""
    chain = _chain(exc)
    cause = chain[-1]
    reason = f"{type(cause).__name__}: {_first_line(cause)}"
    nodes = {n.name: n for n in exported.graph.nodes if n.op == "call_function"}
    by_op: dict[str, Node] = {}
    for node in nodes.values():
        by_op.setdefault(_op_label(node.target), node)
    culprit: Node | None = None
    named_op: str | None = None
    for err in chain:
        text = str(err)
        for match in _NODE_PATTERN.finditer(text):
            culprit = culprit or nodes.get(match.group(1))
        for match in _OP_PATTERN.finditer(text):
            parts = [p for p in match.groups() if p is not None] + ["default"]
            op = f"{parts[0]}.{parts[1]}.{parts[2]}"
            culprit = culprit or by_op.get(op)
            named_op = named_op or op
    if culprit is not None:
        return LoweringError(
            f"ONNX export failed at op {_op_label(culprit.target)} (node {culprit.name!r}): {reason}"
        )
    if named_op is not None:
        return LoweringError(f"ONNX export failed at op {named_op} (from a decomposition): {reason}")
    return LoweringError(f"ONNX export failed: {reason}")


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


# --------------------------------------------------------------------------------- mapping encodings


def _qdq_nodes(gm: GraphModule) -> list[Node]:
    targets = (*STATIC_QUANTIZE, *STATIC_DEQUANTIZE, _onnx_quantize, _onnx_dequantize)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _match_qdq_names(program: GraphModule, exported: GraphModule) -> dict[str, str]:
    """Program Q/DQ node name -> the re-exported node's name (export traces them in order)."""
    mine, theirs = _qdq_nodes(program), _qdq_nodes(exported)
    if len(mine) != len(theirs) or any(a.target != b.target for a, b in zip(mine, theirs)):
        return {n.name: n.name for n in mine}
    return {a.name: b.name for a, b in zip(mine, theirs)}


def _map_encodings(result: OnnxExportResult, name_map: Mapping[str, str]) -> None:
    graph = result.model.graph
    producer: dict[str, Any] = {}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for out in node.output:
            producer[out] = node
        for inp in node.input:
            consumers.setdefault(inp, []).append(node)
    for entry in result.encodings:
        onnx_name = name_map.get(entry["node"], entry["node"])
        # a rewritten per-block node keeps its name
        node = producer.get(onnx_name)
        info: dict[str, Any] | None = None
        if node is not None and entry["kind"] == "activation" and node.op_type == "QuantizeLinear":
            quantized = node.output[0]
            info = {
                "tensor": node.input[0],
                "quantized": quantized,
                "dequantized": [
                    c.output[0] for c in consumers.get(quantized, []) if c.op_type == "DequantizeLinear"
                ],
                "node": node.name,
            }
        elif node is not None and entry["kind"] == "constant" and node.op_type == "DequantizeLinear":
            info = {
                "tensor": node.output[0],
                "quantized": node.input[0],
                "dequantized": [node.output[0]],
                "node": node.name,
            }
        if info is not None:
            info["scale"] = node.input[1]  # type: ignore[union-attr]
            info["zero_point"] = node.input[2] if len(node.input) > 2 else None  # type: ignore[union-attr]
            for name in {info["tensor"], info["quantized"], *info["dequantized"]}:
                result.tensor_encodings.setdefault(name, entry)
        entry["onnx"] = info


# --------------------------------------------------------------------------------- 4-bit storage


def pack_int4_constants(result: OnnxExportResult) -> list[str]:
    """Store 4-bit constants (int8 containers holding a ``[-8, 7]`` / ``[0, 15]`` grid) as ONNX
    ``INT4`` / ``UINT4`` initializers, two values per byte. Returns the initializers changed.

    The ``DequantizeLinear`` results are unchanged; runtimes that read 4-bit weights natively
    (ONNX Runtime's ``MatMulNBits``) need this type to recognise them. A zero point shared with
    a constant that stays 8-bit keeps the whole pair 8-bit.
    """
    from onnx import TensorProto, numpy_helper

    graph = result.model.graph
    inits = {t.name: t for t in graph.initializer}
    users: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    wanted: dict[str, Any] = {}  # initializer -> ONNX 4-bit type
    for entry in result.encodings:
        info = entry.get("onnx")
        if entry["kind"] != "constant" or info is None:
            continue
        lo, hi = int(entry["quant_min"]), int(entry["quant_max"])
        if entry["dtype"] == "int8" and -8 <= lo and hi <= 7:
            target = TensorProto.INT4
        elif entry["dtype"] == "uint8" and 0 <= lo and hi <= 15:
            target = TensorProto.UINT4
        else:
            continue
        names = [info["quantized"], info.get("zero_point")]
        if not all(n is None or n in inits for n in names) or info["quantized"] not in inits:
            continue
        for name in names:
            if name is not None:
                wanted[name] = target
    import ml_dtypes

    arrays = {name: numpy_helper.to_array(inits[name]) for name in wanted}
    for name, target in list(wanted.items()):
        lo, hi = (-8, 7) if target == TensorProto.INT4 else (0, 15)
        array = arrays[name]
        if array.size and (int(array.min()) < lo or int(array.max()) > hi):
            del wanted[name]
    # a DequantizeLinear reading a converted tensor needs its data and zero point both converted
    changed = True
    while changed:
        changed = False
        for name in list(wanted):
            for node in users.get(name, []):
                pair = [node.input[0], node.input[2] if len(node.input) > 2 else ""]
                if node.op_type != "DequantizeLinear" or any(p and p not in wanted for p in pair):
                    for p in pair:
                        if p in wanted:
                            del wanted[p]
                            changed = True
    for name, target in wanted.items():
        dtype = ml_dtypes.int4 if target == TensorProto.INT4 else ml_dtypes.uint4
        inits[name].CopyFrom(numpy_helper.from_array(arrays[name].astype(dtype), name))
    return sorted(wanted)


# --------------------------------------------------------------------------------- model helpers


def _fix_opset(model: Any, opset: int) -> None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version < opset:
            imp.version = opset


def _value_infos(onnx: Any, values: Any, initializers: Any) -> list[OnnxTensorInfo]:
    init_names = {t.name for t in initializers}
    infos = []
    for v in values:
        if v.name in init_names:
            continue
        t = v.type.tensor_type
        dims: list[int | str] = []
        for d in t.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?"))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else "unknown"
        infos.append(OnnxTensorInfo(v.name, tuple(dims), dtype))
    return infos


_EXTERNAL_THRESHOLD = 1_800_000_000


def _save_model(model: Any, path: Path) -> Path:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    if model.ByteSize() > _EXTERNAL_THRESHOLD:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
        )
    else:
        onnx.save_model(model, str(path))
    return path
