"""Exporting a converted (Q/DQ) program to a QDQ ONNX model, for any backend.

``export_qdq_onnx(quantized, path=None)`` turns the reference quantized program into ONNX: every
``quantize``/``dequantize`` node becomes a ``QuantizeLinear``/``DequantizeLinear`` node (opset 21
by default, needed for 16-bit, 4-bit and blocked grids), every quantized weight an integer
initializer, and the result says where each of quantplug's encodings
(``_quantplug.flow.inspect.encodings``) lives in the model, which is what backends writing an
encodings file beside the model need.

How, in three steps, each linear in the program's size:

1. the program is wrapped as an ``ExportedProgram`` as it is (``lowering.capture``), with the
   dynamic dimensions it was exported with (``torch.export.Dim``): no second trace;
2. its Q/DQ nodes are replaced by opaque *sites* and the rest is translated by torch's ONNX
   exporter (``lowering.onnx_translate``: the exporter's own translations, without its quadratic
   optimizer);
3. each site becomes the Q/DQ nodes it stands for, built here from the program's qparams
   (``lowering.qdq_sites``): nothing the exporter does can merge, fold or rename them, so the
   mapping from encodings to ONNX tensors is exact by construction.

What the stock exporter lacks, this module adds:

* quantplug's per-block grids in ONNX's form (one blocked axis, the scale spread over the other
  axes; or per axis / per tensor when that is what the blocks amount to): ``DequantizeLinear(...,
  axis, block_size)``;
* dynamic quantization (``choose_qparams*``, per-token ``quantize``/``dequantize``): spelled out
  with reductions and elementwise ops, with the arithmetic of ``quantized_decomposed``;
* a narrowed range (e.g. ``int16 [-32767, 32767]``): in the encodings only, the model staying
  pure Q/DQ (``QuantizeLinear`` saturates to the whole dtype; see ``qdq_sites``); or, with
  ``clip_narrowed_ranges=True``, an integer ``Clip`` after the ``QuantizeLinear``.

The core does not depend on ONNX: ``onnx`` and ``onnxscript`` are imported when this module's
functions run, and their absence is a ``LoweringError`` saying what to install.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from _quantplug.errors import LoweringError
from _quantplug.flow.inspect import encodings as read_encodings
from _quantplug.graph.op_names import op_name
from _quantplug.lowering.onnx import qdq_sites
from _quantplug.lowering.onnx.capture import dimension_names, to_exported_program
from _quantplug.lowering.onnx.provenance import where
from _quantplug.lowering.onnx.qdq_sites import STATIC_DEQUANTIZE, STATIC_QUANTIZE, onnx_block_form
from _quantplug.observers import block_ops as qp_ops
from _quantplug.peers.onnx_contiguous import contiguous_as_clone
from _quantplug.peers.onnx_in_place_writes import writes_out_of_place
from _quantplug.peers.onnx_projected_lstm import decompose_projected_lstms
from _quantplug.peers.onnx_translate import registered, translate

qd = torch.ops.quantized_decomposed

#: opset that has 16-bit and 4-bit Q/DQ types and blocked quantization
DEFAULT_OPSET = 21
#: torch's ONNX translations (torchlib) are written for opset 18; converting them down fails
MIN_OPSET = 18
_NEEDS_21 = "16-bit, 4-bit and per-block Q/DQ need ONNX opset >= 21"

__all__ = [
    "DEFAULT_OPSET",
    "STATIC_DEQUANTIZE",
    "STATIC_QUANTIZE",
    "OnnxExportResult",
    "OnnxTensorInfo",
    "compact_node_metadata",
    "export_qdq_onnx",
    "onnx_block_form",
    "pack_int4_constants",
    "require_onnx",
    "translation_table",
]


# --------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class OnnxTensorInfo:
    """A graph input or output of the ONNX model.

    ``shape`` holds an ``int`` per static dimension and a ``str`` (the dimension's name, e.g.
    ``"batch"`` for ``torch.export.Dim("batch")``) per dynamic one.
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str  # numpy-style name: "float32", "int64"...


