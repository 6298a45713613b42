"""Rewrites of the exported QDQ ONNX model so that any ONNX Runtime session of the saved file,
``onnxruntime.InferenceSession("model.onnx")`` with no option at all, computes what the Q/DQ
program computes, on every CPU, and fast.

Each keeps the numbers the program defines (the same integer grids, the same scales); only the
way they are stored or spelled changes. ``encodings.json`` follows (``stored_as`` /
``stored_offset`` when ONNX holds an int8 grid as uint8, the new tensor names otherwise).

* ``retype_signed_activations``: int8 activation ``QuantizeLinear``/``DequantizeLinear`` pairs
  become uint8 ones with the zero point moved by 128: the same grid (``q + 128``). x86 builds of
  ORT do this themselves before fusing (``QDQS8ToU8Transformer``); doing it in the file makes ARM
  builds run the same unsigned kernels (no int8 x int8 product of two ``-128`` can wrap in the
  int16 pair sums of ARMv8.0 NEON), and avoids ORT's ``MatMulAddFusion`` defect that made such
  files fail to load (a uint8 zero point on an int8 ``QuantizeLinear``).
* ``retype_wide_product_weights``: an int8 weight with values outside ``[-64, 64]`` that feeds
  an 8-bit integer product (``weight_bits=8``) is stored as uint8 (``w + 128``, zero point 128):
  ORT then runs its U8U8 kernels, which widen to 16 bits and are exact on every CPU, instead of
  the U8S8 ones whose AVX2 / AVX-512BW form saturates (see ``accumulation``).
* ``dequantize_weights_as_arithmetic``: an int8 weight that feeds no 8-bit integer product
  (weight-only int8, dynamic int8, 16-bit activations) has its ``DequantizeLinear`` spelled ``Cast`` + ``Mul``
  (with ``Reshape`` for per-group scales). ORT folds those into float constants once, at load,
  in every session; a ``DequantizeLinear`` would instead be fused into ``MatMulNBits``, whose
  default accuracy level quantizes the float activations to int8 (not what the program does).
  The same holds for the int4 weights of products ``int4_linears_as_matmulnbits`` leaves alone
  (an ``addmm`` weight stored ``[in, out]``, as GPT-2's ``Conv1D``), and for an 8-bit weight
  multiplied by another stored tensor (Swin V2's position-bias MLP over its constant coordinate
  table), of which ORT makes no integer product but a ``MatMulNBits``.
* ``bfloat16_in_float32``: ONNX Runtime's CPU kernels have no bfloat16 arithmetic (not even
  ``Add``) and its Python API cannot feed bfloat16 arrays: a bfloat16 program's model computes in
  float32, inputs and outputs included, as ORT itself does for the float16 ops it has no kernel
  for. The integer grids are the program's; the float arithmetic between them is float32 instead
  of bfloat16 (closer to exact, not bit-equal to the program).
* ``int4_linears_as_matmulnbits``: a linear with a float input and a 4-bit weight is written as
  ORT's ``MatMulNBits`` (domain ``com.microsoft``) with ``accuracy_level=1``: the packed 4-bit
  weight is read directly and the products are float, as in the program. Left as
  ``DequantizeLinear -> MatMul``, ORT would fuse it with the session's accuracy level (4 by
  default: int8 activations), which a user's own session would not set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quantplug_reference.peers.accumulation import SATURATION_FREE_WEIGHT_MAX

#: operators ORT fuses with the dequantized weight into an integer product
PRODUCT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
MS_DOMAIN = "com.microsoft"
#: MatMulNBits accuracy level 1: float products (the program's), whatever the session says
MATMULNBITS_FLOAT_ACCURACY = 1


class _Graph:
    """Index of one ONNX graph: producers, consumers, initializers, constant values."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.graph = model.graph
        self.reindex()

    def reindex(self) -> None:
        self.inits = {t.name: t for t in self.graph.initializer}
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.users: dict[str, list[Any]] = {}
        for node in self.graph.node:
            for name in node.input:
                self.users.setdefault(name, []).append(node)
        self.outputs = {o.name for o in self.graph.output}
        self.node_names = {n.name for n in self.graph.node if n.name}
        #: names given out by fresh()/node() for what is not in the graph yet
        self.given: set[str] = set()

    def constant(self, name: str) -> Any:
        """The numpy value of an initializer or ``Constant`` output, else None."""
        from onnx import numpy_helper

        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute:
            attr = node.attribute[0]
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
        return None

    def constant_type(self, name: str) -> int | None:
        if name in self.inits:
            return int(self.inits[name].data_type)
        node = self.producer.get(name)
        if (
            node is not None
            and node.op_type == "Constant"
            and node.attribute
            and node.attribute[0].name == "value"
        ):
            return int(node.attribute[0].t.data_type)
        return None

    def fresh(self, base: str) -> str:
        """A value name no tensor of the graph has, nor one given out before."""
        taken = set(self.inits) | set(self.producer) | {i.name for i in self.graph.input} | self.given
        return self._unique(base, taken)

    def node(self, op_type: str, inputs: list[str], outputs: list[str], base: str, **attrs: Any) -> Any:
        """A new node named ``base`` (or ``base_N``): node names are unique by construction (ONNX
        Runtime refuses a model holding two nodes of one name)."""
        from onnx import helper

        name = self._unique(base, self.node_names | self.given)
        return helper.make_node(op_type, inputs, outputs, name=name, **attrs)

    def _unique(self, base: str, taken: set[str]) -> str:
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        self.given.add(name)
        return name

    def add_initializer(self, array: Any, base: str) -> str:
        from onnx import numpy_helper

        name = self.fresh(base)
        tensor = numpy_helper.from_array(array, name)
        self.graph.initializer.append(tensor)
        self.inits[name] = self.graph.initializer[-1]
        return name

    def replace_nodes(self, replace: dict[int, list[Any]]) -> None:
        """Each node whose ``id`` is a key of ``replace`` becomes those nodes ([] drops it)."""
        nodes = []
        for node in self.graph.node:
            nodes.extend(replace.get(id(node), [node]))
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self.drop_unused_initializers()

    def drop_unused_initializers(self) -> None:
        used = {name for node in self.graph.node for name in node.input} | self.outputs
        keep = [t for t in self.graph.initializer if t.name in used]
        del self.graph.initializer[:]
        self.graph.initializer.extend(keep)
        self.reindex()


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _entries_by(encodings: Iterable[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """Encodings' ONNX info dicts by the tensor name under ``key``."""
    found: dict[str, list[dict[str, Any]]] = {}
    for entry in encodings:
        info = entry.get("onnx")
        if info and info.get(key):
            found.setdefault(info[key], []).append(info)
    return found


# --------------------------------------------------------------------------- bfloat16


def bfloat16_in_float32(model: Any) -> list[str]:
    """Every bfloat16 tensor, initializer, constant and cast of ``model`` made float32 (module
    docstring); the casts to float32 that are then no-ops dropped. Returns the graph inputs and
    outputs it retyped (their dtype is now float32)."""
    from onnx import TensorProto, shape_inference

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    graph = model.graph
    typed = [*graph.input, *graph.output, *graph.value_info]
    if not (
        any(v.type.tensor_type.elem_type == bf16 for v in typed)
        or any(t.data_type == bf16 for t in graph.initializer)
        or any(a.name in ("to", "dtype") and a.i == bf16 for n in graph.node for a in n.attribute)
    ):
        return []
    retyped = [v.name for v in (*graph.input, *graph.output) if v.type.tensor_type.elem_type == bf16]
    for value in typed:
        if value.type.tensor_type.elem_type == bf16:
            value.type.tensor_type.elem_type = f32
    for tensor in graph.initializer:
        _bfloat16_tensor_as_float32(tensor)
    for node in graph.node:
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.i == bf16:
                attr.i = f32
            elif attr.HasField("t"):
                _bfloat16_tensor_as_float32(attr.t)
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # no types known: the casts stay (ORT drops no-op casts itself)
        return retyped
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info)
    }
    types.update({t.name: t.data_type for t in graph.initializer})
    outputs = {o.name for o in graph.output}
    rename: dict[str, str] = {}
    keep = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        to = _attrs(node).get("to") if node.op_type == "Cast" else None
        if to == f32 and types.get(node.input[0]) == f32 and node.output[0] not in outputs:
            rename[node.output[0]] = node.input[0]  # a no-op now: its readers read its input
            continue
        keep.append(node)
    if rename:
        del graph.node[:]
        graph.node.extend(keep)
    return retyped


