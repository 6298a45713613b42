"""Can an integer product that ONNX Runtime runs overflow on some CPU?

ORT's CPU kernels (MLAS) multiply 8-bit integers along a few accumulation paths, chosen at run
time from the CPU's instruction set. Most accumulate in int32 and are exact, but two add pairs
of products in 16 bits first:

* x86-64 AVX2 and AVX-512BW without VNNI: ``VPMADDUBSW`` multiplies unsigned bytes (the
  activations) by signed bytes (the weights) and adds adjacent pairs into an int16 *with
  saturation* (``qgemm_kernel_avx2.cpp``, ``QgemmU8X8KernelAvx2.S``,
  ``QgemmU8S8KernelAvx512Core.S``, ``ConvSymKernelAvx2.S``); 2 x 255 x 127 = 64770 does not fit
  in 32767, so wide layers with large weights lose up to ~15 quantization steps there;
* ARM64 NEON without the dot-product extension (ARMv8.0): ``SMULL`` + ``SMLAL`` add two signed
  byte products into an int16 lane, wrapping, before ``SADALP`` widens them
  (``QgemmS8S8KernelNeon.S``, ``DepthwiseQConvSymU8KernelNeon.S``); unsigned activations are
  first moved to the signed range (``XOR 0x80``).

The others: U8U8 kernels widen both operands to 16 bits (``VPMADDWD`` on x86, ``UMULL``/
``UMLAL`` on ARM), depthwise convolutions widen to 32 bits on x86 (``ConvSymKernelAvx2.S``
``DepthwiseMultiplyAccumulateCell``), AVX-VNNI / AVX-512 VNNI (``VPDPBUSD[S]``), AMX
(``TDPBUSD``) and ARM's ``UDOT``/``SDOT``/``UMMLA``/``SMMLA`` accumulate in int32. Which kernel
runs is chosen by operand signedness (``MlasGemmQuantGetDispatch`` in ``qgemm.h``, the CPU
checks in ``platform.cpp``); on x86 ORT first turns int8 activations into uint8
(``QDQS8ToU8Transformer``, ``QDQIsInt8Allowed``).

This module is that model, as pure functions (``ACCUMULATION_PATHS``, ``check_product``), and a
walk over the graph ORT actually runs (``integer_products``: the model it writes with
``SessionOptions.optimized_model_filepath``), reading the real integer weights. A product is
safe on a path when no two of its products can leave the path's 16-bit lane and no sum can leave
int32; the bounds are packing-order independent (the two largest products of a column, whatever
MLAS pairs). ``verify_model`` runs a plain session (no option a user would have to repeat) and
checks every product on every path.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INT16_MIN, INT16_MAX = -(2**15), 2**15 - 1
INT32_MAX = 2**31 - 1
UINT8 = (0, 255)
INT8 = (-128, 127)
#: largest |weight| whose pair products with any uint8 activation fit VPMADDUBSW's int16
SATURATION_FREE_WEIGHT_MAX = INT16_MAX // (2 * UINT8[1])  # 64

ORT_SOURCES = "microsoft/onnxruntime onnxruntime/core/mlas/lib"


# --------------------------------------------------------------------------- the products


@dataclass(frozen=True)
class Operand:
    """One side of an integer product as a kernel receives it.

    ``values`` holds a constant operand as ``[K, N]`` integers (reduction first, one column per
    output channel); ``None`` means an activation, which may take any value of its dtype.
    """

    dtype: str  # "uint8" or "int8"
    values: np.ndarray | None = None
    #: largest |zero point| (any of the dtype for an activation)
    zero_point: int | None = None

    @property
    def zero_point_abs(self) -> int:
        return max(abs(v) for v in self.range) if self.zero_point is None else abs(self.zero_point)

    @property
    def range(self) -> tuple[int, int]:
        return UINT8 if self.dtype == "uint8" else INT8

    @property
    def signed(self) -> bool:
        return self.dtype == "int8"


@dataclass(frozen=True)
class IntegerProduct:
    """A reduction of ``a x b`` products: a fused integer kernel of ORT's optimized graph."""

    node: str
    op_type: str
    a: Operand  # the activation side (always an activation)
    b: Operand  # the weight side (a constant, or a second activation for QLinearMatMul)
    k: int  # products summed per output
    depthwise: bool = False