@dataclass
class OnnxExportResult:
    """The exported model and where each quantplug encoding lives in it.

    ``encodings`` is ``_quantplug.flow.inspect.encodings(program)`` with an ``"onnx"`` entry added
    to each item (``None`` when the tensor is not in the model: a quantize or dequantize node
    nothing reads):

    * ``tensor``: the float tensor the encoding describes: the input of the ``QuantizeLinear``
      for activations, the output of the ``DequantizeLinear`` for constants (weights, biases);
    * ``quantized``: the integer tensor: the ``QuantizeLinear`` output (after its ``Clip`` when
      the range is narrowed and ``clip_narrowed_ranges`` was asked for), or the integer
      initializer of a constant;
    * ``dequantized``: the outputs of the ``DequantizeLinear`` nodes that read ``quantized``
      (of the ``Cast`` after one, for a float16/bfloat16 program: what their readers read; the
      same holds for a constant's ``tensor``);
    * ``scale`` / ``zero_point``: the names of the scale and zero-point initializers of the Q
      (or DQ), private to that node;
    * ``node``: the ``QuantizeLinear`` (activations) or ``DequantizeLinear`` (constants) node,
      named like the program's node.

    ``tensor_encodings`` maps every one of those tensor names (``tensor``, ``quantized`` and each
    ``dequantized``) to its entry. ``dynamic_axes`` maps each input/output with dynamic
    dimensions to ``{axis: name}``.
    """

    model: Any  # onnx.ModelProto
    opset: int
    inputs: list[OnnxTensorInfo]
    outputs: list[OnnxTensorInfo]
    encodings: list[dict[str, Any]]
    tensor_encodings: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: Path | None = None
    _program: GraphModule | None = field(default=None, repr=False)
    _exported: Any = field(default=None, repr=False)
    #: initializers kept out of ``model`` (``external_data=True``): name -> ``onnx_ir`` tensor
    #: over the program's own storage, written to the ``.data`` file by :meth:`save`
    _external: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def exported_program(self) -> Any:
        """The exported Q/DQ program as a ``torch.export.ExportedProgram`` (built on first use,
        with the same dynamic dimensions), e.g. for ``torch.export.save``."""
        if self._exported is None and self._program is not None:
            self._exported = to_exported_program(self._program)
        return self._exported

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
            for t in (*self.inputs, *self.outputs)
            if any(isinstance(d, str) for d in t.shape)
        }

    @property
    def unmapped(self) -> list[str]:
        """quantplug encoding nodes with no tensor in the ONNX model."""
        return [e["node"] for e in self.encodings if e.get("onnx") is None]

    @property
    def external_bytes(self) -> int:
        """Bytes of the initializers kept out of ``model`` (0 unless ``external_data=True``)."""
        return sum(int(t.nbytes) for t in self._external.values())

    def initializer_array(self, name: str) -> Any:
        """An initializer's values as a numpy array, wherever they are kept (a view of the
        program's tensor when kept out of ``model``)."""
        if name in self._external:
            return self._external[name].numpy()
        from onnx import numpy_helper

        found = next((t for t in self.model.graph.initializer if t.name == name), None)
        if found is None:
            raise KeyError(f"no initializer {name!r} in the model")
        return numpy_helper.to_array(found)

    def model_bytes(self) -> bytes:
        """The serialized model, every initializer inside it (with ``external_data=True`` this
        builds a full copy: for small models; large ones go through :meth:`save`)."""
        if not self._external:
            return bytes(self.model.SerializeToString())
        full = type(self.model)()
        full.CopyFrom(self.model)
        for tensor in full.graph.initializer:
            data = self._external.get(tensor.name)
            if data is not None:
                del tensor.external_data[:]
                tensor.data_location = tensor.DEFAULT
                tensor.raw_data = data.tobytes()
        return bytes(full.SerializeToString())

    def model_writer(self) -> Callable[[Path], Path]:
        """:meth:`save` as a ``write(path)`` callable for an :class:`Artifact`'s files, holding
        only the model and the tensors kept out of it: neither the program nor the encodings
        (whose per-block scales, as Python lists, outweigh an LPBQ model's block scales 8 to 1)
        live on with the artifact."""
        model, external = self.model, self._external

        def write(path: Path) -> Path:
            if not external:
                return _save_model(model, Path(path))
            return _save_with_external_data(model, external, Path(path))

        return write

    def save(self, path: str | Path) -> Path:
        """Write the model to ``path``. Initializers kept out of ``model`` (``external_data=True``)
        are streamed, one tensor at a time, to ``<file name>.data`` beside it, and ``model``
        then records where each one is; otherwise weights past 2 GB go to such a file."""
        return self.model_writer()(Path(path))


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
    clip_narrowed_ranges: bool = False,
    external_data: bool = False,
) -> OnnxExportResult:
    """Export a converted (Q/DQ) program to a QDQ ONNX model.

    Args:
        quantized: the output of :func:`quantplug.convert` (or a lowering pass's rewrite of it).
        example_inputs: optional; the model's shapes are the program's own (static, or dynamic
            where it was exported with ``torch.export.Dim``). When given, they are checked
            against those shapes (a clear error instead of a model for other inputs).
        path: where to write the ``.onnx`` file (optional; the model is returned either way).
        opset: ONNX opset, 18 or later (21 or later when the program has 16-bit, 4-bit or
            per-block tensors).
        optimize: drop nodes and initializers nothing reads (Q/DQ nodes included only when their
            output is unused).
        input_names / output_names: ONNX graph input/output names (default: the program's).
        custom_translations: extra ``{torch op: onnxscript function}`` for ops of your own.
        clip_narrowed_ranges: an activation range narrower than its integer type (``int16
            [-32767, 32767]``) is by default carried by the encodings only, the model holding no
            integer op but Q/DQ (what Qualcomm's converter and ONNX Runtime take); ``True`` adds
            an integer ``Clip`` after its ``QuantizeLinear``, so that the ONNX arithmetic equals
            the program's beyond the calibrated range too (ONNX Runtime has no 16-bit ``Clip``).
        external_data: keep every initializer of at least :data:`EXTERNAL_MIN_BYTES` out of
            ``result.model``: it holds their name, type and shape (``data_location EXTERNAL``)
            while their values stay in the program's own tensors until ``result.save(path)``
            streams them to ``<file name>.data`` (write it with ``result.save``: ``onnx.save``
            has no data to write; ``result.model_bytes()`` builds a single-file copy). The proto
            then holds no copy of the weights (nor do the checks that serialize it, e.g. shape
            inference), which is what keeps lowering a large model from copying its weights.

    Raises:
        LoweringError: ``onnx``/``onnxscript`` are missing, the opset is too low, an input does
            not fit the program, or an op has no ONNX translation (the message names the op,
            the node and the module it belongs to).
    """
    onnx = require_onnx()
    if not isinstance(quantized, GraphModule):
        raise LoweringError(
            "export_qdq_onnx expects the GraphModule returned by quantplug.convert(), "
            f"got {type(quantized).__name__}"
        )
    _check_opset(quantized, opset)
    newest = int(onnx.defs.onnx_opset_version())
    if not MIN_OPSET <= opset <= newest:
        raise LoweringError(
            f"ONNX opset {opset} is not supported: use {MIN_OPSET} to {newest} (the installed onnx's "
            f"newest; torch's ONNX translations are written for {MIN_OPSET}; {DEFAULT_OPSET}, the default, "
            "has 16-bit, 4-bit and blocked Q/DQ)"
        )
    if example_inputs is not None:
        _check_example_inputs(quantized, example_inputs)
    table = read_encodings(quantized)
    sites = qdq_sites.find_sites(quantized)

    def rewrite(graph: Graph) -> None:  # on lowering's own copy: the exporter's known failures
        qdq_sites.mark_sites(graph, sites)
        decompose_projected_lstms(graph)
        contiguous_as_clone(graph)
        writes_out_of_place(graph)

    program = to_exported_program(quantized, rewrite=rewrite)
    translations: dict[Callable[..., Any], Callable[..., Any]] = {
        **translation_table(),
        **(custom_translations or {}),
        qdq_sites.qdq_site: qdq_sites._t_qdq_site,
    }
    _check_translatable(program, translations, opset)
    try:
        # unused nodes go before the sites become Q/DQ nodes: those are all read
        model = translate(program, opset=opset, translations=translations, drop_unused=optimize)
    except LoweringError:
        raise
    except Exception as exc:
        raise _export_error(exc, program) from exc
    _rename(model.graph.inputs, input_names, "input")
    _rename(model.graph.outputs, output_names, "output")
    placed = qdq_sites.insert_qdq(model, sites, clip_narrowed_ranges=clip_narrowed_ranges, opset=opset)
    _name_dimensions(model, dimension_names(program))
    external = _keep_out_large_initializers(model) if external_data else {}
    proto = _serialize(model)
    del model, program  # the ONNX graph: only ``external``'s tensors (the program's) live on
    result = OnnxExportResult(
        model=proto,
        opset=opset,
        inputs=_value_infos(onnx, proto.graph.input, proto.graph.initializer),
        outputs=_value_infos(onnx, proto.graph.output, ()),
        encodings=[dict(e) for e in table],
        _program=quantized,
        _external=external,
    )
    _map_encodings(result, placed)
    if path is not None:
        result.path = result.save(path)
    return result


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


