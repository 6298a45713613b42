"""Op constraints from the QNN SDK's ``BackendOpInfo`` (SDK 2.41+), with the built-in table as fallback.

ExecuTorch's ``quantizer/backend_opinfo_adapter.py`` (anchor section 3.5) imports
``qti.aisw.converters.common.backend_opinfo`` from ``$QNN_SDK_ROOT/lib/python`` and normalizes each
op's variants (one ``OpInfo`` per supported datatype combination) into per-port constraints. This
module does the same and turns the variants into quantplug ``OpConstraint``s, so validation reads
the SDK's own table when an SDK is present and the built-in table (``constraints.py``) otherwise.
Architecture gates (LPBQ V69+, 16x16 V73+) are added in both cases.

The SDK API used (duck-typed, as ExecuTorch uses it)::

    backend_opinfo.HTP                                   # backend type
    backend_opinfo.BackendOpInfo(backend_type, soc_id)   # soc_id: ExecuTorch's QcomChipset value
        .get_all_supported_ops() -> [str]
        .get_op_info(op) -> [OpInfo]                     # one per datatype variant
    OpInfo.get_input_info() / .get_output_info() -> [DatatypeInfo]   # one per port
    DatatypeInfo.get_datatype() -> Qnn_DataType_t (enum member, its name, or its int value)
    DatatypeInfo.get_quant_constraint_info() -> [QuantConstraintInfo]
    DatatypeInfo.is_applicable_from_current_dtype_onward() -> bool    # variadic ports
    QuantConstraintInfo.get_encoding_types() -> [Qnn_QuantizationEncoding_t]
        .is_symmetric() .get_axis() .is_math_invariant() .get_scale() .get_offset()

Several variants collapse into one ``OpConstraint`` per op (the core checks every constraint it
gets, so variants cannot be alternatives): a port accepts the union of the variants' datatypes;
a port must be symmetric / per-tensor / math-invariant only if every quantized variant of that
port says so; a fixed encoding applies to the datatype that declares it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantplug.backend import INT2, INT4, OUTPUT, UINT4, OpConstraint, Port, PortConstraint
from quantplug_qnn_htp import constraints as builtin

logger = logging.getLogger("quantplug.qnn_htp")

MODULE = "qti.aisw.converters.common.backend_opinfo"
SOURCE_SDK = "QNN SDK BackendOpInfo"
SOURCES = ("auto", "builtin", "sdk")

#: Qnn_DataType_t values (QnnTypes.h; formats doc section 3.4)
DATATYPE_VALUES: dict[int, str] = {
    0x0008: "QNN_DATATYPE_INT_8",
    0x0016: "QNN_DATATYPE_INT_16",
    0x0032: "QNN_DATATYPE_INT_32",
    0x0064: "QNN_DATATYPE_INT_64",
    0x0108: "QNN_DATATYPE_UINT_8",
    0x0116: "QNN_DATATYPE_UINT_16",
    0x0132: "QNN_DATATYPE_UINT_32",
    0x0164: "QNN_DATATYPE_UINT_64",
    0x0216: "QNN_DATATYPE_FLOAT_16",
    0x0232: "QNN_DATATYPE_FLOAT_32",
    0x0304: "QNN_DATATYPE_SFIXED_POINT_4",
    0x0308: "QNN_DATATYPE_SFIXED_POINT_8",
    0x0316: "QNN_DATATYPE_SFIXED_POINT_16",
    0x0332: "QNN_DATATYPE_SFIXED_POINT_32",
    0x0404: "QNN_DATATYPE_UFIXED_POINT_4",
    0x0408: "QNN_DATATYPE_UFIXED_POINT_8",
    0x0416: "QNN_DATATYPE_UFIXED_POINT_16",
    0x0432: "QNN_DATATYPE_UFIXED_POINT_32",
    0x0508: "QNN_DATATYPE_BOOL_8",
}

#: quantized QNN datatypes -> the torch grids quantplug specs use (sub-byte grids live in 8-bit
#: containers, so SFIXED_8 also admits int4/int2 weights; BW encodings say how many bits are used)
QUANT_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "QNN_DATATYPE_UFIXED_POINT_8": frozenset({torch.uint8}),
    "QNN_DATATYPE_SFIXED_POINT_8": frozenset({torch.int8, INT4, INT2}),
    "QNN_DATATYPE_UFIXED_POINT_16": frozenset({torch.uint16}),
    "QNN_DATATYPE_SFIXED_POINT_16": frozenset({torch.int16}),
    "QNN_DATATYPE_SFIXED_POINT_32": frozenset({torch.int32}),
    "QNN_DATATYPE_SFIXED_POINT_4": frozenset({INT4}),
    "QNN_DATATYPE_UFIXED_POINT_4": frozenset({UINT4}),
}
FLOAT_DTYPES = frozenset({"QNN_DATATYPE_FLOAT_16", "QNN_DATATYPE_FLOAT_32"})
PER_CHANNEL_ENCODINGS = frozenset(
    {
        "QNN_QUANTIZATION_ENCODING_AXIS_SCALE_OFFSET",
        "QNN_QUANTIZATION_ENCODING_BW_AXIS_SCALE_OFFSET",
        "QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION",
        "QNN_QUANTIZATION_ENCODING_BLOCK",
    }
)


def _name(value: Any, table: Mapping[int, str] | None = None) -> str:
    """An SDK enum member, its name or its int value -> its ``QNN_...`` name."""
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    if isinstance(value, int) and table is not None and value in table:
        return table[value]
    return str(value)


# --- normalized form (mirrors ExecuTorch's validators.NormalizedConstraints) ---------------------


@dataclass(frozen=True)
class TensorQuantConstraint:
    encoding_types: tuple[str, ...] = ()
    is_symmetric: bool = False
    axis: tuple[int, ...] | None = None
    is_math_invariant: bool = False
    scale: float | None = None
    offset: int | None = None


@dataclass(frozen=True)
class PortDatatypeConstraints:
    dtype: str
    constraints: tuple[TensorQuantConstraint, ...] = ()
    applicable_from_current_dtype_onward: bool = False


@dataclass(frozen=True)
class NormalizedConstraints:
    inputs: tuple[PortDatatypeConstraints, ...] = ()
    outputs: tuple[PortDatatypeConstraints, ...] = ()


def _normalize_port(info: Any) -> PortDatatypeConstraints:
    qcs = []
    for qc in info.get_quant_constraint_info() or ():
        axis = qc.get_axis()
        qcs.append(
            TensorQuantConstraint(
                encoding_types=tuple(_name(e) for e in (qc.get_encoding_types() or ())),
                is_symmetric=bool(qc.is_symmetric()),
                axis=None if axis is None else tuple(int(a) for a in axis),
                is_math_invariant=bool(qc.is_math_invariant()),
                scale=None if qc.get_scale() is None else float(qc.get_scale()),
                offset=None if qc.get_offset() is None else int(qc.get_offset()),
            )
        )
    onward = getattr(info, "is_applicable_from_current_dtype_onward", None)
    return PortDatatypeConstraints(
        dtype=_name(info.get_datatype(), DATATYPE_VALUES),
        constraints=tuple(qcs),
        applicable_from_current_dtype_onward=bool(onward()) if callable(onward) else False,
    )


def normalize(op_infos: Sequence[Any]) -> list[NormalizedConstraints]:
    """``BackendOpInfo.get_op_info(op)`` -> one ``NormalizedConstraints`` per variant."""
    return [
        NormalizedConstraints(
            inputs=tuple(_normalize_port(i) for i in op_info.get_input_info()),
            outputs=tuple(_normalize_port(o) for o in op_info.get_output_info()),
        )
        for op_info in op_infos
    ]


# --- variants -> one OpConstraint ------------------------------------------------------------------


@dataclass
class _PortAcc:
    dtypes: set[torch.dtype | None] = field(default_factory=set)
    quantized_variants: int = 0
    symmetric_votes: int = 0
    per_tensor_votes: int = 0
    math_invariant_votes: int = 0
    fixed: dict[str, tuple[float, int]] = field(default_factory=dict)


def _bits_signed(qmin: int, qmax: int) -> tuple[int, bool]:
    return int(qmax - qmin).bit_length(), qmin < 0


_FIXED_KEYS = {
    (8, False): "QNN_DATATYPE_UFIXED_POINT_8",
    (8, True): "QNN_DATATYPE_SFIXED_POINT_8",
    (16, False): "QNN_DATATYPE_UFIXED_POINT_16",
    (16, True): "QNN_DATATYPE_SFIXED_POINT_16",
}


def _fixed_fn(table: Mapping[str, tuple[float, int]]) -> Any:
    def fixed(qmin: int, qmax: int) -> tuple[float, int]:
        key = _FIXED_KEYS.get(_bits_signed(qmin, qmax))
        found = table.get(key) if key is not None else None
        if found is None:  # a datatype without a fixed encoding: any fixed spec passes
            raise LookupError(key)
        return found

    return fixed


def to_op_constraint(op: str, variants: Sequence[NormalizedConstraints]) -> OpConstraint | None:
    """Collapse an op's datatype variants into one ``OpConstraint`` (see the module docstring)."""
    ports: dict[Port, _PortAcc] = {}

    def visit(port: Port, pdc: PortDatatypeConstraints) -> None:
        acc = ports.setdefault(port, _PortAcc())
        quant = QUANT_DTYPES.get(pdc.dtype)
        if quant is None:  # float / int / bool: that variant leaves the port unquantized
            acc.dtypes.add(None)
            return
        acc.dtypes.update(quant)
        acc.quantized_variants += 1
        cs = pdc.constraints
        if cs and all(c.is_symmetric for c in cs):
            acc.symmetric_votes += 1
        if cs and not any(set(c.encoding_types) & PER_CHANNEL_ENCODINGS for c in cs):
            acc.per_tensor_votes += 1
        if cs and any(c.is_math_invariant for c in cs):
            acc.math_invariant_votes += 1
        for c in cs:
            if c.scale is not None and c.offset is not None:
                acc.fixed[pdc.dtype] = (c.scale, -c.offset)  # QNN offset = -zero_point

    for v in variants:
        for i, p in enumerate(v.inputs):
            visit(i, p)
        for j, p in enumerate(v.outputs[:1]):  # multi-output ops: first output, as ExecuTorch
            visit(OUTPUT if j == 0 else j, p)
    if not ports:
        return None
    result: dict[Port, PortConstraint] = {}
    must_share = False
    for port, acc in ports.items():
        n = acc.quantized_variants
        fixed_fn = _fixed_fn(dict(acc.fixed)) if acc.fixed else None
        result[port] = PortConstraint(
            dtypes=frozenset(d for d in acc.dtypes if d is not None),
            symmetric=True if n and acc.symmetric_votes == n else None,
            per_tensor_only=bool(n) and acc.per_tensor_votes == n,
            fixed_scale_fn=_tolerant(fixed_fn) if fixed_fn is not None else None,
            description=f"{SOURCE_SDK}: {', '.join(sorted(d for d in _sdk_names(acc)))}",
        )
        if port == OUTPUT and n and acc.math_invariant_votes == n:
            must_share = True
    arch = tuple(builtin.arch_requirements(op))
    return OpConstraint(op, ports=result, must_share_input_output=must_share, arch=arch, source=SOURCE_SDK)


