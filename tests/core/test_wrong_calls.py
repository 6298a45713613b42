"""Calls with the wrong object or nonsense options fail up front, typed and named (issue 12.3,
12.5): the valid range or the reason, never a bare AssertionError or a silent success."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.errors import LoweringError, OptionError, QuantplugError


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(Small().eval(), (torch.randn(2, 8),))


@pytest.fixture(scope="module")
def quantized(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    prepared(torch.randn(2, 8))
    return quantplug.convert(prepared)


# ------------------------------------------------------------------------------------------------
# options out of range (the backend's declared schema)
# ------------------------------------------------------------------------------------------------

OUT_OF_RANGE = [
    ("qnn_htp", {"eps": math.nan}, "eps.*finite and > 0 and <= 1"),
    ("qnn_htp", {"eps": 1e30}, "eps.*<= 1"),
    ("qnn_htp", {"eps": 0.0}, "eps.*> 0"),
    ("qnn_htp", {"mask_margin": math.inf}, "mask_margin.*finite"),
    ("qnn_htp", {"mask_margin": -1.0}, "mask_margin.*> 0"),
    ("qnn_htp", {"block_size": 10**6}, "block_size.*<= 65536"),
    ("qnn_htp", {"block_size": -2}, "block_size.*>= 0"),
    ("qnn_htp", {"block_size_map": "linear:16"}, "block_size_map.*only when precision is 16a4w_block"),
    ("reference", {"onnx_opset": 999}, "onnx_opset.*<= 27"),
    ("reference", {"onnx_opset": 12}, "onnx_opset.*>= 18"),
    ("reference", {"ort_threads": -3}, "ort_threads.*>= 0"),
]


@pytest.mark.parametrize(("backend", "options", "message"), OUT_OF_RANGE, ids=lambda v: str(v))
def test_nonsense_options_are_rejected_with_the_valid_range(
    backend: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(OptionError, match=message):
        quantplug.get_quantizer(backend, **options)


def test_in_range_values_still_work() -> None:
    quantplug.get_quantizer("qnn_htp", eps=1e-5, mask_margin=8.0, block_size=0)
    quantplug.get_quantizer("qnn_htp", precision="16a4w_block", block_size_map="linear:16")
    quantplug.get_quantizer("reference", onnx_opset=23, ort_threads=2)


def test_every_backend_gets_the_checks_from_its_declaration() -> None:
    """A third-party backend declares ranges; the core enforces them (no code in the plugin)."""

    class Plugin:
        @quantplug.hookimpl
        def quantplug_backend_info(self) -> quantplug.BackendInfo:
            return quantplug.BackendInfo(
                "ranged",
                "declares ranges",
                options=(
                    quantplug.BackendOption("gain", float, 1.0, minimum=0.5, maximum=2.0),
                    quantplug.BackendOption("mode", str, "a", choices=("a", "b")),
                    quantplug.BackendOption("extra", int, None, applies_with={"mode": ("b",)}),
                    quantplug.BackendOption(
                        "even", int, 2, check=lambda v: None if v % 2 == 0 else "it must be even"
                    ),
                ),
            )

    from _quantplug.plugins.registry import load_backend

    with quantplug.registered_backend("ranged", Plugin()):
        info = load_backend("ranged").info
        with pytest.raises(OptionError, match=r"'gain'.*>= 0.5 and <= 2"):
            info.resolve_options({"gain": 3.0})
        with pytest.raises(OptionError, match=r"'gain'.*finite"):
            info.resolve_options({"gain": "nan"})
        with pytest.raises(OptionError, match=r"applies only when mode is b"):
            info.resolve_options({"extra": 3})
        with pytest.raises(OptionError, match=r"'even' of backend 'ranged' got 3: it must be even"):
            info.resolve_options({"even": 3})
        with pytest.raises(OptionError, match=r"did you mean 'mode'"):
            info.resolve_options({"mdoe": "a"})
        assert info.resolve_options({"mode": "b", "extra": 3, "gain": "0.5"})["gain"] == 0.5


# ------------------------------------------------------------------------------------------------
# QAT and set_module_name
# ------------------------------------------------------------------------------------------------


def test_qat_option_without_qat_prepare_and_the_converse(program: torch.export.ExportedProgram) -> None:
    with pytest.raises(QuantplugError, match=r"built with qat=True.*prepare\(\) was called without qat=True"):
        quantplug.prepare(program, quantplug.get_quantizer("qnn_htp", qat=True))
    with pytest.raises(QuantplugError, match=r"qat=True\) with a 'qnn_htp' quantizer built without qat=True"):
        quantplug.prepare(program, quantplug.get_quantizer("qnn_htp"), qat=True)
    quantplug.prepare(program, quantplug.get_quantizer("qnn_htp", qat=True), qat=True)


def test_set_module_name_naming_no_module(program: torch.export.ExportedProgram) -> None:
    quantizer = quantplug.get_quantizer("reference").set_module_name("encodr", None)
    with pytest.raises(
        OptionError, match=r"set_module_name\('encodr'\) names no module.*did you mean 'encoder'"
    ):
        quantplug.prepare(program, quantizer)
    ok = quantplug.get_quantizer("reference").set_module_name("encoder", None)
    quantplug.prepare(program, ok)
    quantplug.prepare(program, quantplug.get_quantizer("reference").set_module_name("encoder.0", None))


def test_set_block_size_map_needs_the_block_precision() -> None:
    from quantplug_qnn_htp import set_block_size_map

    with pytest.raises(OptionError, match="only to precision 16a4w_block"):
        set_block_size_map(quantplug.get_quantizer("qnn_htp", precision="16a8w"), {"linear": 16})


# ------------------------------------------------------------------------------------------------
# the wrong object
# ------------------------------------------------------------------------------------------------


def test_lower_with_another_backends_quantizer(quantized: torch.fx.GraphModule) -> None:
    with pytest.raises(LoweringError, match=r"quantized for backend 'reference'.*got a 'qnn_htp' quantizer"):
        quantplug.lower(quantized, quantplug.get_quantizer("qnn_htp"))


def test_lower_a_float_or_prepared_program(program: torch.export.ExportedProgram) -> None:
    quantizer = quantplug.get_quantizer("reference")
    with pytest.raises(LoweringError, match="float program"):
        quantplug.lower(program.module(), quantizer)
    with pytest.raises(LoweringError, match="float program"):
        quantplug.lower(program, quantizer)
    with pytest.raises(LoweringError, match="prepared module"):
        quantplug.lower(quantplug.prepare(program, quantizer), quantizer)


def test_prepare_an_already_prepared_module(program: torch.export.ExportedProgram) -> None:
    """A converted program may be prepared again (re-entrant quantization, tests/pt2e); a prepared
    one may not: its observers are not Q/DQ ops yet."""
    quantizer = quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(program, quantizer)
    with pytest.raises(QuantplugError, match=r"already prepared.*convert it first") as info:
        quantplug.prepare(prepared, quantizer)
    assert not isinstance(info.value, quantplug.AnnotationError)


def test_compare_with_a_wrong_input_shape(program: torch.export.ExportedProgram, quantized: Any) -> None:
    with pytest.raises(QuantplugError, match=r"input 'x' has shape \(3, 5\).*expects \(2, 8\) float32"):
        quantplug.debug.compare(program, quantized, [(torch.randn(3, 5),)])
    with pytest.raises(QuantplugError, match=r"dtype float64.*expects \(2, 8\) float32"):
        quantplug.debug.compare(program, quantized, [(torch.randn(2, 8, dtype=torch.float64),)])


class Keyword(nn.Module):
    def forward(self, ids: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.relu(ids * scale)


WRONG_CALIBRATION_CALLS = [
    (
        (torch.randn(2, 5),),
        {},
        r"input 'x' has shape \(2, 5\) and dtype float32; the program expects \(2, 8\)",
    ),
    ((torch.randn(2, 8, dtype=torch.float64),), {}, r"input 'x' has shape \(2, 8\) and dtype float64"),
    ((torch.randn(2, 8), torch.randn(2, 8)), {}, r"1 positional input\(s\) too many"),
    ((), {}, r"takes 1 positional"),
    ((torch.randn(2, 8),), {"y": torch.randn(2, 8)}, r"unknown keyword input\(s\) y"),
]


@pytest.mark.parametrize(("args", "kwargs", "message"), WRONG_CALIBRATION_CALLS)
def test_a_calibration_call_that_does_not_fit_names_the_input(
    program: torch.export.ExportedProgram, args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    """torch's own refusal (a shape error deep in a matmul, Python's TypeError for the arity)
    becomes quantplug's, naming the input; the prepared model still calibrates afterwards."""
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    with pytest.raises(QuantplugError, match=message) as info:
        prepared(*args, **kwargs)
    assert isinstance(info.value.__cause__, (TypeError, RuntimeError))
    prepared(torch.randn(2, 8))
    prepared(torch.randn(5, 8))  # another batch size still runs on a static export
    quantplug.convert(prepared)


def test_a_keyword_input_that_does_not_fit_is_named() -> None:
    ids, scale = torch.randn(2, 4), torch.randn(2, 4)
    program = torch.export.export(Keyword(), (ids,), {"scale": scale})
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    prepared(ids, scale=scale)
    with pytest.raises(QuantplugError, match=r"input 'scale' has shape \(2, 3\)"):
        prepared(ids, scale=torch.randn(2, 3))
    with pytest.raises(QuantplugError, match=r"unknown keyword input\(s\) scales"):
        prepared(ids, scales=scale)


def test_an_error_inside_a_call_that_fits_is_torchs_own(program: torch.export.ExportedProgram) -> None:
    """Inputs that fit explain nothing: the original error comes through unchanged."""
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    layer = prepared.get_submodule("encoder.0")
    layer.weight = nn.Parameter(layer.weight.detach()[:, :5].clone())
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        prepared(torch.randn(2, 8))
    assert not isinstance(info.value, QuantplugError)