# --------------------------------------------------------------------------------- checking the program


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


def _check_example_inputs(gm: GraphModule, inputs: Sequence[Any]) -> None:
    """Example inputs must fit the program's inputs (dtype, rank, every static dimension)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(placeholders):
        raise LoweringError(
            f"{len(inputs)} example input(s) given; the program takes {len(placeholders)} "
            f"({', '.join(p.name for p in placeholders)})"
        )
    for node, value in zip(placeholders, inputs):
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(value, torch.Tensor)):
            continue
        expected = [d if isinstance(d, int) else "*" for d in val.shape]
        fits = value.dim() == val.dim() and all(e == "*" or e == s for e, s in zip(expected, value.shape))
        if not fits or value.dtype != val.dtype:
            raise LoweringError(
                f"example input {node.name!r} is {value.dtype}{list(value.shape)}; the program takes "
                f"{val.dtype}{expected} (* = dynamic). The ONNX model has the program's shapes: to "
                "change them, export the model again (torch.export.Dim for dynamic dimensions)"
            )


# --------------------------------------------------------------------------------- after translation


def _name_dimensions(model: Any, names: Mapping[str, str]) -> None:
    """Dynamic dimensions named as the user named them (``batch``, not ``s77``), everywhere."""
    import onnx_ir as ir

    if not names:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")

    def rename(value: Any) -> None:
        shape = value.shape
        if shape is None or not any(isinstance(d, ir.SymbolicDim) and d.value for d in shape):
            return
        dims = [
            ir.SymbolicDim(pattern.sub(lambda m: names[m.group(1)], d.value))
            if isinstance(d, ir.SymbolicDim) and d.value
            else d
            for d in shape
        ]
        value.shape = ir.Shape(dims)

    for value in model.graph.inputs:
        rename(value)
    for node in model.graph:
        for value in node.outputs:
            rename(value)


def _rename(values: Sequence[Any], names: Sequence[str] | None, what: str) -> None:
    if names is None:
        return
    if len(names) != len(values):
        raise LoweringError(f"{len(names)} {what} name(s) given; the model has {len(values)} {what}(s)")
    for value, name in zip(values, names):
        value.name = str(name)


def _serialize(model: Any) -> Any:
    import onnx_ir as ir

    return ir.serde.serialize_model(model)


#: with ``external_data=True``, initializers of at least this many bytes stay out of the model
#: proto (ONNX's own ``size_threshold`` for external data)
EXTERNAL_MIN_BYTES = 1024
#: the placeholder location of initializers kept out of the proto, until ``save`` writes them
_UNSAVED = "<unsaved>"


def _keep_out_large_initializers(model: Any) -> dict[str, Any]:
    """Swap each large initializer of ``model`` (an ``onnx_ir.Model``) for an external reference,
    so that serializing the model copies none of its data; return the tensors swapped out, by
    name, in the model's order."""
    import onnx_ir as ir

    kept: dict[str, Any] = {}
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.nbytes < EXTERNAL_MIN_BYTES:
            continue
        kept[name] = tensor
        value.const_value = ir.ExternalTensor(
            _UNSAVED, None, None, tensor.dtype, shape=tensor.shape, name=name
        )
    return kept


