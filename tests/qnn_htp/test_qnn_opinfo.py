"""Constraints from the QNN SDK's BackendOpInfo (SDK 2.41+) versus the built-in table.

The SDK is faked by a real Python package on disk under ``<root>/lib/python/qti/aisw/converters/
common/backend_opinfo.py`` that mimics the API ExecuTorch's adapter uses; ``QNN_SDK_ROOT`` points
at it.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import quantplug
from _quantplug.errors import ConstraintViolationError, OptionError

pytest.importorskip("quantplug_qnn_htp")

from quantplug_qnn_htp import backend_opinfo
from quantplug_qnn_htp.plugin import sdk_opinfo

from .models import build

FAKE_MODULE = '''
"""A stand-in for qti.aisw.converters.common.backend_opinfo (QNN SDK 2.41+)."""
import enum

HTP = "HTP-backend-type"
CALLS = []
LABEL = {label!r}


class Qnn_DataType_t(enum.Enum):  # the SDK hands out enum members; ints and names also occur
    QNN_DATATYPE_UFIXED_POINT_8 = 0x0408
    QNN_DATATYPE_UFIXED_POINT_16 = 0x0416


class QuantConstraintInfo:
    def __init__(self, encodings, symmetric=False, axis=None, math_invariant=False, scale=None, offset=None):
        self._e, self._s, self._a, self._m = encodings, symmetric, axis, math_invariant
        self._scale, self._offset = scale, offset

    def get_encoding_types(self): return list(self._e)
    def is_symmetric(self): return self._s
    def get_axis(self): return self._a
    def is_math_invariant(self): return self._m
    def get_scale(self): return self._scale
    def get_offset(self): return self._offset


class DatatypeInfo:
    def __init__(self, dtype, constraints=(), onward=False):
        self._d, self._c, self._o = dtype, list(constraints), onward

    def get_datatype(self): return self._d
    def get_quant_constraint_info(self): return self._c
    def is_applicable_from_current_dtype_onward(self): return self._o


class OpInfo:
    def __init__(self, inputs, outputs):
        self._i, self._o = inputs, outputs

    def get_input_info(self): return self._i
    def get_output_info(self): return self._o


PER_TENSOR = ["QNN_QUANTIZATION_ENCODING_SCALE_OFFSET"]
U16 = Qnn_DataType_t.QNN_DATATYPE_UFIXED_POINT_16
U8 = 0x0408  # an int value
TABLE = {{
    # this SDK's Relu runs on 16-bit tensors only
    "Relu": [OpInfo([DatatypeInfo(U16, [QuantConstraintInfo(PER_TENSOR)])],
                    [DatatypeInfo(U16, [QuantConstraintInfo(PER_TENSOR)])])],
    "Sigmoid": [
        OpInfo([DatatypeInfo(U8, [QuantConstraintInfo(PER_TENSOR)])],
               [DatatypeInfo(U8, [QuantConstraintInfo(PER_TENSOR, scale={sigmoid_scale}, offset=0)])]),
        OpInfo([DatatypeInfo("QNN_DATATYPE_UFIXED_POINT_16", [QuantConstraintInfo(PER_TENSOR)])],
               [DatatypeInfo("QNN_DATATYPE_UFIXED_POINT_16",
                             [QuantConstraintInfo(PER_TENSOR, scale=1 / 65536, offset=0)])]),
    ],
    "ElementWiseAdd": [
        OpInfo([DatatypeInfo(U8), DatatypeInfo(U8)], [DatatypeInfo(U8)]),
        OpInfo([DatatypeInfo(U16), DatatypeInfo(U16)], [DatatypeInfo(U16)]),
    ],
}}


class BackendOpInfo:
    def __init__(self, backend_type, soc_model):
        if {broken}:
            raise RuntimeError("this SDK build has no op info for HTP")
        CALLS.append((backend_type, soc_model))

    def get_all_supported_ops(self):
        return list(TABLE)

    def get_op_info(self, op_name):
        return TABLE.get(op_name, [])
'''


def make_sdk(
    root: Path, *, label: str = "fake", sigmoid_scale: str = "1 / 256", broken: bool = False
) -> Path:
    pkg = root / "lib" / "python" / "qti" / "aisw" / "converters" / "common"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent, pkg.parent.parent.parent):
        (d / "__init__.py").write_text("")
    body = FAKE_MODULE.format(label=label, sigmoid_scale=sigmoid_scale, broken=broken)
    (pkg / "backend_opinfo.py").write_text(textwrap.dedent(body))
    return root


@pytest.fixture(autouse=True)
def _forget_fake_sdks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    before = list(sys.path)
    yield
    for name in [m for m in sys.modules if m == "qti" or m.startswith("qti.")]:
        del sys.modules[name]
    sys.path[:] = before


def _quantizer(**options: object) -> quantplug.Quantizer:
    return quantplug.get_quantizer("qnn_htp", soc_model="SM8650", **options)  # type: ignore[arg-type]


def _prepare(q: quantplug.Quantizer, name: str = "convnet") -> torch.fx.GraphModule:
    model, example, _ = build(name)
    return quantplug.prepare(torch.export.export(model, example), q)


# --- selection -------------------------------------------------------------------------------------


def test_without_an_sdk_the_builtin_table_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert sdk_opinfo(_quantizer().context) is None  # QNN_SDK_ROOT unset
    monkeypatch.setenv("QNN_SDK_ROOT", "")
    assert sdk_opinfo(_quantizer().context) is None
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path))  # an SDK dir without lib/python (SDK < 2.41)
    assert sdk_opinfo(_quantizer().context) is None
    q = _quantizer()
    assert q.constraints("aten.relu.default", "Relu")[0].source.startswith("built-in")
    _prepare(q)  # the built-in table accepts the default 8a8w annotations


def test_sdk_op_info_is_loaded_for_the_soc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path)))
    q = _quantizer()
    sdk = sdk_opinfo(q.context)
    assert sdk is not None and sdk.root == str(tmp_path)
    assert sdk.module.CALLS == [("HTP-backend-type", 57)]  # ExecuTorch's QcomChipset value of SM8650
    assert sdk.supported == {"Relu", "Sigmoid", "ElementWiseAdd"}
    relu = q.constraints("aten.relu.default", "Relu")[0]
    assert relu.source == backend_opinfo.SOURCE_SDK
    assert relu.ports[0].dtypes == {torch.uint16} and relu.ports[0].per_tensor_only
    # an op the SDK does not list keeps its architecture gates and nothing else
    conv = q.constraints("aten.conv2d.default", "Conv2d")[0]
    assert not conv.ports and {r.min_arch for r in conv.arch} == {69, 73}
    # constraints_source='builtin' ignores the SDK
    assert sdk_opinfo(_quantizer(constraints_source="builtin").context) is None


def test_validation_reads_the_sdk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path)))
    with pytest.raises(ConstraintViolationError) as err:
        _prepare(_quantizer(precision="8a8w"))  # this SDK's Relu is 16-bit only
    violations = err.value.report.violations
    assert {(v.node, v.backend_op, v.rule) for v in violations} == {("relu", "Relu", "dtype")}
    assert "uint16" in str(err.value)
    _prepare(_quantizer(precision="16a8w"))  # 16-bit: the SDK accepts relu, sigmoid's 1/65536 and add
    # non-strict: a warning, and the program is prepared
    _prepare(_quantizer(precision="8a8w", strict=False))


def test_sdk_fixed_encodings_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path, sigmoid_scale="1 / 255")))
    with pytest.raises(ConstraintViolationError) as err:
        _prepare(_quantizer(precision="8a8w"))
    rules = {(v.node, v.rule) for v in err.value.report.violations}
    assert ("sigmoid", "fixed encoding") in rules  # this SDK wants 1/255, the rule gives 1/256
    _prepare(_quantizer(precision="16a8w"))  # its 16-bit variant agrees with the rule (1/65536)


def test_arch_gates_apply_with_the_sdk_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecuTorch runs its LPBQ / 16x16 gates only when the SDK reports the op (P1/P2)."""
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path)))
    q = quantplug.get_quantizer("qnn_htp", soc_model="SM8350", precision="16a4w_block", block_size=16)
    with pytest.raises(ConstraintViolationError) as err:
        _prepare(q)
    assert any(v.node == "conv2d_2" and v.rule == "architecture" for v in err.value.report.violations)


