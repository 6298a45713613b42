"""The ``reference`` artifact computes what the Q/DQ program computes on every CPU, by construction.

This machine's CPU (whatever it is) proves nothing about others: ONNX Runtime picks its integer
kernels at run time, and on x86 with AVX2 but no VNNI (or AVX-512BW without VNNI) its U8S8 kernels
add pairs of products in a saturating int16. So these tests check the *structure*: the graph ORT
builds from the saved ``model.onnx`` in a plain session (no option), every integer product in it
with its real integer weights, against every CPU's accumulation path
(``quantplug_reference.peers.accumulation``), for every preset, on models built to saturate (wide layers,
activations pushed to the top of their grid, large weights, convolutions with many input channels).
The model itself is checked against emulations of the two narrow paths (property tests), and
against real AVX2 kernels under QEMU where QEMU is installed (``test_reference_qemu.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from quantplug_reference.peers import accumulation as acc  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --- models built to saturate ---------------------------------------------------------------------


class WideMLP(nn.Module):
    """1024-wide linears (K = 1024 products per output) with ReLU: activations reach 255."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 64)
        with torch.no_grad():  # large weights: a quarter of each row near the row's maximum
            for fc in (self.fc1, self.fc2, self.fc3):
                fc.weight[:, ::4] = fc.weight[:, ::4].sign() * fc.weight.abs().max()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class WideConv(nn.Module):
    """Convolutions with many input channels (K = 128 x 3 x 3), grouped, depthwise and 1x1."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(16, 128, 3, padding=1)
        self.wide = nn.Conv2d(128, 128, 3, padding=1)
        self.grouped = nn.Conv2d(128, 128, 3, padding=1, groups=4)
        self.depthwise = nn.Conv2d(128, 128, 3, padding=1, groups=128)
        self.pointwise = nn.Conv2d(128, 32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.wide(x))
        x = F.relu(self.grouped(x))
        x = F.relu(self.depthwise(x))
        return self.pointwise(x)


class Attention(nn.Module):
    """A 3-D linear stack with two activation x activation products (q @ k^T, att @ v)."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) * 0.1, dim=-1)
        return self.out(att @ v)


MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "mlp": (WideMLP, (32, 256)),
    "conv": (WideConv, (2, 16, 12, 12)),
    "attention": (Attention, (2, 32, 128)),
}
#: (preset options, models): every preset, and the int8-activation and 8-bit-weight variants
CASES: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"preset": "int8"}, ("mlp", "conv", "attention")),
    ({"preset": "int8", "activation_dtype": "int8"}, ("mlp", "conv", "attention")),
    ({"preset": "int8", "weight_bits": 8}, ("mlp", "conv", "attention")),
    ({"preset": "int8_per_tensor"}, ("mlp", "conv")),
    ({"preset": "a16w8"}, ("mlp", "conv")),
    ({"preset": "a16w8", "activation_dtype": "int8"}, ("mlp",)),
    ({"preset": "weight_only_int8"}, ("mlp",)),
    ({"preset": "weight_only_int8", "group_size": 32}, ("mlp",)),
    ({"preset": "weight_only_int4"}, ("mlp",)),
    ({"preset": "dynamic_int8"}, ("mlp", "attention")),
    ({"preset": "dynamic_int8", "weight_bits": 8}, ("mlp",)),
]
PARAMS = [
    pytest.param(name, options, id="-".join([name, *(f"{k}={v}" for k, v in options.items())]))
    for options, names in CASES
    for name in names
]


def inputs(shape: tuple[int, ...], seed: int, gain: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(shape, generator=gen) * gain).abs()
        if len(shape) == 4
        else torch.randn(shape, generator=gen) * gain
    )


@functools.cache
def lowered(name: str, options_key: tuple[tuple[str, Any], ...]) -> tuple[nn.Module, Any, Any]:
    """(float model, Q/DQ program, artifact); calibrated on small inputs so that the held-out
    ones (3x larger) push many activations to the top of their grid."""
    ctor, shape = MODELS[name]
    torch.manual_seed(0)
    model = ctor().eval()
    ep = torch.export.export(model, (inputs(shape, 0),))
    quantizer = quantplug.get_quantizer("reference", activation_observer="minmax", **dict(options_key))
    prepared = quantplug.prepare(ep, quantizer)
    with torch.no_grad():
        for seed in range(1, 4):
            prepared(inputs(shape, seed))
    converted = quantplug.convert(prepared)
    return model, converted, quantplug.lower(converted, quantizer)