def _bfloat16_tensor_as_float32(tensor: Any) -> None:
    """A bfloat16 ``TensorProto`` as float32 (the same values: bfloat16 is float32's top half)."""
    import numpy as np
    from onnx import TensorProto

    if tensor.data_type != TensorProto.BFLOAT16:
        return
    if tensor.raw_data:
        bits = np.frombuffer(tensor.raw_data, dtype="<u2").astype(np.uint32)
    else:
        bits = np.asarray(tensor.int32_data, dtype=np.uint32)
    tensor.raw_data = (bits << 16).astype("<u4").tobytes()
    del tensor.int32_data[:]
    tensor.data_type = TensorProto.FLOAT


# --------------------------------------------------------------------------- int8 activations


def retype_signed_activations(model: Any, encodings: list[dict[str, Any]]) -> list[str]:
    """int8 activation Q/DQ pairs stored as uint8 (module docstring). Returns the retyped tensors."""
    import numpy as np
    from onnx import TensorProto

    g = _Graph(model)
    by_quantized = _entries_by(encodings, "quantized")
    value_info = {v.name: v for v in g.graph.value_info}
    changed = []
    for q in list(g.graph.node):
        if q.op_type != "QuantizeLinear" or len(q.input) < 3 or _attrs(q).get("output_dtype", 0):
            continue
        out = q.output[0]
        zp = g.constant(q.input[2])
        if g.constant_type(q.input[2]) != TensorProto.INT8 or zp is None or zp.size != 1 or out in g.outputs:
            continue
        readers = g.users.get(out, [])
        if not readers or any(r.op_type != "DequantizeLinear" or len(r.input) < 3 for r in readers):
            continue
        if any(
            g.constant(r.input[2]) is None or g.constant(r.input[2]).tolist() != zp.tolist() for r in readers
        ):
            continue
        shifted = (zp.astype(np.int16) + 128).astype(np.uint8)
        new_zp = g.add_initializer(shifted, q.input[2] + "_as_uint8")
        q.input[2] = new_zp
        for r in readers:
            r.input[2] = new_zp
        if out in value_info:
            value_info[out].type.tensor_type.elem_type = TensorProto.UINT8
        for info in by_quantized.get(out, []):
            info.update(zero_point=new_zp, stored_as="uint8", stored_offset=128)
        changed.append(out)
    if changed:
        g.drop_unused_initializers()
    return changed