def test_each_sdk_root_is_read_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = make_sdk(tmp_path / "a", label="a"), make_sdk(tmp_path / "b", label="b")
    monkeypatch.setenv("QNN_SDK_ROOT", str(first))
    assert sdk_opinfo(_quantizer().context).module.LABEL == "a"
    monkeypatch.setenv("QNN_SDK_ROOT", str(second))
    assert sdk_opinfo(_quantizer().context).module.LABEL == "b"


def test_broken_or_required_sdk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path, broken=True)))
    with caplog.at_level(logging.WARNING, logger="quantplug.qnn_htp"):
        assert sdk_opinfo(_quantizer().context) is None  # falls back to the built-in table
    assert "BackendOpInfo could not be loaded" in caplog.text
    with pytest.raises(OptionError, match=r"QNN SDK 2\.41"):
        sdk_opinfo(_quantizer(constraints_source="sdk").context)
    monkeypatch.delenv("QNN_SDK_ROOT")
    with pytest.raises(OptionError, match="QNN_SDK_ROOT"):
        sdk_opinfo(_quantizer(constraints_source="sdk").context)


def test_normalization_matches_executorch_adapter_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QNN_SDK_ROOT", str(make_sdk(tmp_path)))
    sdk = sdk_opinfo(_quantizer().context)
    variants = backend_opinfo.normalize(sdk.opinfo.get_op_info("Sigmoid"))
    assert len(variants) == 2
    out = variants[0].outputs[0]
    assert out.dtype == "QNN_DATATYPE_UFIXED_POINT_8"  # from an int value
    assert out.constraints[0].scale == pytest.approx(1 / 256) and out.constraints[0].offset == 0
    assert variants[1].inputs[0].dtype == "QNN_DATATYPE_UFIXED_POINT_16"  # from a name
    relu = backend_opinfo.normalize(sdk.opinfo.get_op_info("Relu"))
    assert relu[0].inputs[0].dtype == "QNN_DATATYPE_UFIXED_POINT_16"  # from an enum member
