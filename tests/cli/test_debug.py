"""quantplug.debug.compare: node-by-node float vs quantized, through the debug handles."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.demo.model import demo_calibration, demo_model
from quantplug.debug import DebugReport, compare


def _installed(name: str) -> bool:
    return any(e.name == name and e.status in ("available", "loaded") for e in quantplug.list_backends())


def _quantize(program, backend: str, batches, **options):
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for b in batches:
            prepared(*b)
    return prepared, quantplug.convert(prepared)


@pytest.fixture(scope="module")
def demo():
    model, example = demo_model()
    program = torch.export.export(model, example)
    return model, program, demo_calibration(8)


@pytest.mark.parametrize("backend", ["reference", "example_vendor", "qnn_htp"])
def test_compare_every_backend(backend: str, demo) -> None:
    if not _installed(backend):
        pytest.skip(f"{backend} not installed")
    model, program, batches = demo
    prepared, quantized = _quantize(program, backend, batches)
    report = compare(program, quantized, batches[:3], prepared=prepared)
    assert isinstance(report, DebugReport)
    assert report.batches == 3
    names = {n.node for n in report.nodes}
    assert {"conv2d", "relu", "conv2d_1", "add", "linear"} <= names
    for n in report.nodes:
        assert n.sqnr_db is not None and n.sqnr_db > 15, (n.node, n.sqnr_db, n.note)
        assert n.max_abs_error is not None and n.max_abs_error >= 0
    # batch norm folded into the conv: compared with the batch norm's float output
    conv = report.node("conv2d")
    assert conv.float_node == "batch_norm" and "folded" in conv.note
    assert {r.node for r in report.removed_nodes} == {"batch_norm", "batch_norm_1"}
    # the model output, computed independently
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in batches[:3]])
        out = torch.cat([quantized(*b) for b in batches[:3]])
    expected = 10 * math.log10(float(ref.double().pow(2).sum() / (out.double() - ref.double()).pow(2).sum()))
    assert report.output_sqnr_db == pytest.approx(expected, abs=1e-6)
    # sharing groups with every key from the prepared state, encodings from the program
    assert report.sharing_groups
    assert all(g.members for g in report.sharing_groups)
    assert any(g.kind == "constant" and g.granularity == "channel" for g in report.sharing_groups)
    assert "worst nodes" in report.format()


def test_float_nodes_and_reasons(demo) -> None:
    if not _installed("example_vendor"):
        pytest.skip("example_vendor not installed")
    _, program, batches = demo
    _, quantized = _quantize(program, "example_vendor", batches)
    report = compare(program, quantized, batches[:2])
    reasons = {f.node: f.reason for f in report.float_nodes}
    assert set(reasons) == {"max_pool2d", "mean"}
    assert all("no rule" in r for r in reasons.values())
    assert not report.node("mean").quantized
    assert report.node("conv2d").quantized


def test_discarded_node_is_float_and_exact_without_upstream_error() -> None:
    """A node kept float by an override: reported with the override as its reason."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    example = (torch.randn(2, 8),)
    program = torch.export.export(model, example)
    quantizer = quantplug.get_quantizer("reference").discard(nodes=["linear_1"])
    prepared = quantplug.prepare(program, quantizer)
    prepared(*example)
    quantized = quantplug.convert(prepared)
    report = compare(program, quantized, example)
    reasons = {f.node: f.reason for f in report.float_nodes}
    assert "linear_1" in reasons and "override" in reasons["linear_1"]
    assert report.node("linear").quantized
    assert report.worst(1)[0].sqnr_db <= min(n.sqnr_db for n in report.nodes)


def test_compare_never_modifies_the_models(demo) -> None:
    model, program, batches = demo
    _, quantized = _quantize(program, "reference", batches)
    model.train()  # compare must neither switch it to eval nor update batch-norm statistics
    state = copy.deepcopy(model.state_dict())
    graph_before = str(quantized.graph)
    q_state = {k: v.clone() for k, v in quantized.state_dict().items()}
    report = compare(model, quantized, batches[:2])  # an nn.Module: exported on a copy
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert str(quantized.graph) == graph_before
    for k, v in quantized.state_dict().items():
        assert torch.equal(v, q_state[k]), k
    assert report.output_sqnr_db is not None and report.output_sqnr_db > 20