# --------------------------------------------------------------------------- 8-bit product weights


def _is_depthwise(g: _Graph, conv: Any, weight: Any) -> bool:
    """ORT's test: one input and one output channel per group."""
    group = int(_attrs(conv).get("group", 1))
    return (
        conv.op_type == "Conv" and weight.ndim >= 3 and weight.shape[1] == 1 and weight.shape[0] == group > 1
    )


def _eight_bit_activation(g: _Graph, name: str) -> bool:
    """``name`` is the output of a DequantizeLinear of an 8-bit tensor (an integer product's input)."""
    from onnx import TensorProto

    dq = g.producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return False
    if dq.input[0] in g.inits:
        return int(g.inits[dq.input[0]].data_type) in (TensorProto.UINT8, TensorProto.INT8)
    return len(dq.input) > 2 and g.constant_type(dq.input[2]) in (TensorProto.UINT8, TensorProto.INT8)


def _dequantized_constant(g: _Graph, name: str) -> bool:
    """``name`` dequantizes a stored tensor: a product of it and a weight is a product of two
    constants (SwinV2's position-bias MLP reads a constant coordinate table). ORT forms no integer
    product of those; it fused the weight's DequantizeLinear into ``MatMulNBits``, at the
    session's accuracy level, which quantizes the other operand to int8 on the fly."""
    dq = g.producer.get(name)
    return dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in g.inits


