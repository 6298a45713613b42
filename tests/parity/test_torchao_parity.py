"""quantplug.prepare/convert with a torchao PT2E quantizer == torchao's prepare_pt2e/convert_pt2e.

For each model and quantizer the program is exported once; torchao runs on one ``ep.module()``,
quantplug on the ExportedProgram itself (and, in a second variant, on a GraphModule), each with a
fresh quantizer instance and the same calibration batches. The converted programs must agree on:

* **Q/DQ placement.** torchao constant-folds the quantize of every constant (weights, and the
  scalar tensors XNNPACK's ``transform_for_annotation`` lifts to attributes) into an integer
  ``_frozen_param`` buffer; quantplug stores the integer tensor directly. In both graphs a constant
  is therefore ``get_attr (int) -> dequantize -> op`` with no quantize node. So placement is the
  multiset, over every quantize/dequantize *call* node, of (op target, producer kind, consumer
  kinds), where a producer/consumer's kind is its target for call_function nodes and its opcode
  (``get_attr``, ``placeholder``, ``output``) otherwise. This sees every activation Q, every DQ
  copy (both duplicate a DQ per annotated consumer) and every constant's DQ.
* **Encodings**, matched per tensor: an activation by (producer node name, the ops its DQs feed),
  a constant by (consuming op name, argument index). Same dtype, range, axis, zero points; scales
  to rtol 1e-6. The integer constants themselves must be equal too.
* **Outputs** on held-out inputs (atol 1e-5).

And quantplug.prepare must leave the caller's program untouched.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.fx import GraphModule, Node

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

import quantplug
from _quantplug.graph.attrs import attr_value

from .models import MODEL_CASES, ModelCase

pytestmark = [
    pytest.mark.torchao,
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

qd = torch.ops.quantized_decomposed

QUANTIZE_OPS = {
    qd.quantize_per_tensor.default,
    qd.quantize_per_tensor.tensor,
    qd.quantize_per_channel.default,
}
DEQUANTIZE_OPS = {
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_tensor.tensor,
    qd.dequantize_per_channel.default,
}
QDQ_OPS = QUANTIZE_OPS | DEQUANTIZE_OPS

CALIBRATION_SEEDS = range(1, 6)
HELD_OUT_SEEDS = range(100, 103)


# ----------------------------------------------------------------------------- quantizers


def _x86_quantizer() -> Any:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def _xnnpack_quantizer() -> Any:
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated!"
        return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))


QUANTIZERS = {"x86": _x86_quantizer, "xnnpack": _xnnpack_quantizer}
CASES = {c.name: c for c in MODEL_CASES}


# ----------------------------------------------------------------------------- the two flows


@dataclass
class Flows:
    case: ModelCase
    ep: torch.export.ExportedProgram
    torchao: GraphModule
    quantplug: GraphModule


@functools.cache
def run_flows(case_name: str, quantizer_name: str, program_kind: str = "ep") -> Flows:
    """Export once; torchao on ``ep.module()``, quantplug on ``ep`` (or a GraphModule of it)."""
    case = CASES[case_name]
    make_quantizer = QUANTIZERS[quantizer_name]
    ep = case.export()

    ao_prepared = prepare_pt2e(ep.module(), make_quantizer())
    program = ep if program_kind == "ep" else ep.module()
    qp_prepared = quantplug.prepare(program, make_quantizer())
    with torch.no_grad():
        for seed in CALIBRATION_SEEDS:
            batch = case.batch(seed)
            ao_prepared(*batch)
            qp_prepared(*batch)
    return Flows(case, ep, convert_pt2e(ao_prepared), quantplug.convert(qp_prepared))


# ----------------------------------------------------------------------------- graph reading


def _kind(node: Any) -> str:
    if not isinstance(node, Node):
        return repr(type(node).__name__)
    if node.op == "call_function":
        return str(node.target)
    return node.op


def placement(gm: GraphModule) -> Counter[tuple[str, str, tuple[str, ...]]]:
    """Multiset of (Q/DQ op, producer kind, sorted consumer kinds) over Q/DQ call nodes."""
    found: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in QDQ_OPS:
            consumers = tuple(sorted(_kind(u) for u in node.users))
            found[(str(node.target), _kind(node.args[0]), consumers)] += 1
    return found


@dataclass
class Encoding:
    op: str
    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int | None
    quant_min: int
    quant_max: int
    dtype: torch.dtype
    integer_value: torch.Tensor | None = None  # for constants: the stored integer tensor


def _encoding(gm: GraphModule, node: Node) -> Encoding:
    args = [attr_value(gm, a) for a in node.args]
    if node.target in (qd.quantize_per_channel.default, qd.dequantize_per_channel.default):
        scale, zp, axis, qmin, qmax, dtype = args[1:7]
    else:
        scale, zp, qmin, qmax, dtype = args[1:6]
        axis = None
    return Encoding(
        op=str(node.target).split(".")[-2],
        scale=torch.as_tensor(scale, dtype=torch.float64).reshape(-1),
        zero_point=torch.as_tensor(zp, dtype=torch.int64).reshape(-1),
        axis=axis,
        quant_min=int(qmin),
        quant_max=int(qmax),
        dtype=dtype,
    )


def _final_consumers(q: Node) -> tuple[str, ...]:
    """The ops reading a quantized activation (through its DQ copies)."""
    names: list[str] = []
    for dq in q.users:
        if dq.target in DEQUANTIZE_OPS:
            names.extend(u.name for u in dq.users)
        else:
            names.append(dq.name)
    return tuple(sorted(names))


def encodings(gm: GraphModule) -> dict[tuple[Any, ...], Encoding]:
    """Per-tensor encodings: activations by (producer, readers), constants by (reader, arg index)."""
    found: dict[tuple[Any, ...], Encoding] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        src = node.args[0] if node.args else None
        if node.target in QUANTIZE_OPS:
            producer = src.name if isinstance(src, Node) else _kind(src)
            key: tuple[Any, ...] = ("activation", producer, _final_consumers(node))
            enc = _encoding(gm, node)
        elif node.target in DEQUANTIZE_OPS and isinstance(src, Node) and src.op == "get_attr":
            for user in node.users:
                index = next(i for i, a in enumerate(user.args) if a is node)
                key = ("constant", user.name, index)
                enc = _encoding(gm, node)
                enc.integer_value = attr_value(gm, src)
                assert key not in found, f"two constants feed {key}"
                found[key] = enc
            continue
        else:
            continue
        assert key not in found, f"two quantize nodes for {key}"
        found[key] = enc
    return found


def _prefixed(prefix: str) -> Callable[[str], str]:
    def msg(detail: str) -> str:
        return f"{prefix}: {detail}"

    return msg


def _dq_mismatching_q(gm: GraphModule) -> list[str]:
    """Activation DQs whose qparams differ from those of the Q they read (should be none)."""
    bad = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DEQUANTIZE_OPS:
            src = node.args[0]
            if isinstance(src, Node) and src.op == "call_function" and src.target in QUANTIZE_OPS:
                a, b = _encoding(gm, src), _encoding(gm, node)
                if not (torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)):
                    bad.append(f"{src.name} -> {node.name}")
    return bad


# ----------------------------------------------------------------------------- tests


PARAMS = [(c.name, q) for c in MODEL_CASES for q in QUANTIZERS]
IDS = [f"{c}-{q}" for c, q in PARAMS]


@pytest.mark.parametrize(("case_name", "quantizer_name"), PARAMS, ids=IDS)
def test_same_qdq_placement(case_name: str, quantizer_name: str) -> None:
    flows = run_flows(case_name, quantizer_name)
    ao, qp = placement(flows.torchao), placement(flows.quantplug)
    assert sum(ao.values()) > 0, "torchao inserted no Q/DQ: the test model is not being quantized"
    only_ao, only_qp = ao - qp, qp - ao
    assert not only_ao and not only_qp, (
        f"placement differs.\nonly in torchao: {dict(only_ao)}\nonly in quantplug: {dict(only_qp)}"
    )


@pytest.mark.parametrize(("case_name", "quantizer_name"), PARAMS, ids=IDS)
def test_no_weight_quantize_left_and_int_constants(case_name: str, quantizer_name: str) -> None:
    """Both store constants as integers: no quantize op reads a get_attr, the DQ input is integer."""
    flows = run_flows(case_name, quantizer_name)
    for label, gm in (("torchao", flows.torchao), ("quantplug", flows.quantplug)):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in QUANTIZE_OPS:
                assert node.args[0].op != "get_attr", f"{label}: {node.name} quantizes a constant at run time"
        consts = [e for k, e in encodings(gm).items() if k[0] == "constant"]
        assert consts, f"{label}: no quantized constants"
        for enc in consts:
            assert enc.integer_value is not None and not enc.integer_value.is_floating_point()
            assert enc.integer_value.dtype == enc.dtype


@pytest.mark.parametrize(("case_name", "quantizer_name"), PARAMS, ids=IDS)
def test_same_scales_and_zero_points(case_name: str, quantizer_name: str) -> None:
    flows = run_flows(case_name, quantizer_name)
    ao, qp = encodings(flows.torchao), encodings(flows.quantplug)
    assert set(ao) == set(qp), (
        f"quantized tensors differ.\nonly in torchao: {sorted(set(ao) - set(qp))}\n"
        f"only in quantplug: {sorted(set(qp) - set(ao))}"
    )
    for key in ao:
        a, q = ao[key], qp[key]
        where = f"{key}"
        grid_a = (a.op, a.axis, a.quant_min, a.quant_max, a.dtype)
        grid_q = (q.op, q.axis, q.quant_min, q.quant_max, q.dtype)
        assert grid_a == grid_q, f"{where}: torchao {grid_a} vs quantplug {grid_q}"
        torch.testing.assert_close(q.scale, a.scale, rtol=1e-6, atol=0, msg=_prefixed(f"{where} scale"))
        torch.testing.assert_close(q.zero_point, a.zero_point, rtol=0, atol=0, msg=_prefixed(f"{where} zp"))
        if a.integer_value is not None:
            assert q.integer_value is not None
            assert a.integer_value.shape == q.integer_value.shape, where
            torch.testing.assert_close(
                q.integer_value, a.integer_value, rtol=0, atol=0, msg=_prefixed(f"{where} integer values")
            )
    assert not _dq_mismatching_q(flows.quantplug)


@pytest.mark.parametrize(("case_name", "quantizer_name"), PARAMS, ids=IDS)
def test_same_outputs_on_held_out_inputs(case_name: str, quantizer_name: str) -> None:
    flows = run_flows(case_name, quantizer_name)
    float_model = flows.ep.module()
    with torch.no_grad():
        for seed in HELD_OUT_SEEDS:
            batch = flows.case.batch(seed)
            expected = flows.torchao(*batch)
            got = flows.quantplug(*batch)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            # and it is a quantized model, not the float one
            assert not torch.equal(got, float_model(*batch))


@pytest.mark.parametrize("quantizer_name", list(QUANTIZERS))
@pytest.mark.parametrize("case_name", [c.name for c in MODEL_CASES])
def test_graphmodule_input_gives_same_result(case_name: str, quantizer_name: str) -> None:
    """prepare() on ``ep.module()`` instead of the ExportedProgram: same program."""
    from_ep = run_flows(case_name, quantizer_name, "ep")
    from_gm = run_flows(case_name, quantizer_name, "gm")
    assert placement(from_gm.quantplug) == placement(from_ep.torchao)
    ao, qp = encodings(from_gm.torchao), encodings(from_gm.quantplug)
    assert set(ao) == set(qp)
    for key in ao:
        torch.testing.assert_close(qp[key].scale, ao[key].scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(qp[key].zero_point, ao[key].zero_point, rtol=0, atol=0)
    batch = from_gm.case.batch(HELD_OUT_SEEDS[0])
    with torch.no_grad():
        torch.testing.assert_close(from_gm.quantplug(*batch), from_gm.torchao(*batch), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- no mutation


def _snapshot_graph(gm: GraphModule) -> list[tuple[str, str, str]]:
    return [(n.name, n.op, str(n.target)) for n in gm.graph.nodes]


def _annotated_nodes(gm: GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if "quantization_annotation" in n.meta]


def _state(module: torch.nn.Module | torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    if isinstance(module, torch.export.ExportedProgram):
        items = {**module.state_dict, **{f"constant:{k}": v for k, v in module.constants.items()}}
    else:
        items = module.state_dict()
    return {k: v.detach().clone() for k, v in items.items() if isinstance(v, torch.Tensor)}


def _assert_same_state(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} was modified"


@pytest.mark.parametrize("quantizer_name", list(QUANTIZERS))
@pytest.mark.parametrize("case_name", [c.name for c in MODEL_CASES])
def test_prepare_does_not_mutate_exported_program(case_name: str, quantizer_name: str) -> None:
    case = CASES[case_name]
    ep = case.export()
    graph_before = _snapshot_graph(ep.graph_module)
    sig_before = str(ep.graph_signature)
    state_before = _state(ep)
    batch = case.batch(7)
    with torch.no_grad():
        out_before = ep.module()(*batch)

    prepared = quantplug.prepare(ep, QUANTIZERS[quantizer_name]())
    with torch.no_grad():
        for seed in CALIBRATION_SEEDS:
            prepared(*case.batch(seed))
    quantplug.convert(prepared)

    assert _snapshot_graph(ep.graph_module) == graph_before
    assert len(ep.graph.nodes) == len(graph_before)
    assert str(ep.graph_signature) == sig_before
    assert not _annotated_nodes(ep.graph_module)
    _assert_same_state(state_before, _state(ep))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*batch), out_before, rtol=0, atol=0)


@pytest.mark.parametrize("quantizer_name", list(QUANTIZERS))
@pytest.mark.parametrize("case_name", [c.name for c in MODEL_CASES])
def test_prepare_does_not_mutate_graph_module(case_name: str, quantizer_name: str) -> None:
    case = CASES[case_name]
    ep = case.export()
    gm = ep.module()
    graph_before = _snapshot_graph(gm)
    code_before = gm.code
    state_before = _state(gm)
    attrs_before = (
        {name for name, _ in gm.named_children()}
        | set(dict(gm.named_buffers()))
        | set(dict(gm.named_parameters()))
    )
    batch = case.batch(7)
    with torch.no_grad():
        out_before = gm(*batch)

    prepared = quantplug.prepare(gm, QUANTIZERS[quantizer_name]())
    assert prepared is not gm and prepared.graph is not gm.graph
    with torch.no_grad():
        for seed in CALIBRATION_SEEDS:
            prepared(*case.batch(seed))
    quantplug.convert(prepared)

    assert _snapshot_graph(gm) == graph_before
    assert gm.code == code_before
    assert not _annotated_nodes(gm)
    attrs_after = (
        {name for name, _ in gm.named_children()}
        | set(dict(gm.named_buffers()))
        | set(dict(gm.named_parameters()))
    )
    assert attrs_after == attrs_before, f"new attributes on the caller's module: {attrs_after - attrs_before}"
    _assert_same_state(state_before, _state(gm))
    with torch.no_grad():
        torch.testing.assert_close(gm(*batch), out_before, rtol=0, atol=0)


def test_torchao_prepare_does_mutate_its_input() -> None:
    """Why the comparison runs torchao on its own ``ep.module()``: torchao shares the graph (B4)."""
    case = CASES["convnet"]
    ep = case.export()
    gm = ep.module()
    before = len(gm.graph.nodes)
    prepare_pt2e(gm, _x86_quantizer())
    assert len(gm.graph.nodes) != before


def test_cat_inputs_share_the_output_encoding_xnnpack() -> None:
    """XNNPACK annotates cat with SharedQuantizationSpec: both branches and the output share qparams.

    Only with strict export: the rule finds cat through ``source_fn_stack``, which non-strict export
    does not record, so on the non-strict ``cat_branches`` case neither flow quantizes cat itself.
    """
    flows = run_flows("cat_branches_strict", "xnnpack")
    for label, gm in (("torchao", flows.torchao), ("quantplug", flows.quantplug)):
        enc = encodings(gm)
        cat_out = enc[("activation", "cat", ("conv2d_3",))]
        for branch in (("activation", "relu_1", ("cat",)), ("activation", "conv2d_2", ("cat",))):
            assert torch.equal(enc[branch].scale, cat_out.scale), f"{label}: {branch} not shared with cat"
            assert torch.equal(enc[branch].zero_point, cat_out.zero_point), label


def test_comparators_see_differences() -> None:
    """The checks above are not vacuous: a different quantizer or one changed scale is caught."""
    x86, xnn = run_flows("convnet", "x86"), run_flows("convnet", "xnnpack")
    assert placement(x86.quantplug) != placement(xnn.quantplug)

    gm = copy.deepcopy(x86.quantplug)
    q = next(n for n in gm.graph.nodes if n.target == qd.quantize_per_tensor.default)
    q.args = (q.args[0], q.args[1] * (1 + 1e-5), *q.args[2:])
    gm.recompile()
    before, after = encodings(x86.quantplug), encodings(gm)
    changed = [k for k in before if not torch.allclose(before[k].scale, after[k].scale, rtol=1e-6, atol=0)]
    assert len(changed) == 1
    assert _dq_mismatching_q(gm)


def _reader_summary(entries: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """_quantplug.flow.inspect.encodings() entries, normalized: activations by tensor, constants by value."""
    activations, constants = [], []
    for e in entries:
        scale = tuple(float(s) for s in (e["scale"] if isinstance(e["scale"], list) else [e["scale"]]))
        zp = tuple(e["zero_point"] if isinstance(e["zero_point"], list) else [e["zero_point"]])
        grid = (e["granularity"], e["dtype"], e.get("axis"), e["quant_min"], e["quant_max"], scale, zp)
        if e["kind"] == "activation":
            activations.append((e["tensor"], *grid))
        else:
            constants.append(grid)
    return sorted(activations, key=repr), sorted(constants, key=repr)


@pytest.mark.parametrize(("case_name", "quantizer_name"), PARAMS, ids=IDS)
def test_encodings_reader_agrees_on_both_programs(case_name: str, quantizer_name: str) -> None:
    """quantplug's encodings reader reads torchao's converted program and ours alike."""
    from _quantplug.flow.inspect import encodings as read_encodings

    flows = run_flows(case_name, quantizer_name)
    ao_act, ao_const = _reader_summary(read_encodings(flows.torchao))
    qp_act, qp_const = _reader_summary(read_encodings(flows.quantplug))
    assert qp_act == ao_act
    assert qp_const == ao_const
    ours = encodings(flows.quantplug)
    assert len(qp_act) == sum(1 for k in ours if k[0] == "activation")
    assert len(qp_const) == len({id(e.integer_value) for k, e in ours.items() if k[0] == "constant"})