def _sdk_names(acc: _PortAcc) -> set[str]:
    names = set()
    for name, dtypes in QUANT_DTYPES.items():
        if dtypes & acc.dtypes:
            names.add(name.removeprefix("QNN_DATATYPE_"))
    if None in acc.dtypes:
        names.add("unquantized")
    return names


def _tolerant(fn: Any) -> Any:
    """A fixed-encoding check that only applies to the datatypes declaring one (None: unchecked)."""

    def check(qmin: int, qmax: int) -> tuple[float, int] | None:
        try:
            return fn(qmin, qmax)
        except LookupError:
            return None

    return check


# --- loading the SDK module ----------------------------------------------------------------------


@dataclass
class SdkOpInfo:
    """A loaded ``BackendOpInfo`` for one SoC, with per-op results cached."""

    root: str
    module: Any
    opinfo: Any
    supported: frozenset[str]
    cache: dict[str, OpConstraint | None] = field(default_factory=dict)

    def constraint(self, backend_op: str) -> OpConstraint | None:
        if backend_op not in self.cache:
            if backend_op not in self.supported:
                self.cache[backend_op] = None
            else:
                self.cache[backend_op] = to_op_constraint(
                    backend_op, normalize(self.opinfo.get_op_info(backend_op))
                )
        return self.cache[backend_op]