@dataclass(frozen=True)
class AccumulationPath:
    """How a family of CPUs accumulates one kind of product."""

    name: str
    cpus: str
    sources: str
    applies: Callable[[IntegerProduct], bool]
    #: the operands as the instructions see them: ARM moves unsigned bytes to the signed range
    signed_operands: bool = False
    #: 16-bit lane holding two products before widening (None: int32 throughout)
    pair_lane: str | None = None


def _u8s8(p: IntegerProduct) -> bool:
    return not p.a.signed and p.b.signed and not p.depthwise


def _u8u8(p: IntegerProduct) -> bool:
    return not p.a.signed and not p.b.signed


ACCUMULATION_PATHS: tuple[AccumulationPath, ...] = (
    AccumulationPath(
        "VPMADDUBSW (U8S8, pairs in a saturating int16)",
        "x86-64 AVX2, AVX-512BW/AVX-512 Core without VNNI",
        "qgemm_kernel_avx2.cpp, x86_64/QgemmU8X8KernelAvx2.S (MultiplyAccumulateRowU8S8Avx2), "
        "QgemmU8S8KernelAvx512Core.S, QgemvU8S8KernelAvx2.S, ConvSymKernelAvx2.S (MultiplyAccumulateRowAvx2)",
        _u8s8,
        pair_lane="saturating",
    ),
    AccumulationPath(
        "VPDPBUSD/VPDPBUSDS (U8S8, int32)",
        "x86-64 AVX-VNNI, AVX-512 VNNI",
        "QgemmU8X8KernelAvx2.S (MultiplyAccumulateRowU8S8AvxVnni), QgemmU8S8KernelAvx512Vnni.S, "
        "ConvSymKernelAvx2.S (AvxVnni)",
        _u8s8,
    ),
    AccumulationPath("TDPBUSD (U8S8, int32)", "x86-64 AMX-INT8", "qgemm_kernel_amx.cpp", _u8s8),
    AccumulationPath(
        "VPMADDWD on zero-extended bytes (U8U8, int32)",
        "x86-64 AVX2, AVX-512 (and AVX-VNNI-INT8)",
        "x86_64/QgemmU8X8KernelAvx2.S (MultiplyAccumulateRowU8U8Avx2), QgemmU8U8KernelAvx512Core.S",
        _u8u8,
    ),
    AccumulationPath(
        "depthwise: bytes widened to int32, VPMADDWD (int32)",
        "x86-64 AVX2, AVX-512, AVX-VNNI",
        "ConvSymKernelAvx2.S (DepthwiseMultiplyAccumulateCellAvx2), qdwconv_kernelsize.cpp",
        lambda p: p.depthwise and not p.a.signed,
    ),
    AccumulationPath(
        "signed activations: MLAS generic kernels (int32)",
        "x86-64 (int8 x int8 / int8 x uint8 without AVX-VNNI-INT8)",
        "qgemm.h (MlasGemmQuantGetDispatch), platform.cpp",
        lambda p: p.a.signed,
    ),
    AccumulationPath(
        "SMULL + SMLAL (pairs in a wrapping int16, then SADALP)",
        "ARM64 NEON without dot product (ARMv8.0)",
        "aarch64/QgemmS8S8KernelNeon.S, ConvSymU8KernelNeon.S, DepthwiseQConvSymU8KernelNeon.S "
        "(activations XOR 0x80)",
        lambda p: p.b.signed,
        signed_operands=True,
        pair_lane="wrapping",
    ),
    AccumulationPath(
        "UMULL/UMLAL on widened bytes (U8U8, int32)",
        "ARM64 NEON without dot product (ARMv8.0)",
        "aarch64/QgemmU8X8KernelNeon.S",
        lambda p: not p.b.signed,
    ),
    AccumulationPath(
        "UDOT/SDOT, UMMLA/SMMLA (int32)",
        "ARM64 with the dot-product or I8MM extension (ARMv8.2+)",
        "aarch64/QgemmU8X8KernelUdot.S, QgemmS8S8KernelSdot.S, QgemmU8X8KernelUmmla.S",
        lambda p: not p.depthwise,
    ),
)