def output_step(artifact: Any) -> float | None:
    """The output encoding's scale (None when the output is float: weight-only, dynamic)."""
    import json

    doc = json.loads(artifact.files["encodings.json"])
    out = artifact.outputs[0].name
    for entry in doc["encodings"]:
        info = entry.get("onnx") or {}
        if out in info.get("dequantized", []) and entry["granularity"] == "tensor":
            return float(entry["scale"])
    return None


# --- the structural proof ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "options"), PARAMS)
def test_saved_model_is_exact_on_every_cpu(name: str, options: dict[str, Any], tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, converted, artifact = lowered(name, tuple(sorted(options.items())))
    artifact.save(tmp_path)
    path = str(tmp_path / "model.onnx")
    # the graph a user's plain session runs: no session option at all
    sess_options = ort.SessionOptions()
    sess_options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(path, sess_options, providers=["CPUExecutionProvider"])
    report = acc.integer_products(onnx.load(str(tmp_path / "optimized.onnx")))
    assert not report.violations, "\n".join(f.format() for f in report.violations)
    assert not report.unverified, "\n".join(f.format() for f in report.unverified)
    assert artifact.metadata["ort_integer_kernels"]["exact_on_every_cpu"]
    preset = options["preset"]
    if preset in ("int8", "int8_per_tensor", "dynamic_int8"):
        assert report.products, report.kernels  # the speed-up: integer products are there
        wide = [p for p in report.products if p.b.values is not None and not p.depthwise]
        assert wide and all(p.k >= 128 for p in wide if p.op_type != "QLinearMatMul")
    if preset == "weight_only_int4":
        assert report.kernels.get("MatMulNBits") == 3
    # and on this machine, the plain session gives the program's numbers
    shape = MODELS[name][1]
    x = inputs(shape, 99, gain=3.0)
    ref = converted(x)
    out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    step = output_step(artifact)
    if step is not None:
        assert float((out - ref).abs().max()) <= step * 1.001
    elif preset == "dynamic_int8":
        # float rounding of the per-token scales may move an input by one step (any CPU): 70-80 dB
        # here, where one saturated pair costs tens of dB
        assert sqnr(ref, out) > 50
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-300)))