def test_identical_programs_are_reported_as_identical() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    example = (torch.randn(3, 4),)
    program = torch.export.export(model, example)
    quantizer = quantplug.get_quantizer("reference").discard(nodes=["linear", "relu"])
    prepared = quantplug.prepare(program, quantizer)
    prepared(*example)
    quantized = quantplug.convert(prepared)
    report = compare(program, quantized, example)
    assert report.output_sqnr_db == math.inf
    assert all(n.sqnr_db == math.inf for n in report.nodes)
    assert all(d["identical"] and d["sqnr_db"] is None for d in report.to_dict()["nodes"])


def test_rejects_a_prepared_module(demo) -> None:
    _, program, batches = demo
    prepared, _ = _quantize(program, "reference", batches[:1])
    with pytest.raises(quantplug.QuantplugError, match="prepared"):
        compare(program, prepared, batches[:1])


def test_compare_takes_keyword_inputs() -> None:
    """dicts, Calls and all-positional batches of a program with keyword inputs give one report."""
    from _quantplug.errors import QuantplugError
    from quantplug.debug import Call
    from tests.cli._models import keyword_batches, keyword_inputs

    model, example = keyword_inputs()
    program = torch.export.export(model, (), example)
    batches = keyword_batches(4)
    quantizer = quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for b in batches:
            prepared(**b)
    quantized = quantplug.convert(prepared)
    by_name = compare(program, quantized, batches)
    as_calls = compare(program, quantized, [Call((), b) for b in batches])
    by_position = compare(program, quantized, [(b["x"], b["mask"]) for b in batches])
    from_module = compare(model, quantized, batches)  # exported again with the keyword example
    for report in (as_calls, by_position, from_module):
        assert [(n.node, n.sqnr_db) for n in report.nodes] == [(n.node, n.sqnr_db) for n in by_name.nodes]
    assert {"linear", "linear_1"} <= {n.node for n in by_name.nodes}
    assert by_name.output_sqnr_db is not None and by_name.output_sqnr_db > 15
    with torch.no_grad():
        expected = torch.cat([model(**b) for b in batches]).double()
        got = torch.cat([quantized(**b) for b in batches]).double()
    sqnr = 10 * math.log10(float(expected.pow(2).sum() / (got - expected).pow(2).sum()))
    assert by_name.output_sqnr_db == pytest.approx(sqnr, abs=1e-6)
    with pytest.raises(QuantplugError, match=r"keyword x, masks.*takes keyword x, mask"):
        compare(program, quantized, [{"x": batches[0]["x"], "masks": batches[0]["mask"]}])
    with pytest.raises(QuantplugError, match="keys must be the input names"):
        compare(program, quantized, [{0: batches[0]["x"]}])


class InPlaceBlock(nn.Module):
    """conv -> batch norm -> SiLU(inplace=True), twice (torchvision's EfficientNet stem)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.b2(self.c2(self.act(self.b1(self.c1(x))))))


@pytest.mark.parametrize("backend", ["reference", "qnn_htp"])
def test_in_place_ops_and_decomposed_ops_are_compared_with_the_right_value(backend: str) -> None:
    """The float program's ``silu_`` overwrites the batch norm's output after it was captured, and
    qnn_htp rewrites silu into sigmoid * x: every compared value must still be the float value of
    the same op (at 16 bits, no quantized op here is below 40 dB)."""
    if not _installed(backend):
        pytest.skip(f"{backend} not installed")
    torch.manual_seed(0)
    model = InPlaceBlock().eval()
    batches = [(torch.randn(2, 3, 8, 8),)] * 3  # one batch: the ranges hold it exactly, nothing clips
    program = torch.export.export(model, batches[0])
    options = {"precision": "16a16w"} if backend == "qnn_htp" else {"preset": "a16w8"}
    _, quantized = _quantize(program, backend, batches, **options)
    report = compare(program, quantized, batches)
    compared = [n for n in report.nodes if n.sqnr_db is not None]
    assert {n.float_node for n in compared} >= {"batch_norm", "batch_norm_1"}
    for n in compared:
        assert n.sqnr_db > 40, (n.node, n.float_node, n.sqnr_db)
    pieces = [n for n in report.nodes if n.float_node is None]
    if backend == "qnn_htp":  # the sigmoid of each silu is a piece, compared where silu's value leaves
        assert [n.op for n in pieces] == ["aten.sigmoid.default"] * 2, pieces
        assert all("intermediate piece of silu_" in n.note for n in pieces)