def _as_seen(operand: Operand, signed: bool) -> tuple[tuple[int, int], np.ndarray | None]:
    """An operand's value range and values as the instructions see them."""
    lo, hi = operand.range
    values = None if operand.values is None else operand.values.astype(np.int64)
    if signed and not operand.signed:  # XOR 0x80: u8 -> s8, same as subtracting 128
        lo, hi = lo - 128, hi - 128
        values = None if values is None else values - 128
    return (lo, hi), values


def pair_extremes(a_range: tuple[int, int], b: Operand, signed: bool = False) -> tuple[int, int]:
    """(largest, smallest) sum of two products of one reduction, whatever the activations.

    For a constant side the two products come from the two most extreme weights of a column (the
    bound holds for any pairing of the reduction); an activation side may repeat its extremes.
    """
    (b_lo, b_hi), values = _as_seen(b, signed)
    a_lo, a_hi = a_range
    if values is None:
        ends = np.array([b_lo, b_hi], dtype=np.int64)
        top = np.maximum(a_lo * ends, a_hi * ends).max()
        bottom = np.minimum(a_lo * ends, a_hi * ends).min()
        return int(2 * top), int(2 * bottom)
    high = np.maximum(a_lo * values, a_hi * values)  # [K, N]: each product's largest value
    low = np.minimum(a_lo * values, a_hi * values)
    if values.shape[0] < 2:
        return int(high.max(initial=0)), int(low.min(initial=0))
    top2 = np.sort(high, axis=0)[-2:].sum(axis=0)
    bottom2 = np.sort(low, axis=0)[:2].sum(axis=0)
    return int(top2.max()), int(bottom2.min())


def accumulation_bound(p: IntegerProduct) -> int:
    """A bound on |any partial sum| of the int32 accumulator: MLAS starts it at the zero-point
    corrections (``-z_a x column sum of B - z_b x row sum of A + K z_a z_b``) and adds the raw
    products; VNNI's ``VPDPBUSDS`` saturates, so every partial sum must fit, not only the last."""
    a_abs = max(abs(v) for v in p.a.range)
    if p.b.values is None:
        column = p.k * max(abs(v) for v in p.b.range)
    else:
        column = int(np.abs(p.b.values.astype(np.int64)).sum(axis=0).max(initial=0))
    za, zb = p.a.zero_point_abs, p.b.zero_point_abs
    return a_abs * column + za * column + zb * p.k * a_abs + p.k * za * zb


def check_product(p: IntegerProduct, path: AccumulationPath) -> str | None:
    """Why two products of ``p`` can leave ``path``'s 16-bit lane, or None when they cannot (or
    the path does not run ``p``). The int32 accumulator is ``check_int32``'s."""
    if not path.applies(p):
        return None
    if path.pair_lane is not None:
        a_range, _ = _as_seen(p.a, path.signed_operands)
        high, low = pair_extremes(a_range, p.b, path.signed_operands)
        if high > INT16_MAX or low < INT16_MIN:
            kind = "saturates" if path.pair_lane == "saturating" else "wraps"
            worst = high if high > INT16_MAX else low
            return (
                f"two products can sum to {worst}, outside int16 [{INT16_MIN}, {INT16_MAX}]: the pair "
                f"{kind} ({'weights' if p.b.values is not None else 'activations'} up to "
                f"{_extent(p.b)} against {p.a.dtype} activations)"
            )
    return None


def check_int32(p: IntegerProduct) -> str | None:
    """Why ``p``'s int32 accumulator can overflow (every path accumulates in int32), or None."""
    bound = accumulation_bound(p)
    if bound > INT32_MAX:
        return f"a reduction of {p.k} products can reach {bound}, past int32"
    return None


def _extent(b: Operand) -> str:
    if b.values is None:
        return f"{b.range[0]}..{b.range[1]}"
    values = b.values.astype(np.int64)
    return f"{int(values.min())}..{int(values.max())}"


# --------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Finding:
    """One way a node of ORT's optimized graph can differ from the Q/DQ program."""

    node: str
    op_type: str
    path: str  # an accumulation path, or "numerics" / "model"
    cpus: str
    message: str

    def format(self) -> str:
        return f"{self.node} [{self.op_type}] on {self.cpus} ({self.path}): {self.message}"