def test_the_check_finds_the_old_scheme(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """8-bit weights stored as int8 (quantplug before this fix) saturate on AVX2 / AVX-512BW: the
    check names every wide linear and that path, and no other (ARM's int16 pairs hold 127 x 128)."""
    _, _, artifact = lowered("mlp", (("preset", "int8"), ("weight_bits", 8)))
    model = onnx.load_from_string(artifact.onnx_model)
    signed = _store_uint8_weights_as_int8(model)
    assert len(signed) == 3
    path = str(tmp_path / "old.onnx")
    onnx.save(model, path)
    report, _ = acc.verify_model(model.SerializeToString())
    assert {f.path for f in report.violations} == {acc.ACCUMULATION_PATHS[0].name}
    assert len(report.violations) == 3
    assert "saturates" in report.violations[0].message and "AVX2" in report.violations[0].cpus
    with pytest.raises(quantplug.LoweringError, match=r"(?s)VPMADDUBSW.*weight_bits=7"):
        from quantplug_reference.lowering import ReferenceArtifact, _check_integer_kernels

        _check_integer_kernels(model.SerializeToString(), ReferenceArtifact(backend="reference"))


def _store_uint8_weights_as_int8(model: Any) -> list[str]:
    """Undo ``retype_wide_product_weights``: uint8 ``w + 128`` (zero point 128) back to int8 ``w``."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    changed = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or len(node.input) < 3:
            continue
        w, z = inits[node.input[0]], inits.get(node.input[2])
        if w.data_type != TensorProto.UINT8 or z is None:
            continue
        for tensor in (w, z):
            value = numpy_helper.to_array(tensor).astype(np.int16) - 128
            tensor.CopyFrom(numpy_helper.from_array(value.astype(np.int8), tensor.name))
        changed.append(w.name)
    return changed


def test_int8_activations_are_stored_unsigned() -> None:
    """int8 activations are written as uint8 (zero point + 128): the same grid, the kernels x86
    builds of ORT pick anyway, and no int8 x int8 activation product (``-128 x -128`` twice wraps
    ARMv8.0's int16 pairs). The encodings say how they are stored."""
    import json

    _, _, artifact = lowered("attention", (("activation_dtype", "int8"), ("preset", "int8")))
    model = onnx.load_from_string(artifact.onnx_model)
    inits = {t.name: t for t in model.graph.initializer}
    zero_points = [inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert zero_points and {z.data_type for z in zero_points} == {onnx.TensorProto.UINT8}
    doc = json.loads(artifact.files["encodings.json"])
    acts = [e for e in doc["encodings"] if e["kind"] == "activation"]
    assert acts and all(e["dtype"] == "int8" and e["onnx"]["stored_as"] == "uint8" for e in acts)
    for e in acts:
        stored = onnx.numpy_helper.to_array(inits[e["onnx"]["zero_point"]])
        assert int(stored) == e["zero_point"] + e["onnx"]["stored_offset"]
    # what an ARMv8.0 CPU would do with the int8 form: the check sees the wrap
    product = acc.IntegerProduct("qk", "QLinearMatMul", acc.Operand("int8"), acc.Operand("int8"), k=64)
    arm = next(p for p in acc.ACCUMULATION_PATHS if p.pair_lane == "wrapping")
    assert "wraps" in (acc.check_product(product, arm) or "")
    unsigned = acc.IntegerProduct("qk", "QLinearMatMul", acc.Operand("uint8"), acc.Operand("uint8"), k=64)
    assert all(acc.check_product(unsigned, path) is None for path in acc.ACCUMULATION_PATHS)


def test_weight_grids() -> None:
    """Products' weights on [-64, 64] (7-bit default), depthwise and embedding on [-127, 127]."""
    from _quantplug.flow.inspect import encodings

    _, converted, _ = lowered("conv", (("preset", "int8"),))
    ranges = {
        str(e["tensor"]): (e["quant_min"], e["quant_max"])
        for e in encodings(converted)
        if e["dtype"] == "int8"
    }
    depthwise = [r for n, r in ranges.items() if "depthwise" in n]
    others = [r for n, r in ranges.items() if "depthwise" not in n]
    assert depthwise == [(-127, 127)] and others and set(others) == {(-64, 64)}, ranges
    _, converted8, artifact8 = lowered("conv", (("preset", "int8"), ("weight_bits", 8)))
    assert {(e["quant_min"], e["quant_max"]) for e in encodings(converted8) if e["dtype"] == "int8"} == {
        (-127, 127)
    }
    # 8-bit weights of products are stored as uint8 w + 128 (U8U8 kernels); the depthwise one stays int8
    model = onnx.load_from_string(artifact8.onnx_model)
    types = {t.name: t.data_type for t in model.graph.initializer}
    stored = [
        types[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in types
    ]
    assert stored.count(onnx.TensorProto.UINT8) == 4 and stored.count(onnx.TensorProto.INT8) == 1
    with pytest.raises(quantplug.OptionError, match="weight_bits"):
        quantplug.get_quantizer("reference", weight_bits=6)


def test_matmulnbits_accuracy_level_is_checked() -> None:
    """A MatMulNBits at ORT's default accuracy level (4: int8 activations) is not the program."""
    from onnx import TensorProto, helper

    node = helper.make_node(
        "MatMulNBits",
        ["x", "w", "s"],
        ["y"],
        domain="com.microsoft",
        K=32,
        N=4,
        bits=4,
        block_size=32,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [
            onnx.numpy_helper.from_array(np.zeros((4, 1, 16), np.uint8), "w"),
            onnx.numpy_helper.from_array(np.ones(4, np.float32), "s"),
        ],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    report = acc.integer_products(model)
    assert [f.path for f in report.violations] == ["numerics"] and "accuracy_level 4" in report.violations[
        0
    ].message
    # no weight grid the user could choose changes it: the advice is not weight_bits
    from quantplug_reference.lowering import ReferenceArtifact, _check_integer_kernels

    with pytest.raises(quantplug.LoweringError, match="quantplug bug") as info:
        _check_integer_kernels(model.SerializeToString(), ReferenceArtifact(backend="reference"))
    assert "weight_bits" not in str(info.value)


def test_unknown_integer_kernels_are_reported() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MysteryQOp", ["q"], ["y"], domain="example")],
        "g",
        [helper.make_tensor_value_info("q", TensorProto.UINT8, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    report = acc.integer_products(helper.make_model(graph))
    assert not report.exact and report.unverified[0].op_type == "MysteryQOp"
    # an int8 activation left in the file: ARM builds would run a graph this check does not see
    signed = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [onnx.numpy_helper.from_array(np.float32(0.1), "s"), onnx.numpy_helper.from_array(np.int8(3), "z")],
    )
    findings = acc.signed_activations(helper.make_model(signed))
    assert len(findings) == 1 and findings[0].cpus == "ARM64"
    _, _, artifact = lowered("attention", (("activation_dtype", "int8"), ("preset", "int8")))
    assert acc.signed_activations(onnx.load_from_string(artifact.onnx_model)) == []


# --- the model against emulations of the narrow paths ------------------------------------------


def _emulate_pairs(a: np.ndarray, w: np.ndarray, order: np.ndarray, saturate: bool) -> int:
    """Sum of a_k w_k with products added two at a time (in ``order``) into an int16 lane."""
    products = (a.astype(np.int64) * w.astype(np.int64))[order]
    if len(products) % 2:
        products = np.append(products, 0)
    pairs = products[0::2] + products[1::2]
    if saturate:
        pairs = np.clip(pairs, acc.INT16_MIN, acc.INT16_MAX)
    else:
        pairs = (pairs + 2**15) % 2**16 - 2**15
    return int(pairs.sum())


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.integers(-128, 127), min_size=1, max_size=12),
    activations=st.lists(st.integers(0, 255), min_size=12, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_pair_model_is_sound(weights: list[int], activations: list[int], seed: int) -> None:
    """Whenever the model calls a column safe on a 16-bit-pair path, the emulated path equals the
    exact sum for any activations and any pairing of the reduction (MLAS's packing order)."""
    w = np.array(weights, np.int64)
    k = len(w)
    order = np.random.default_rng(seed).permutation(k)
    for path in (p for p in acc.ACCUMULATION_PATHS if p.pair_lane is not None):
        product = acc.IntegerProduct(
            "n", "QGemm", acc.Operand("uint8"), acc.Operand("int8", w.reshape(k, 1), 0), k
        )
        if acc.check_product(product, path) is not None:
            continue
        a = np.array(activations[:k], np.int64)
        if path.signed_operands:
            a = a - 128  # ARM moves unsigned activations to the signed range
        for trial in (a, np.full(k, a.max()), np.full(k, a.min())):
            exact = int((trial * w).sum())
            assert _emulate_pairs(trial, w, order, path.pair_lane == "saturating") == exact


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(
        st.integers(-acc.SATURATION_FREE_WEIGHT_MAX, acc.SATURATION_FREE_WEIGHT_MAX), min_size=2, max_size=16
    ),
    big=st.integers(acc.SATURATION_FREE_WEIGHT_MAX + 1, 127),
)
def test_weight_grid_bound_is_tight(weights: list[int], big: int) -> None:
    """[-64, 64] is safe on every path; two same-sign weights past 64 saturate VPMADDUBSW."""
    w = np.array(weights, np.int64).reshape(-1, 1)
    safe = acc.IntegerProduct("n", "QGemm", acc.Operand("uint8"), acc.Operand("int8", w, 0), len(w))
    assert all(acc.check_product(safe, p) is None for p in acc.ACCUMULATION_PATHS)
    w2 = np.vstack([w, [[big], [big]]])
    wide = acc.IntegerProduct("n", "QGemm", acc.Operand("uint8"), acc.Operand("int8", w2, 0), len(w2))
    assert acc.check_product(wide, acc.ACCUMULATION_PATHS[0]) is not None
    k = len(w2)
    a = np.full(k, 255)
    order = np.r_[k - 2, k - 1, np.arange(k - 2)]  # the two large weights paired
    assert _emulate_pairs(a, w2.ravel(), order, True) != int((a * w2.ravel()).sum())