#: ops that move a weight on its way to a product (``MatMul(x, Transpose(DQ(W)))``)
_MOVES = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")


def _product_readers(g: _Graph, name: str) -> list[tuple[Any, str]]:
    """(product node, the input it reads) for each product reached from ``name`` through moves."""
    found = []
    for reader in g.users.get(name, []):
        if reader.op_type in PRODUCT_OPS:
            found.append((reader, name))
        elif reader.op_type in _MOVES and reader.input and reader.input[0] == name:
            found.extend(_product_readers(g, reader.output[0]))
    return found


def retype_wide_product_weights(model: Any, encodings: list[dict[str, Any]]) -> list[str]:
    """int8 weights past ``[-64, 64]`` of 8-bit integer products stored as uint8 (module
    docstring). Returns the names of the new uint8 initializers."""
    import numpy as np
    from onnx import TensorProto

    g = _Graph(model)
    by_quantized = _entries_by(encodings, "quantized")
    changed = []
    for dq in list(g.graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in g.inits:
            continue
        if int(g.inits[dq.input[0]].data_type) != TensorProto.INT8:
            continue
        weight = g.constant(dq.input[0])
        if weight.size == 0 or int(np.abs(weight.astype(np.int16)).max()) <= SATURATION_FREE_WEIGHT_MAX:
            continue
        products = [
            (r, fed)
            for r, fed in _product_readers(g, dq.output[0])
            if not _is_depthwise(g, r, weight)
            and any(_eight_bit_activation(g, i) for i in r.input if i and i != fed)
        ]
        if not products:
            continue
        zp = g.constant(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros((), np.int8)
        stored = (weight.astype(np.int16) + 128).astype(np.uint8)
        new_w = g.add_initializer(stored, dq.input[0] + "_as_uint8")
        new_zp = g.add_initializer(
            (zp.astype(np.int16) + 128).astype(np.uint8), dq.input[0] + "_zero_point_as_uint8"
        )
        old_w = dq.input[0]
        dq.input[0] = new_w
        if len(dq.input) > 2:
            dq.input[2] = new_zp
        else:
            dq.input.append(new_zp)
        for info in by_quantized.get(old_w, []):
            if info.get("node") == dq.name:
                info.update(quantized=new_w, zero_point=new_zp, stored_as="uint8", stored_offset=128)
        changed.append(new_w)
    if changed:
        g.drop_unused_initializers()
    return changed


# --------------------------------------------------------------------------- weight-only int8


def dequantize_weights_as_arithmetic(model: Any, encodings: list[dict[str, Any]]) -> list[str]:
    """int8 weights that feed no 8-bit integer product (weight-only and dynamic presets, and
    products with 16-bit activations: ``a16w8``) have their DequantizeLinear spelled Cast + Mul
    (module docstring). Returns the weights rewritten."""
    import numpy as np
    from onnx import TensorProto

    g = _Graph(model)
    by_node = _entries_by(encodings, "node")
    replace: dict[int, list[Any]] = {}
    changed = []
    for dq in g.graph.node:
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in g.inits:
            continue
        dtype = int(g.inits[dq.input[0]].data_type)
        # int8 weights, and the int4 products int4_linears_as_matmulnbits could not write as
        # MatMulNBits (an addmm's [in, out] weight: GPT-2's Conv1D); other int4 tables (an
        # embedding's) keep their DequantizeLinear, which ORT fuses into nothing
        if dtype != TensorProto.INT8 and not (
            dtype == TensorProto.INT4 and _product_readers(g, dq.output[0])
        ):
            continue
        if any(
            _eight_bit_activation(g, i) and not _dequantized_constant(g, i)
            for r, fed in _product_readers(g, dq.output[0])
            for i in r.input
            if i and i != fed
        ):
            continue  # ORT fuses it into an integer product (QLinearConv, QGemm...): keep the DQ
        weight = g.constant(dq.input[0])
        scale = g.constant(dq.input[1])
        zero = g.constant(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if scale is None or (len(dq.input) > 2 and dq.input[2] and zero is None):
            continue
        attrs = _attrs(dq)
        axis, block = int(attrs.get("axis", 1)) % max(weight.ndim, 1), int(attrs.get("block_size", 0))
        out, base = dq.output[0], dq.name or dq.output[0]
        nodes: list[Any] = []
        cast_out = g.fresh(out + "_int")
        nodes.append(g.node("Cast", [dq.input[0]], [cast_out], base + "_cast", to=TensorProto.FLOAT))
        value = cast_out
        rank = weight.ndim
        if block and scale.ndim == rank:  # per block: split the blocked axis in (blocks, block)
            n = weight.shape[axis] // block
            split = [*weight.shape[:axis], n, block, *weight.shape[axis + 1 :]]
            param_shape = [*weight.shape[:axis], n, 1, *weight.shape[axis + 1 :]]
        elif scale.size > 1:  # per axis
            split = None
            param_shape = [1] * rank
            param_shape[axis] = scale.size
        else:
            split, param_shape = None, []
        if split is not None:
            shape_name = g.add_initializer(np.array(split, np.int64), base + "_blocks")
            reshaped = g.fresh(out + "_blocks")
            nodes.append(g.node("Reshape", [value, shape_name], [reshaped], base + "_split"))
            value = reshaped
        if zero is not None and np.any(zero != 0):
            z_name = g.add_initializer(zero.astype(np.float32).reshape(param_shape), base + "_zero_point_f")
            centered = g.fresh(out + "_centered")
            nodes.append(g.node("Sub", [value, z_name], [centered], base + "_center"))
            value = centered
        s_name = g.add_initializer(scale.astype(np.float32).reshape(param_shape), base + "_scale_b")
        scaled = out if split is None else g.fresh(out + "_scaled")
        nodes.append(g.node("Mul", [value, s_name], [scaled], base + "_scale"))
        if split is not None:
            back = g.add_initializer(np.array(weight.shape, np.int64), base + "_shape")
            nodes.append(g.node("Reshape", [scaled, back], [out], base + "_merge"))
        replace[id(dq)] = nodes
        for info in by_node.get(dq.name, []):
            info.update(node=nodes[-1].name, scale=s_name, zero_point=None, spelled="Cast*scale")
        changed.append(dq.input[0])
    if replace:
        g.replace_nodes(replace)
    return changed


# --------------------------------------------------------------------------- int4 linears


def _matmulnbits_weight(weight: Any, scale: Any, attrs: dict[str, Any]) -> tuple[Any, Any, int] | None:
    """(packed B ``[N, blocks, block / 2]``, scales ``[N * blocks]``, block size) of a 4-bit
    weight ``[N, K]`` (int values in ``[-8, 7]``) and its DequantizeLinear scales, or None."""
    import numpy as np

    n, k = weight.shape
    axis, block = int(attrs.get("axis", 1)) % 2, int(attrs.get("block_size", 0))
    if (
        block
        and scale.shape == (n, k // block)
        and axis == 1
        and k % block == 0
        and block >= 16
        and block & (block - 1) == 0
    ):
        scales = scale
    elif not block and (scale.size == 1 or (scale.shape == (n,) and axis == 0)):
        block = max(16, 1 << (k - 1).bit_length())  # one block spans the row (zero-padded)
        scales = np.broadcast_to(scale.reshape(-1, 1), (n, 1))
    else:
        return None
    blocks = -(-k // block)
    unsigned = np.full((n, blocks * block), 8, np.uint8)  # 8 = MatMulNBits' default zero point
    unsigned[:, :k] = (weight.astype(np.int16) + 8).astype(np.uint8)
    pairs = unsigned.reshape(n, blocks, block // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(scales, dtype=np.float32).reshape(-1), block


def int4_linears_as_matmulnbits(model: Any, encodings: list[dict[str, Any]]) -> list[str]:
    """Linears with a float input and a 4-bit symmetric weight written as ``MatMulNBits``
    (module docstring). Returns the weights rewritten."""
    from onnx import TensorProto, helper

    g = _Graph(model)
    by_node = _entries_by(encodings, "node")

    def weight_dq(name: str) -> Any:
        """The DequantizeLinear of a symmetric 4-bit initializer producing ``name``, read only there."""
        dq = g.producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or len(g.users.get(dq.output[0], [])) != 1:
            return None
        data = g.inits.get(dq.input[0])
        if data is None or data.data_type != TensorProto.INT4 or len(data.dims) != 2:
            return None
        if len(dq.input) > 2 and dq.input[2]:
            zero = g.constant(dq.input[2])
            if zero is None or zero.any():
                return None
        return dq if g.constant(dq.input[1]) is not None else None

    def float_input(name: str) -> bool:
        src = g.producer.get(name)
        return src is None or src.op_type != "DequantizeLinear"

    replace: dict[int, list[Any]] = {}
    changed = []

    def rewrite(anchor: Any, x: str, dq: Any, out: str, bias: str | None, extra: Iterable[Any] = ()) -> bool:
        weight = g.constant(dq.input[0])
        spelled = _matmulnbits_weight(weight, g.constant(dq.input[1]), _attrs(dq))
        if spelled is None:
            return False
        packed, scales, block = spelled
        n, k = weight.shape
        base = dq.name or dq.output[0]
        b_name = g.add_initializer(packed, dq.input[0] + "_nbits")
        s_name = g.add_initializer(scales, dq.input[1] + "_nbits")
        product = out if bias is None else g.fresh(out + "_matmul")
        node = g.node(
            "MatMulNBits",
            [x, b_name, s_name],
            [product],
            (anchor.name or out) + "_nbits",
            domain=MS_DOMAIN,
            K=k,
            N=n,
            bits=4,
            block_size=block,
            accuracy_level=MATMULNBITS_FLOAT_ACCURACY,
        )
        nodes = [node]
        if bias is not None:
            nodes.append(g.node("Add", [product, bias], [out], (anchor.name or out) + "_bias"))
        replace[id(anchor)] = nodes
        replace[id(dq)] = []
        for other in extra:
            replace[id(other)] = []
        for info in by_node.get(dq.name, []):
            info.update(
                tensor=None,
                quantized=b_name,
                dequantized=[],
                scale=s_name,
                zero_point=None,
                node=node.name,
                layout="MatMulNBits: uint8 [N, blocks, block/2], two 4-bit values per byte (low nibble "
                "first), stored w + 8; scales [N * blocks]",
            )
        changed.append(base)
        return True

    for node in list(g.graph.node):
        if node.op_type == "Gemm" and len(node.input) >= 2 and float_input(node.input[0]):
            a = _attrs(node)
            if (a.get("transA", 0), a.get("transB", 0), a.get("alpha", 1.0), a.get("beta", 1.0)) != (
                0,
                1,
                1.0,
                1.0,
            ):
                continue
            dq = weight_dq(node.input[1])
            if dq is not None:
                bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
                rewrite(node, node.input[0], dq, node.output[0], bias)
        elif node.op_type == "MatMul" and float_input(node.input[0]):
            transpose = g.producer.get(node.input[1])
            if (
                transpose is None
                or transpose.op_type != "Transpose"
                or len(g.users.get(transpose.output[0], [])) != 1
            ):
                continue
            if list(_attrs(transpose).get("perm", [])) != [1, 0]:
                continue
            dq = weight_dq(transpose.input[0])
            if dq is not None:
                rewrite(node, node.input[0], dq, node.output[0], None, extra=[transpose])
    if replace:
        g.replace_nodes(replace)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return changed
