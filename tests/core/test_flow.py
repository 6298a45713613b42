"""prepare/convert behaviour that is backend-independent: copies, errors, export round trips, memory."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch

import quantplug
from _quantplug.demo.model import demo_calibration, demo_model
from _quantplug.meta import observer_gid
from quantplug import CalibrationError, ConversionError, QuantplugError


def _prepared(
    qat: bool = False,
) -> tuple[torch.nn.Module, torch.export.ExportedProgram, torch.fx.GraphModule]:
    model, example = demo_model()
    ep = torch.export.export(model, example)
    return model, ep, quantplug.prepare(ep, quantplug.get_quantizer("reference"), qat=qat)


def test_convert_without_calibration_names_the_node() -> None:
    _, _, prepared = _prepared()
    with pytest.raises(CalibrationError, match=r"input 'x' of node 'conv2d' never saw data"):
        quantplug.convert(prepared)


def test_convert_of_an_unprepared_module() -> None:
    model, example = demo_model()
    with pytest.raises(ConversionError, match=r"not produced by quantplug\.prepare"):
        quantplug.convert(torch.export.export(model, example).module())


def test_prepare_rejects_non_programs_and_non_quantizers() -> None:
    model, example = demo_model()
    with pytest.raises(QuantplugError, match=r"torch\.export\.export"):
        quantplug.prepare(model, quantplug.get_quantizer("reference"))
    with pytest.raises(QuantplugError, match="not a quantizer"):
        quantplug.prepare(torch.export.export(model, example), object())


def test_caller_program_and_graph_module_untouched() -> None:
    model, example = demo_model()
    ep = torch.export.export(model, example)
    before = [n.name for n in ep.graph.nodes]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gm = ep.module()
    gm_nodes = len(gm.graph.nodes)
    q = quantplug.get_quantizer("reference")
    for program in (ep, gm):
        prepared = quantplug.prepare(program, q)
        for batch in demo_calibration(2):
            prepared(*batch)
        quantplug.convert(prepared)
    assert [n.name for n in ep.graph.nodes] == before
    assert len(gm.graph.nodes) == gm_nodes
    assert not any("quantization_annotation" in n.meta for n in gm.graph.nodes)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


def test_weights_are_stored_as_integers_and_observed_once() -> None:
    _, _, prepared = _prepared()
    # observers of weights are parked: their node is the weight's reader's argument (as torchao's
    # weight observers are), and it passes the weight through
    observed = [
        n for n in prepared.graph.nodes if n.op == "call_module" and observer_gid(n.target) is not None
    ]
    parked = [n for n in observed if n.args[0].op == "get_attr"]
    assert parked and all(n.users for n in parked)
    assert all(n not in user.args[0:1] for n in parked for user in n.users)  # read as a weight or bias
    for batch in demo_calibration(4):
        prepared(*batch)
    converted = quantplug.convert(prepared)
    int_buffers = [b for b in converted.buffers() if b.dtype in (torch.int8, torch.int32)]
    assert len(int_buffers) >= 6  # three weights, three int32 biases
    assert not [p for p in converted.parameters() if p.dim() == 4]  # no float conv weight left


def test_converted_program_exports_saves_and_loads() -> None:
    _, _, prepared = _prepared()
    example = demo_model()[1]
    for batch in demo_calibration(4):
        prepared(*batch)
    converted = quantplug.convert(prepared)
    expected = converted(*example)
    exported = torch.export.export(converted, example)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    torch.testing.assert_close(loaded.module()(*example), expected)
    ops = {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert "quantized_decomposed.quantize_per_tensor.default" in ops


def test_qat_fake_quant_trains_and_converts() -> None:
    _, _, prepared = _prepared(qat=True)
    opt = torch.optim.SGD([p for p in prepared.parameters() if p.requires_grad], lr=1e-3)
    for batch in demo_calibration(3):
        loss = prepared(*batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    converted = quantplug.convert(prepared)
    assert converted(*demo_model()[1]).shape == (1, 10)


def test_no_model_kept_alive_after_the_flow() -> None:
    model, example = demo_model()
    ep = torch.export.export(model, example)
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference"))
    for batch in demo_calibration(2):
        prepared(*batch)
    converted = quantplug.convert(prepared)
    refs = [weakref.ref(x) for x in (model, ep, prepared, converted)]
    del model, ep, prepared, converted
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def test_prepared_module_attributes_behave_as_a_modules() -> None:
    """Top-level submodules are read through a descriptor on the prepared module's class (the
    generated code reads an observer per call): setting, deleting, re-adding and shadowing them
    behaves as on any module, and observer node names still resolve."""
    model, args = demo_model()
    prepared = quantplug.prepare(torch.export.export(model, args), quantplug.get_quantizer("reference"))
    names = [n for n, _ in prepared.named_children() if n.startswith("activation_post_process_")]
    name, other = names[0], names[1]
    observer = getattr(prepared, name)
    assert observer is prepared.get_submodule(name)
    calls = [n for n in prepared.graph.nodes if n.op == "call_module" and n.name != n.target]
    if calls:  # a group observed at more than one key: the second node's name reaches its module
        assert getattr(prepared, calls[0].name) is prepared.get_submodule(str(calls[0].target))
    replacement = copy.deepcopy(observer)
    setattr(prepared, name, replacement)
    assert getattr(prepared, name) is replacement
    delattr(prepared, name)
    assert not hasattr(prepared, name)  # its graph node keeps the name: no alias to itself
    with pytest.raises(AttributeError):
        getattr(prepared, name)
    prepared.register_buffer(name, torch.ones(2))
    assert torch.equal(getattr(prepared, name), torch.ones(2))
    delattr(prepared, name)
    prepared.add_module(name, observer)
    assert getattr(prepared, name) is observer
    setattr(prepared, other, None)  # a submodule slot emptied, as Module allows
    assert getattr(prepared, other) is None
    object.__setattr__(prepared, name, "shadow")  # the instance __dict__ comes first, as ever
    assert getattr(prepared, name) == "shadow"


@pytest.mark.parametrize("backend", ["reference", "qnn_htp"])
def test_deep_copy_of_a_prepared_module_calibrates_and_converts_on_its_own(backend: str) -> None:
    # both backends derive their bias grids from the input's and the weight's (specs holding
    # graph nodes): deep-copying those once dragged the graph's fake tensors along and failed
    model, example = demo_model()
    prepared = quantplug.prepare(torch.export.export(model, example), quantplug.get_quantizer(backend))
    batches = list(demo_calibration(3))
    prepared(*batches[0])
    twin = copy.deepcopy(prepared)
    seen = {k: v.clone() for k, v in prepared.state_dict().items()}
    for batch in batches[1:]:
        twin(*batch)
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in seen.items())  # the original untouched
    for batch in batches[1:]:
        prepared(*batch)
    ours, theirs = quantplug.convert(prepared), quantplug.convert(twin)
    assert ours.code == theirs.code
    assert torch.equal(ours(*example), theirs(*example))