@dataclass
class AccumulationReport:
    """Every integer kernel of ORT's optimized graph, checked on every accumulation path."""

    products: list[IntegerProduct] = field(default_factory=list)
    kernels: dict[str, int] = field(default_factory=dict)  # op type -> count (integer kernels)
    violations: list[Finding] = field(default_factory=list)  # proven differences
    unverified: list[Finding] = field(default_factory=list)  # integer ops this model does not know

    @property
    def exact(self) -> bool:
        return not self.violations and not self.unverified

    def summary(self) -> dict[str, Any]:
        return {
            "exact_on_every_cpu": self.exact,
            "integer_kernels": dict(sorted(self.kernels.items())),
            "products_checked": len(self.products),
            "paths": [f"{p.name} on {p.cpus}" for p in ACCUMULATION_PATHS],
            "violations": [f.format() for f in self.violations],
            "unverified": [f.format() for f in self.unverified],
        }


#: integer ops without a reduction of products: element-wise requantization, lookups, pooling
#: sums (at most a window of 8-bit values), data movement
NO_PRODUCT_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "QLinearAdd",
        "QLinearMul",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearSoftmax",
        "QLinearConcat",
        "QLinearAveragePool",
        "QLinearGlobalAveragePool",
        "QLinearReduceMean",
        "QLinearWhere",
        "QuickGelu",
        "Cast",
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Slice",
        "Gather",
        "GatherElements",
        "GatherND",
        "Concat",
        "Split",
        "MaxPool",
        "NhwcMaxPool",
        "Identity",
        "Expand",
        "Pad",
        "Resize",
        "Upsample",
        "DepthToSpace",
        "SpaceToDepth",
        "Tile",
        "Shape",
        "Size",
        "Clip",
        "Max",
        "Min",
        "ReduceMax",
        "ReduceMin",
        "Where",
        "Equal",
        "Greater",
        "Less",
        "Add",
        "Sub",
        "Mul",
    }
)
_ONNX_INT_TYPES = {
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    21: "uint4",
    22: "int4",
}


#: integer op -> index of the input holding its output's zero point (whose type the output has)
_OUTPUT_ZERO_POINT = {
    "QuantizeLinear": 2,
    "QLinearConv": 7,
    "QLinearMatMul": 7,
    "QGemm": 8,
    "QLinearAdd": 7,
    "QLinearMul": 7,
    "QLinearSoftmax": 4,
    "QLinearSigmoid": 4,
    "QLinearLeakyRelu": 4,
    "QLinearAveragePool": 4,
    "QLinearGlobalAveragePool": 4,
    "QLinearReduceMean": 4,
    "QLinearConcat": 1,
}


class _Types:
    """Element types of the optimized graph's tensors: declared ones, then by inference."""

    def __init__(self, graph: Any) -> None:
        self.types: dict[str, int] = {}
        for v in [*graph.input, *graph.value_info, *graph.output]:
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                self.types[v.name] = int(v.type.tensor_type.elem_type)
        for t in graph.initializer:
            self.types[t.name] = int(t.data_type)
        for node in graph.node:  # topological: inputs are typed before their readers
            self._infer(node)

    def _infer(self, node: Any) -> None:
        if not node.output or node.output[0] in self.types:
            return
        attrs = _node_attrs(node)
        zp_index = _OUTPUT_ZERO_POINT.get(node.op_type)
        if node.op_type == "QuantizeLinear" and attrs.get("output_dtype"):
            self.types[node.output[0]] = int(attrs["output_dtype"])
        elif zp_index is not None and len(node.input) > zp_index and node.input[zp_index] in self.types:
            self.types[node.output[0]] = self.types[node.input[zp_index]]
        elif node.op_type == "DynamicQuantizeLinear":
            self.types[node.output[0]] = 2
        elif node.op_type == "Cast" and "to" in attrs:
            self.types[node.output[0]] = int(attrs["to"])
        elif (
            node.input and node.input[0] in self.types and node.op_type in NO_PRODUCT_OPS - {"Shape", "Size"}
        ):
            for out in node.output:
                self.types.setdefault(out, self.types[node.input[0]])

    def name(self, tensor: str) -> str | None:
        code = self.types.get(tensor)
        return None if code is None else _ONNX_INT_TYPES.get(code, "float")


