"""QNN encodings as pure functions: quantplug qparams -> QNN tensor encodings -> AIMET JSON.

Nothing here touches a graph or a device; the lowering writer feeds it the entries of
``quantplug.flow.inspect.encodings(program)`` (plus their ONNX tensor names), and the CPU
reference backend or a test can call it to see exactly what the device gets.

Conventions (formats doc section 3; ExecuTorch ``builders/node_visitor.py``):

* QNN tensors: ``real = scale * (q + offset)``, so **offset = -zero_point** on the tensor's own
  (signed or unsigned) grid; sub-byte grids live in 8-bit containers with a ``BW_*`` encoding;
  per-channel conv filters have their channel axis last after the OIHW -> HWIO layout change.
* AIMET JSON 0.6.1 / 1.0.0: the offset sits on the **unsigned** grid ``[0, 2^bw - 1]``:
  ``offset = -zero_point`` for unsigned dtypes and ``-(zero_point + 2^(bw-1))`` for signed ones,
  so a symmetric int8 weight reads ``offset -128``; 0.6.1 spells booleans as strings and lists
  one entry per channel.
* AIMET JSON 2.0.0: ONNX ``QuantizeLinear`` style: ``output_dtype`` (``int4``, ``uint16``...),
  ``y_scale``, ``y_zero_point`` in the output dtype's own convention (omitted when all zero).
* LPBQ (16a4w_block): ``per-channel scale = max(block scales) / 16`` and 4-bit integer block
  scales in ``[1, 16]``; the weight is ``q * int_scale * per-channel scale``. AIMET writes it as
  ``enc_type LPBQ, bw 8, compressed_bw 4`` (1.0.0) or ``per_channel_float_scale`` /
  ``per_block_int_scale`` (2.0.0); 0.6.1 cannot express it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import torch

from quantplug_qnn_htp.observers import LPBQ_SCALE_BITS, LPBQ_SCALE_STEPS, lpbq_quantize_scales

VERSIONS = ("0.6.1", "1.0.0", "2.0.0")
DEFAULT_VERSION = "1.0.0"
#: the conventional file name AIMET exports beside the model (``<prefix>.encodings``)
ENCODINGS_FILE = "model.encodings"
MODEL_FILE = "model.onnx"


class EncodingError(ValueError):
    """A quantized tensor that QNN cannot encode (the message names it and says why)."""


# --- scalar conventions ---------------------------------------------------------------------------


def bitwidth(quant_min: int, quant_max: int) -> int:
    """Bits a grid uses: ``[-7, 7]`` -> 4, ``[-127, 127]`` -> 8, ``[0, 65535]`` -> 16."""
    return max(1, int(quant_max - quant_min).bit_length())


def qnn_offset(zero_point: int) -> int:
    """QNN ``Qnn_ScaleOffset_t`` offset: ``real = scale * (q + offset)``."""
    return -int(zero_point)


def aimet_offset(zero_point: int, bw: int, signed: bool) -> int:
    """AIMET 0.6.1 / 1.0.0 offset, on the unsigned ``[0, 2^bw - 1]`` grid."""
    return -(int(zero_point) + (1 << (bw - 1))) if signed else -int(zero_point)


def qnn_datatype(bw: int, signed: bool) -> str:
    """The QNN tensor datatype (sub-byte grids in 8-bit containers, as ExecuTorch builds them)."""
    container = 8 if bw <= 8 else 16 if bw <= 16 else 32
    if container == 32 and not signed:
        return "QNN_DATATYPE_UFIXED_POINT_32"
    return f"QNN_DATATYPE_{'S' if signed else 'U'}FIXED_POINT_{container}"


def onnx_dtype_name(bw: int, signed: bool) -> str:
    """2.0.0 ``output_dtype``: int2/uint2/int4/uint4/int8/.../int32."""
    for width in (2, 4, 8, 16, 32):
        if bw <= width:
            return f"{'' if signed else 'u'}int{width}"
    raise EncodingError(f"no integer dtype holds {bw} bits")


def qnn_axis(axis: int, rank: int, consumer: str | None) -> int:
    """The channel axis of a QNN tensor: conv filters go OIHW/IOHW -> HWIO, so their axis is last."""
    if consumer in ("Conv2d", "Conv3d", "DepthWiseConv2d", "TransposeConv2d", "TransposeConv3d"):
        return rank - 1
    return axis


# --- one tensor -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lpbq:
    """QNN BLOCKWISE_EXPANSION parameters of an LPBQ weight."""

    per_channel_scale: tuple[float, ...]
    int_scales: tuple[tuple[int, ...], ...]  # [channel][block], each in [1, 16]
    block_size: int
    block_axis: int = 1
    channel_axis: int = 0
    compressed_bw: int = 4
    scale_bitwidth: int = LPBQ_SCALE_BITS

    @property
    def num_blocks_per_axis(self) -> int:
        return len(self.int_scales[0]) if self.int_scales else 0


@dataclass(frozen=True)
class QnnEncoding:
    """One quantized tensor as QNN sees it."""

    name: str
    kind: str  # "activation" | "param"
    bw: int
    signed: bool
    symmetric: bool
    scale: tuple[float, ...]
    zero_point: tuple[int, ...]  # quantplug/ONNX convention on the tensor's own grid
    quant_min: int
    quant_max: int
    axis: int | None = None  # per-channel axis in the PyTorch/ONNX layout
    lpbq: Lpbq | None = None
    source: str = ""  # the quantplug node it came from

    @property
    def granularity(self) -> str:
        if self.lpbq is not None:
            return "lpbq"
        return "channel" if self.axis is not None else "tensor"

    @property
    def datatype(self) -> str:
        return qnn_datatype(self.bw, self.signed)

    @property
    def encoding_type(self) -> str:
        """QNN ``Qnn_QuantizationEncoding_t`` name."""
        if self.lpbq is not None:
            return "QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION"
        sub_byte = self.bw < 8
        if self.axis is not None:
            return (
                "QNN_QUANTIZATION_ENCODING_BW_AXIS_SCALE_OFFSET"
                if sub_byte
                else "QNN_QUANTIZATION_ENCODING_AXIS_SCALE_OFFSET"
            )
        return (
            "QNN_QUANTIZATION_ENCODING_BW_SCALE_OFFSET"
            if sub_byte
            else "QNN_QUANTIZATION_ENCODING_SCALE_OFFSET"
        )

    @property
    def qnn_offsets(self) -> tuple[int, ...]:
        return tuple(qnn_offset(z) for z in self.zero_point)

    @property
    def aimet_offsets(self) -> tuple[int, ...]:
        return tuple(aimet_offset(z, self.bw, self.signed) for z in self.zero_point)

    def qnn_tensor(self, *, rank: int | None = None, consumer: str | None = None) -> dict[str, Any]:
        """What a QNN tensor wrapper gets: datatype, encoding, scales/offsets (offset = -zero_point)."""
        out: dict[str, Any] = {
            "datatype": self.datatype,
            "encoding": self.encoding_type,
            "bitwidth": self.bw,
        }
        if self.lpbq is not None:
            lp = self.lpbq
            out.update(
                axis=qnn_axis(lp.channel_axis, rank or 2, consumer),
                scale_offsets=[(s, 0) for s in lp.per_channel_scale],
                num_blocks_per_axis=lp.num_blocks_per_axis,
                block_scale_bitwidth=lp.scale_bitwidth,
                block_scales=[b for row in lp.int_scales for b in row],
            )
        elif self.axis is not None:
            out.update(
                axis=qnn_axis(self.axis, rank or 1, consumer),
                scale_offsets=list(zip(self.scale, self.qnn_offsets)),
            )
        else:
            out.update(scale=self.scale[0], offset=self.qnn_offsets[0])
        return out


def lpbq_parts(scale: torch.Tensor, block_size: Sequence[int], shape: Sequence[int] | None = None) -> Lpbq:
    """Recover QNN's LPBQ form from the effective per-block scales of a converted program.

    Raises ``EncodingError`` unless the scales are exactly ``per-channel x 4-bit integer`` (what
    ``LpbqObserver`` produces) and the blocks run along dim 1 spanning every other dim except the
    output channels: QNN has no encoding for arbitrary float block scales.
    """
    block = [int(b) for b in block_size]
    if len(block) < 2 or block[0] != 1:
        raise EncodingError(f"LPBQ blocks must be (1, B, ...) along the input channels, got {tuple(block)}")
    grid = tuple(scale.shape)
    if shape is not None:
        dims = [int(d) for d in shape]
        spans = [b in (d, -1) or d == 1 for b, d in zip(block[2:], dims[2:])]
        if not all(spans):
            raise EncodingError(
                f"LPBQ blocks must span the whole kernel window: block {tuple(block)} on weight shape "
                f"{tuple(dims)} gives each kernel tap its own block scales, which QNN's BLOCKWISE_EXPANSION "
                "(num_blocks_per_axis = in_channels / block) cannot express"
            )
    per_channel, ints = lpbq_quantize_scales(scale)
    rebuilt = (ints.to(torch.float32) * per_channel.unsqueeze(-1)).reshape(grid)
    if not torch.equal(rebuilt, scale.to(torch.float32).reshape(grid)):
        worst = float(((rebuilt - scale.reshape(grid)).abs() / scale.reshape(grid).abs()).max())
        raise EncodingError(
            "per-block scales are not 4-bit multiples of a per-channel scale (relative mismatch "
            f"{worst:.3g}); QNN can only encode LPBQ blocks -- quantize them with the qnn_htp "
            "16a4w_block precision (LpbqObserver)"
        )
    return Lpbq(
        per_channel_scale=tuple(float(s) for s in per_channel),
        int_scales=tuple(tuple(int(i) for i in row) for row in ints),
        block_size=block[1],
    )


def _symmetric(kind: str, signed: bool, bw: int, zero_points: Sequence[int], act_symmetric: bool) -> bool:
    if signed:
        return all(z == 0 for z in zero_points)
    mid = 1 << (bw - 1)
    return all(z == mid for z in zero_points) and (kind == "param" or act_symmetric)


def from_entry(
    entry: Mapping[str, Any],
    *,
    name: str | None = None,
    kind: str | None = None,
    shape: Sequence[int] | None = None,
    act_symmetric: bool = False,
) -> QnnEncoding:
    """A ``quantplug.flow.inspect.encodings`` entry as a :class:`QnnEncoding`.

    ``kind`` overrides the entry's (``"param"`` for constants and initializers); ``shape`` is the
    tensor's shape (needed to check LPBQ blocks).
    """
    qmin, qmax = int(entry["quant_min"]), int(entry["quant_max"])
    bw = bitwidth(qmin, qmax)
    signed = qmin < 0
    kind = kind or ("param" if entry.get("kind") == "constant" else "activation")
    label = name or str(entry.get("tensor"))
    granularity = entry["granularity"]
    if granularity in ("dynamic", "token"):
        raise EncodingError(f"{label}: dynamic quantization has no static QNN encoding")
    if granularity == "block":
        scale = torch.tensor(entry["scale"], dtype=torch.float32)
        block_zps = torch.tensor(entry["zero_point"]).reshape(-1)
        if bool((block_zps != 0).any()):
            raise EncodingError(f"{label}: LPBQ weights must be symmetric (zero point 0)")
        try:
            lp = lpbq_parts(scale, entry["block_size"], shape)
        except EncodingError as exc:
            raise EncodingError(f"{label}: {exc}") from None
        if bw > lp.compressed_bw:
            raise EncodingError(f"{label}: LPBQ weights are 4-bit, got a {bw}-bit grid [{qmin}, {qmax}]")
        return QnnEncoding(
            name=label,
            kind=kind,
            bw=bw,
            signed=signed,
            symmetric=True,
            scale=lp.per_channel_scale,
            zero_point=(0,) * len(lp.per_channel_scale),
            quant_min=qmin,
            quant_max=qmax,
            axis=0,
            lpbq=lp,
            source=str(entry.get("node", "")),
        )
    scales = entry["scale"] if isinstance(entry["scale"], list) else [entry["scale"]]
    zps = entry["zero_point"] if isinstance(entry["zero_point"], list) else [entry["zero_point"]]
    axis = entry.get("axis") if granularity == "channel" else None
    if axis is None and bw < 3 and signed:
        raise EncodingError(
            f"{label}: 2-bit quantization is per-channel only on HTP (no per-tensor 2-bit encoding); "
            "quantize this weight per channel"
        )
    if kind == "activation" and bw > 16:
        raise EncodingError(f"{label}: {bw}-bit activations cannot run on HTP (8 or 16 bits)")
    return QnnEncoding(
        name=label,
        kind=kind,
        bw=bw,
        signed=signed,
        symmetric=_symmetric(kind, signed, bw, zps, act_symmetric),
        scale=tuple(float(s) for s in scales),
        zero_point=tuple(int(z) for z in zps),
        quant_min=qmin,
        quant_max=qmax,
        axis=None if axis is None else int(axis),
        source=str(entry.get("node", "")),
    )


# --- AIMET JSON -----------------------------------------------------------------------------------


def _bool_str(value: bool) -> str:
    return "True" if value else "False"


def _entry_0_6_1(e: QnnEncoding) -> list[dict[str, Any]]:
    if e.lpbq is not None:
        raise EncodingError(
            f"{e.name}: LPBQ (block) encodings need encodings_version 1.0.0 or 2.0.0; 0.6.1 only has "
            "per-tensor and per-channel entries"
        )
    items = []
    for s, off in zip(e.scale, e.aimet_offsets):
        items.append(
            {
                "bitwidth": e.bw,
                "dtype": "int",
                "is_symmetric": _bool_str(e.symmetric),
                "min": off * s,
                "max": ((1 << e.bw) - 1 + off) * s,
                "scale": s,
                "offset": off,
            }
        )
    return items


def _entry_1_0_0(e: QnnEncoding) -> dict[str, Any]:
    if e.lpbq is not None:
        lp = e.lpbq
        decompressed = 2 * lp.compressed_bw
        return {
            "name": e.name,
            "dtype": "INT",
            "enc_type": "LPBQ",
            "bw": decompressed,
            "compressed_bw": lp.compressed_bw,
            "is_sym": True,
            "block_size": lp.block_size,
            "scale": list(lp.per_channel_scale),
            "offset": [-(1 << (decompressed - 1))] * len(lp.per_channel_scale),
            "per_block_int_scale": [b for row in lp.int_scales for b in row],
        }
    return {
        "name": e.name,
        "dtype": "INT",
        "enc_type": "PER_CHANNEL" if e.axis is not None else "PER_TENSOR",
        "bw": e.bw,
        "is_sym": e.symmetric,
        "scale": list(e.scale),
        "offset": list(e.aimet_offsets),
    }


def _entry_2_0_0(e: QnnEncoding) -> dict[str, Any]:
    if e.lpbq is not None:
        lp = e.lpbq
        return {
            "name": e.name,
            "output_dtype": onnx_dtype_name(lp.compressed_bw, True),
            "axis": lp.block_axis,
            "block_size": lp.block_size,
            "per_channel_float_scale": [[s] for s in lp.per_channel_scale],
            "per_block_int_scale": [list(row) for row in lp.int_scales],
        }
    out: dict[str, Any] = {"name": e.name, "output_dtype": onnx_dtype_name(e.bw, e.signed)}
    if e.axis is not None:
        out["y_scale"] = list(e.scale)
        out["axis"] = e.axis
        if any(e.zero_point):
            out["y_zero_point"] = list(e.zero_point)
    else:
        out["y_scale"] = e.scale[0]
        if e.zero_point[0]:
            out["y_zero_point"] = e.zero_point[0]
    return out


@dataclass
class QuantizerArgs:
    """The informational ``quantizer_args`` block of 0.6.1 / 1.0.0 files."""

    activation_bitwidth: int
    param_bitwidth: int
    is_symmetric: bool = False
    per_channel_quantization: bool = True
    quant_scheme: str = "post_training_tf"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self, version: str) -> dict[str, Any]:
        as_text = version == "0.6.1"
        return {
            "activation_bitwidth": self.activation_bitwidth,
            "dtype": "int",
            "is_symmetric": _bool_str(self.is_symmetric) if as_text else self.is_symmetric,
            "param_bitwidth": self.param_bitwidth,
            "per_channel_quantization": _bool_str(self.per_channel_quantization)
            if as_text
            else self.per_channel_quantization,
            "quant_scheme": self.quant_scheme,
        }


def to_aimet(
    encodings: Iterable[QnnEncoding],
    version: str = DEFAULT_VERSION,
    *,
    quantizer_args: QuantizerArgs | None = None,
) -> dict[str, Any]:
    """The AIMET encodings document (``version`` 0.6.1, 1.0.0 or 2.0.0) for these tensors."""
    if version not in VERSIONS:
        raise EncodingError(f"encodings version {version!r}; valid values: {', '.join(VERSIONS)}")
    items = list(encodings)
    if version == "2.0.0":
        return {"version": "2.0.0", "encodings": [_entry_2_0_0(e) for e in items]}
    acts = [e for e in items if e.kind == "activation"]
    params = [e for e in items if e.kind == "param"]
    doc: dict[str, Any] = {"version": version}
    if version == "0.6.1":
        doc["activation_encodings"] = {e.name: _entry_0_6_1(e) for e in acts}
        doc["param_encodings"] = {e.name: _entry_0_6_1(e) for e in params}
    else:
        doc["activation_encodings"] = [_entry_1_0_0(e) for e in acts]
        doc["param_encodings"] = [_entry_1_0_0(e) for e in params]
        doc["excluded_layers"] = []
    if quantizer_args is not None:
        doc["quantizer_args"] = quantizer_args.as_json(version)
    return doc


def dumps(document: Mapping[str, Any]) -> str:
    """The encodings document as JSON text whose size is what it says.

    One tensor per line, each written without spaces (``json.dumps(indent=2)`` puts every number
    of every list on a line of its own: an LPBQ weight's block scales, one small integer each,
    took 12 bytes apiece that way, 3 this way). Top-level keys and the lists' brackets keep a
    line each, so the file still reads (and diffs) tensor by tensor. The JSON values are those
    of ``document`` exactly (strict JSON: no NaN or infinity).
    """

    def compact(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)

    def rows(items: list[str], indent: str) -> list[str]:
        return [f"{indent}{item}{',' if i < len(items) - 1 else ''}" for i, item in enumerate(items)]

    keys = list(document)
    lines = ["{"]
    for i, key in enumerate(keys):
        value, end = document[key], "," if i < len(keys) - 1 else ""
        if isinstance(value, list) and value:
            lines += [f"  {compact(key)}: [", *rows([compact(v) for v in value], "    "), f"  ]{end}"]
        elif isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            named = [f"{compact(name)}: {compact(v)}" for name, v in value.items()]  # 0.6.1's dicts
            lines += [f"  {compact(key)}: {{", *rows(named, "    "), f"  }}{end}"]
        else:
            lines.append(f"  {compact(key)}: {compact(value)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


@cache
def schema(version: str) -> dict[str, Any]:
    """The JSON schema (draft 7) of an encodings file version, shipped with this package."""
    if version not in VERSIONS:
        raise EncodingError(f"encodings version {version!r}; valid values: {', '.join(VERSIONS)}")
    text = (
        resources.files("quantplug_qnn_htp")
        .joinpath("schemas", f"encodings_{version}.schema.json")
        .read_text()
    )
    return json.loads(text)  # type: ignore[no-any-return]


__all__ = [
    "DEFAULT_VERSION",
    "ENCODINGS_FILE",
    "LPBQ_SCALE_STEPS",
    "MODEL_FILE",
    "VERSIONS",
    "EncodingError",
    "Lpbq",
    "QnnEncoding",
    "QuantizerArgs",
    "aimet_offset",
    "bitwidth",
    "dumps",
    "from_entry",
    "lpbq_parts",
    "onnx_dtype_name",
    "qnn_axis",
    "qnn_datatype",
    "qnn_offset",
    "schema",
    "to_aimet",
]