#: tensors past this size start at a multiple of the page size in the ``.data`` file (mappable)
_ALIGN_FROM_BYTES = 1 << 20
_PAGE = 4096


def _tensor_bytes(tensor: Any) -> Any:
    """An ``onnx_ir`` tensor's ONNX bytes (little-endian): the program's own memory when it is laid
    out so already, else a copy of this one tensor (4-bit codes are packed two a byte here)."""
    import sys

    import numpy as np
    import onnx_ir as ir

    if sys.byteorder == "little" and not isinstance(tensor, ir.LazyTensor) and tensor.dtype.bitwidth >= 8:
        array = tensor.numpy()
        if array.flags.c_contiguous and array.dtype.kind in "biuf":
            return array.reshape(-1).view(np.uint8).data
    return tensor.tobytes()


def _save_with_external_data(model: Any, tensors: Mapping[str, Any], path: Path) -> Path:
    """Write ``tensors`` one by one to ``<path.name>.data``, record each one's place in
    ``model``'s initializers, then write ``model`` (which holds no tensor data) to ``path``."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    location = path.name + ".data"
    places: dict[str, tuple[int, int]] = {}
    with open(path.parent / location, "wb") as f:
        offset = 0
        for name, tensor in tensors.items():
            data = _tensor_bytes(tensor)
            if len(data) > _ALIGN_FROM_BYTES and offset % _PAGE:
                f.write(b"\0" * (_PAGE - offset % _PAGE))
                offset += _PAGE - offset % _PAGE
            f.write(data)
            places[name] = (offset, len(data))
            offset += len(data)
            del data
    for initializer in model.graph.initializer:
        place = places.get(initializer.name)
        if place is None:
            continue
        del initializer.external_data[:]
        initializer.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", place[0]), ("length", place[1])):
            entry = initializer.external_data.add()
            entry.key, entry.value = key, str(value)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def _map_encodings(result: OnnxExportResult, placed: Mapping[int, Any]) -> None:
    """Each encoding's ONNX tensors, from where its Q/DQ site was placed."""
    by_node = {p.site.node: p for p in placed.values()}
    present = {n.name for n in result.model.graph.node}
    readers: dict[str, list[str]] = {}  # quantized tensor -> outputs of the dequantize sites reading it
    for p in placed.values():
        if not p.site.quantize and p.node in present:
            readers.setdefault(p.input, []).append(p.output)
    for entry in result.encodings:
        p = by_node.get(entry["node"])
        info: dict[str, Any] | None = None
        if p is not None and p.node in present:
            if p.site.quantize:
                info = {"tensor": p.input, "quantized": p.output, "dequantized": readers.get(p.output, [])}
            else:
                info = {"tensor": p.output, "quantized": p.input, "dequantized": [p.output]}
            info.update(node=p.node, scale=p.scale, zero_point=p.zero_point)
            for name in (info["tensor"], info["quantized"], *info["dequantized"]):
                result.tensor_encodings.setdefault(name, entry)
        entry["onnx"] = info