def _columns(values: np.ndarray, reduction_axis: int) -> np.ndarray:
    """``values`` as ``[K, columns]``: the reduction axis first, every other axis a column."""
    moved = np.moveaxis(values, reduction_axis, 0)
    return moved.reshape(moved.shape[0], -1)


#: op type -> (A input, B input, how B reduces): "conv" (W[M, C/g, k...]: all but axis 0),
#: "rows" (B[K, N], axis -2), "gemm" (QGemm: transB attribute)
_PRODUCT_INPUTS = {
    "QLinearConv": (0, 3, "conv"),
    "ConvInteger": (0, 1, "conv"),
    "QLinearMatMul": (0, 3, "rows"),
    "MatMulInteger": (0, 1, "rows"),
    "MatMulIntegerToFloat": (0, 1, "rows"),
    "DynamicQuantizeMatMul": (0, 1, "rows"),
    "QGemm": (0, 3, "gemm"),
    "QAttention": (0, 1, "rows"),
}
#: op type -> index of B's zero point
_B_ZERO_POINT = {
    "QLinearConv": 5,
    "ConvInteger": 3,
    "QLinearMatMul": 5,
    "MatMulInteger": 3,
    "MatMulIntegerToFloat": 5,
    "DynamicQuantizeMatMul": 3,
    "QGemm": 5,
    "QAttention": 7,
}
#: ops whose A input is float, quantized to uint8 inside the kernel
_QUANTIZES_A = frozenset({"DynamicQuantizeMatMul"})


def integer_products(model: Any) -> AccumulationReport:
    """Every integer kernel of an ONNX model (ORT's optimized graph), checked on every path."""
    types = _Types(model.graph)
    inits = {t.name: t for t in model.graph.initializer}
    report = AccumulationReport()
    for node in model.graph.node:
        label = node.name or node.output[0]
        if node.op_type == "MatMulNBits" or node.op_type in _PRODUCT_INPUTS:
            report.kernels[node.op_type] = report.kernels.get(node.op_type, 0) + 1
        if node.op_type == "MatMulNBits":
            level = int(_node_attrs(node).get("accuracy_level", 0))
            if level != 1:
                message = (
                    f"accuracy_level {level} computes in reduced precision (4: activations quantized "
                    "to int8 on the fly); the Q/DQ program multiplies in float (level 1)"
                )
                report.violations.append(Finding(label, node.op_type, "numerics", "every CPU", message))
        elif node.op_type in _PRODUCT_INPUTS:
            product = _product(node, label, types, inits, model)
            if isinstance(product, str):
                report.unverified.append(_unmodeled(label, node.op_type, product))
                continue
            report.products.append(product)
            for path in ACCUMULATION_PATHS:
                problem = check_product(product, path)
                if problem is not None:
                    report.violations.append(Finding(label, node.op_type, path.name, path.cpus, problem))
            problem = check_int32(product)
            if problem is not None:
                report.violations.append(
                    Finding(label, node.op_type, "int32 accumulator", "every CPU", problem)
                )
        elif node.op_type in NO_PRODUCT_OPS:
            if node.op_type.startswith("QLinear"):
                report.kernels[node.op_type] = report.kernels.get(node.op_type, 0) + 1
        else:
            narrow = [i for i in node.input if types.name(i) in _NARROW_TYPES]
            if narrow:
                message = f"reads integer tensor(s) {', '.join(narrow)} in a kernel this model does not know"
                report.unverified.append(_unmodeled(label, node.op_type, message))
    return report


_NARROW_TYPES = ("uint8", "int8", "uint16", "int16", "uint4", "int4")


def _node_attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _unmodeled(label: str, op_type: str, message: str) -> Finding:
    return Finding(label, op_type, "model", "every CPU", message)