def sdk_python_dir(root: str | os.PathLike[str] | None) -> Path | None:
    """``$QNN_SDK_ROOT/lib/python`` if it holds the BackendOpInfo module, else None."""
    if not root:
        return None
    py = Path(root) / "lib" / "python"
    rel = Path(*MODULE.split("."))
    if (py / rel).with_suffix(".py").is_file() or any(py.glob(str(rel) + ".*")) or (py / rel).is_dir():
        return py
    return None


def _import_from(py: Path) -> Any:
    """Import the SDK module from ``py``, dropping a ``qti`` package loaded from another SDK."""
    top = MODULE.split(".")[0]
    loaded = sys.modules.get(top)
    loaded_from = getattr(loaded, "__path__", None)
    if loaded is not None and not any(str(p).startswith(str(py)) for p in (loaded_from or [])):
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
    if str(py) not in sys.path:
        sys.path.insert(0, str(py))
    importlib.invalidate_caches()
    return importlib.import_module(MODULE)


def load_sdk(root: str | os.PathLike[str] | None, soc_id: int) -> SdkOpInfo | None:
    """The SDK's BackendOpInfo for an SoC, or None (no SDK, no BackendOpInfo, or it fails to load)."""
    py = sdk_python_dir(root)
    if py is None:
        return None
    try:
        module = _import_from(py)
        backend_type = getattr(module, "HTP", "htp")
        opinfo = module.BackendOpInfo(backend_type, soc_id)
        supported = frozenset(str(o) for o in opinfo.get_all_supported_ops())
    except Exception as exc:  # an SDK without this API, or a broken install: use the table
        logger.warning(
            "QNN SDK at %s: BackendOpInfo could not be loaded (%s: %s); using the built-in HTP "
            "constraint table",
            root,
            type(exc).__name__,
            exc,
        )
        return None
    return SdkOpInfo(str(root), module, opinfo, supported)


def select(source: str, soc_id: int, *, environ: Mapping[str, str] | None = None) -> SdkOpInfo | None:
    """Which constraints to use: the SDK's (returned) or the built-in table (None).

    ``source``: ``"auto"`` uses the SDK under ``QNN_SDK_ROOT`` when it has BackendOpInfo;
    ``"builtin"`` never does; ``"sdk"`` requires it (``OptionError`` otherwise).
    """
    from quantplug.backend import OptionError

    if source not in SOURCES:
        raise OptionError(f"constraints_source {source!r}; valid values: {', '.join(SOURCES)}")
    if source == "builtin":
        return None
    env = os.environ if environ is None else environ
    root = env.get("QNN_SDK_ROOT")
    found = load_sdk(root, soc_id)
    if found is None and source == "sdk":
        raise OptionError(
            f"constraints_source='sdk' needs a QNN SDK 2.41+ with {MODULE} under $QNN_SDK_ROOT/lib/python "
            f"(QNN_SDK_ROOT={root!r})"
        )
    return found