# --------------------------------------------------------------------------------- translations


def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """The ONNX translations this module adds to the stock exporter's (torch op -> function):
    dynamic quantization, whose qparams are computed at run time (static Q/DQ nodes are sites)."""
    return {
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


def _check_translatable(exported: torch.export.ExportedProgram, table: Mapping[Any, Any], opset: int) -> None:
    """Fail early, naming the op, when a custom (non-ATen) op has no ONNX translation.

    ATen ops the stock exporter lacks are usually decomposed by it; those errors are reported
    after the export attempt (``_export_error``).
    """
    is_registered = registered(opset)
    if is_registered is None:  # private API moved: rely on the export error instead
        return
    for node in exported.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in table or node.target.namespace in ("aten", "prims"):
            continue
        if is_registered(node.target):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(node.target.name(), "CompositeImplicitAutograd"):
            continue
        label = op_name(node.target)
        raise LoweringError(
            f"op {label} (node {node.name!r}{where(node)}) has no ONNX translation; "
            + _AVOIDING.get(
                label.rsplit(".", 1)[0],
                "pass custom_translations={op: onnxscript_function} or keep that op out of the model",
            )
        )


#: how to keep out of a model the custom ops of a library that no ONNX form can express
_AVOIDING = {
    # a loop over the experts whose bounds are the routing's data (transformers 5's default MoE
    # kernel on CPU); batched_mm gathers each token's experts' weights and exports as bmm
    "transformers.grouped_mm_fallback": "it is transformers' grouped-matmul mixture-of-experts kernel, "
    "whose loop bounds depend on the routing: build the model with experts_implementation='batched_mm' "
    "(an argument of from_pretrained/from_config, or the config's), whose experts export as batched "
    "matmuls, are quantized and lower",
}


def _export_error(exc: Exception, exported: torch.export.ExportedProgram) -> LoweringError:
    """A LoweringError naming the op, node and module the exporter could not translate, when it can tell."""
    chain = _chain(exc)
    cause = chain[-1]
    reason = f"{type(cause).__name__}: {_first_line(cause)}"
    nodes = {n.name: n for n in exported.graph.nodes if n.op == "call_function"}
    by_op: dict[str, Node] = {}
    for node in nodes.values():
        by_op.setdefault(op_name(node.target), node)
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
    advice = "; pass custom_translations={op: onnxscript_function} for it, or keep that op out of the model"
    if culprit is not None:
        return LoweringError(
            f"ONNX export failed at op {op_name(culprit.target)} (node {culprit.name!r}{where(culprit)}): "
            f"{reason}{advice}"
        )
    if named_op is not None:
        return LoweringError(f"ONNX export failed at op {named_op} (from a decomposition): {reason}{advice}")
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


# --------------------------------------------------------------------------------- 4-bit storage


def pack_int4_constants(result: OnnxExportResult) -> list[str]:
    """Store 4-bit constants (int8 containers holding a ``[-8, 7]`` / ``[0, 15]`` grid) as ONNX
    ``INT4`` / ``UINT4`` initializers, two values per byte. Returns the initializers changed.

    The ``DequantizeLinear`` results are unchanged; runtimes that read 4-bit weights natively
    (ONNX Runtime's ``MatMulNBits``) need this type to recognise them. A zero point shared with
    a constant that stays 8-bit keeps the whole pair 8-bit. An initializer kept out of the model
    (``external_data=True``) is converted when :meth:`OnnxExportResult.save` writes it: no
    4-bit copy of the weights is held meanwhile.
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
    arrays = {name: result.initializer_array(name) for name in wanted}  # views, for kept-out ones
    for name, target in list(wanted.items()):
        lo, hi = (-8, 7) if target == TensorProto.INT4 else (0, 15)
        array = arrays[name]
        if array.dtype.kind not in "iu" or (array.size and (int(array.min()) < lo or int(array.max()) > hi)):
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
    for value in (*graph.value_info, *graph.input):  # the types stated for them follow
        if value.name in wanted and value.type.HasField("tensor_type"):
            value.type.tensor_type.elem_type = wanted[value.name]
    for name, target in wanted.items():
        if name in result._external:
            result._external[name] = _four_bit_on_write(arrays[name], target, name)
            inits[name].data_type = target
        else:
            inits[name].CopyFrom(numpy_helper.from_array(arrays[name].astype(_four_bit_numpy(target)), name))
    return sorted(wanted)


def _four_bit_numpy(onnx_type: int) -> Any:
    import ml_dtypes
    from onnx import TensorProto

    return ml_dtypes.int4 if onnx_type == TensorProto.INT4 else ml_dtypes.uint4


def _four_bit_on_write(array: Any, onnx_type: int, name: str) -> Any:
    """``array`` as an ``onnx_ir`` 4-bit tensor computed when its bytes are asked for."""
    import onnx_ir as ir

    dtype = _four_bit_numpy(onnx_type)
    return ir.LazyTensor(
        lambda: ir.Tensor(array.astype(dtype)), ir.DataType(onnx_type), ir.Shape(array.shape), name=name
    )


# --------------------------------------------------------------------------------- model helpers


#: what an artifact keeps of the torch exporter's notes on each ONNX node: its module path and
#: class (``"encoder.layers.0: EncoderLayer/linear_3: aten.linear.default"``), which viewers such
#: as Netron show beside the node
KEPT_NODE_METADATA = frozenset({"namespace"})


def compact_node_metadata(model: Any, keep: frozenset[str] = KEPT_NODE_METADATA) -> int:
    """Drop every node's metadata but ``keep`` (in subgraphs and functions too); return the bytes
    removed.

    The exporter notes the node's stack trace, FX text, class hierarchy and name scopes on every
    ONNX node: per node what the program's provenance already holds, and most of a large graph's
    file (61 % of the unrolled 100-step LSTM's in ``bench/results/recurrent_unroll.md``). A backend
    calls this after the checks that read them, so what it ships is the model without them.
    """
    before = model.ByteSize()

    def nodes(listed: Any) -> Any:
        for node in listed:
            yield node
            for attribute in node.attribute:
                for graph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                    yield from nodes(graph.node)

    for owner in (model.graph, *model.functions):
        for node in nodes(owner.node):
            kept = [(p.key, p.value) for p in node.metadata_props if p.key in keep]
            if len(kept) != len(node.metadata_props):
                del node.metadata_props[:]
                for key, value in kept:
                    node.metadata_props.add(key=key, value=value)
    return int(before - model.ByteSize())


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
