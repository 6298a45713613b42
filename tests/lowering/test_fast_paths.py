"""The shortcuts that make lowering fast (issue 12.10) give what the long way gives.

Each test runs a shortcut against the path it replaces on real exported models and compares the
files, or checks the state the shortcut must leave behind. ``python -m bench.lowering_identity``
compares whole artifacts with the ones recorded before the shortcuts.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import quantplug
from _quantplug.lowering.onnx import capture
from _quantplug.lowering.onnx.export import export_qdq_onnx
from _quantplug.peers import onnx_translate

from .models import batches, build, quantize

onnx = pytest.importorskip("onnx")
pytest.importorskip("quantplug_qnn_htp")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _converted(model: str, precision: str = "16a8w") -> tuple[quantplug.Quantizer, torch.fx.GraphModule]:
    net, shape = build(model)
    program = torch.export.export(net, batches(shape, 1, seed=0)[0])
    calibration: list[tuple[torch.Tensor, ...]] = [tuple(b) for b in batches(shape, 2, seed=1)]
    return quantize(program, "qnn_htp", {"precision": precision}, calibration)


@pytest.mark.parametrize("model", ["transformer_block", "lstm", "sdpa", "constants"])
def test_renumbering_gives_the_version_converters_model(monkeypatch, model: str) -> None:  # type: ignore[no-untyped-def]
    """Opset 18 -> 21 without onnxscript's converter: the same model and encodings, byte for byte."""
    quantizer, converted = _converted(model)
    renumbered: list[bool] = []
    renumber = onnx_translate._renumber

    def spy(model: Any, opset: int) -> bool:
        renumbered.append(renumber(model, opset))
        return renumbered[-1]

    def outputs() -> tuple[dict[str, Any], bytes]:
        unoptimized = export_qdq_onnx(converted, optimize=False).model_bytes()
        return quantplug.lower(converted, quantizer).files, unoptimized

    monkeypatch.setattr(onnx_translate, "_renumber", spy)
    fast, fast_unoptimized = outputs()
    assert renumbered == [True, True]
    monkeypatch.setattr(onnx_translate, "_renumber", lambda model, opset: False)
    slow, slow_unoptimized = outputs()
    assert fast["model.onnx"] == slow["model.onnx"]
    assert fast["model.encodings"] == slow["model.encodings"]
    assert fast_unoptimized == slow_unoptimized


def test_an_op_the_converter_adapts_takes_the_converter() -> None:
    """GroupNormalization changed in opset 21 (its scale and bias became per-channel): renumbering
    it would be wrong, so the converter runs."""
    import onnx_ir as ir

    def model(op: str, inputs: int, **attrs: int) -> Any:
        values = [
            ir.Value(name=f"x{i}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4, 2, 2]))
            for i in range(inputs)
        ]
        node = ir.node(op, values, attrs, version=18)
        return ir.Model(ir.Graph(values, node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=10)

    adapted = model("GroupNormalization", 3, num_groups=2)
    assert not onnx_translate._renumber(adapted, 21)
    assert adapted.opset_imports[""] == 18 and next(iter(adapted.graph)).version == 18  # untouched
    plain = model("Relu", 1)
    assert onnx_translate._renumber(plain, 21)
    assert plain.opset_imports[""] == 21 and next(iter(plain.graph)).version == 21


def test_sites_of_one_shape_share_a_value_of_their_own_dtype() -> None:
    """Every Q/DQ site of the program gets a value with its own dtype and its input's shape."""
    from _quantplug.lowering.onnx import qdq_sites

    _, converted = _converted("transformer_block")
    sites = qdq_sites.find_sites(converted)
    program = capture.to_exported_program(converted, rewrite=lambda g: qdq_sites.mark_sites(g, sites))
    marked = [n for n in program.graph.nodes if n.target is qdq_sites.qdq_site]
    assert len(marked) == len(sites)
    for node in marked:
        site = sites[node.args[1]]
        val, x_val = node.meta["val"], node.args[0].meta["val"]
        assert val.dtype == (site.dtype if site.quantize else site.out_dtype)
        assert val.shape == x_val.shape
    assert len({id(n.meta["val"]) for n in marked}) < len(marked)


def test_the_wrapped_program_compiles_on_first_use_and_runs_the_same() -> None:
    from torch.export import exported_program

    hook = exported_program._create_graph_module_for_export
    _, converted = _converted("constants")
    program = capture.to_exported_program(converted)
    assert exported_program._create_graph_module_for_export is hook  # torch's own, restored
    assert type(program.graph_module).__mro__[1].__name__ == "_LazyGraphModule"
    x = batches(build("constants")[1], 1, seed=3)[0][0]
    torch.testing.assert_close(program.module()(x), converted(x))


@pytest.mark.parametrize("enabled", [True, False])
def test_lower_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    quantizer, converted = _converted("transformer_block")
    collections: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    was = gc.isenabled()
    gc.callbacks.append(count)
    try:
        if not enabled:
            gc.disable()
        quantplug.lower(converted, quantizer)
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(count)
        if was:
            gc.enable()
    # held while lowering: one young collection at the end (none if the caller had disabled it)
    assert collections == ([0] if enabled else [])