def _product(node: Any, label: str, types: _Types, inits: dict[str, Any], model: Any) -> IntegerProduct | str:
    """The product a kernel node computes, with its constant operand's values; or why not modeled."""
    from onnx import numpy_helper

    a_index, b_index, layout = _PRODUCT_INPUTS[node.op_type]
    a_type = "uint8" if node.op_type in _QUANTIZES_A else types.name(node.input[a_index])
    b_name = node.input[b_index]
    b_type = types.name(b_name)
    if a_type not in ("uint8", "int8") or b_type not in ("uint8", "int8"):
        return f"operand types {a_type} x {b_type} not modeled"
    zp_index = _B_ZERO_POINT[node.op_type]
    b_zp: int | None = None
    if len(node.input) <= zp_index or not node.input[zp_index]:
        b_zp = 0
    elif node.input[zp_index] in inits:
        b_zp = int(np.abs(numpy_helper.to_array(inits[node.input[zp_index]]).astype(np.int64)).max(initial=0))
    if b_name not in inits:  # a second activation
        return IntegerProduct(
            label, node.op_type, Operand(a_type), Operand(b_type), _reduction_of(node, types, model)
        )
    raw = numpy_helper.to_array(inits[b_name])
    attrs = _node_attrs(node)
    depthwise = False
    if layout == "conv":
        depthwise = raw.ndim >= 3 and raw.shape[1] == 1 and raw.shape[0] == int(attrs.get("group", 1)) > 1
        values = raw.reshape(raw.shape[0], -1).T
    elif layout == "gemm":
        values = raw.T if attrs.get("transB", 0) else raw
    else:
        values = _columns(raw, raw.ndim - 2) if raw.ndim >= 2 else raw.reshape(-1, 1)
    b = Operand(b_type, values, b_zp)
    return IntegerProduct(label, node.op_type, Operand(a_type), b, int(values.shape[0]), depthwise)


def _reduction_of(node: Any, types: _Types, model: Any) -> int:
    """K of a product of two activations, from the declared shape of B (``[..., K, N]``)."""
    b_name = node.input[_PRODUCT_INPUTS[node.op_type][1]]
    for v in [*model.graph.value_info, *model.graph.input]:
        if v.name == b_name:
            dims = v.type.tensor_type.shape.dim
            if len(dims) >= 2 and dims[-2].HasField("dim_value"):
                return int(dims[-2].dim_value)
    return 1 << 16  # unknown: assume a long reduction (the int32 bound then decides)


def optimized_graph(
    model_bytes: bytes, session_factory: Callable[[Any], Any] | None = None
) -> tuple[Any, Any]:
    """(the graph a plain ORT CPU session runs, that session): ``SessionOptions()`` with only
    ``optimized_model_filepath`` set, as ``onnxruntime.InferenceSession(path)`` would optimize it."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        options = ort.SessionOptions()
        options.optimized_model_filepath = path
        options.log_severity_level = 3
        if session_factory is not None:
            session = session_factory(options)
        else:
            session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(path)
    return optimized, session


def signed_activations(model: Any) -> list[Finding]:
    """int8 activations written in the file (``QuantizeLinear`` with an int8 zero point).

    x86 builds of ORT turn them into uint8 before fusing (what the optimized graph of this machine
    shows); ARM builds keep them signed (``QDQIsInt8Allowed``) and run int8 x int8 products whose
    int16 pairs wrap on ARMv8.0 when both sides reach -128. The reference lowering writes them as
    uint8, so that every CPU runs the graph checked here; a file that still has them is not
    covered by this model."""
    inits = {t.name: int(t.data_type) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            inits[node.output[0]] = int(node.attribute[0].t.data_type)
    return [
        Finding(
            node.name or node.output[0],
            node.op_type,
            "model",
            "ARM64",
            "int8 activation: ARM builds of ORT keep it signed (a graph this check does not see)",
        )
        for node in model.graph.node
        if node.op_type == "QuantizeLinear" and len(node.input) > 2 and inits.get(node.input[2]) == 3
    ]


def verify_model(
    model_bytes: bytes, session_factory: Callable[[Any], Any] | None = None
) -> tuple[AccumulationReport, Any]:
    """(the check of every integer kernel of the graph ORT builds from ``model_bytes`` in a plain
    session, and that the file has no int8 activation, whose graph differs on ARM builds; the
    session, made by ``session_factory(options)`` when given)."""
    import onnx

    optimized, session = optimized_graph(model_bytes, session_factory)
    report = integer_products(optimized)
    report.unverified.extend(signed_activations(onnx.load_from_string(model_bytes)))
    return report, session


def describe_paths(paths: Sequence[AccumulationPath] = ACCUMULATION_PATHS) -> str:
    return "\n".join(f"- {p.name}: {p.cpus} ({ORT_SOURCES}: {p.sources})" for p in paths)
