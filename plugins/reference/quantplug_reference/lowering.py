"""Lowering for the reference backend: a QDQ ONNX model run by ONNX Runtime's CPU kernels.

The artifact holds

* ``model.onnx``: the quantized program as a QDQ ONNX model (opset 21 by default). ONNX Runtime
  fuses ``DequantizeLinear -> op -> QuantizeLinear`` groups into integer kernels (``QLinearConv``,
  ``QGemm``, ``QLinearMatMul``...) at session creation, which is where the int8 speed-up comes from;
* ``encodings.json``: every quantized tensor's encoding (``quantplug.flow.inspect.encodings``),
  each with the names of its tensors in ``model.onnx``;
* ``model.pt2``: the Q/DQ program itself, re-exported (the numerical reference, loadable with
  ``torch.export.load``).

``artifact.run(*inputs)`` runs ``model.onnx`` in an ONNX Runtime CPU session.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

from quantplug import Artifact, BackendContext, LoweringError, QuantplugError
from quantplug.flow.inspect import example_inputs

ORT_PROVIDER = "CPUExecutionProvider"


class ArtifactInputError(QuantplugError, ValueError):
    """Inputs given to ``ReferenceArtifact.run`` that do not match the model's inputs."""


@dataclass
class ReferenceArtifact(Artifact):
    """The reference backend's artifact: a QDQ ONNX model plus encodings, runnable on the CPU.

    ``inputs`` / ``outputs`` describe the ONNX graph's tensors (name, shape, dtype). Shapes are
    those of the example inputs the program was captured with.
    """

    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    threads: int = 0
    disabled_optimizers: list[str] = field(default_factory=list)
    session_config: dict[str, str] = field(default_factory=dict)
    _session: Any = field(default=None, repr=False, compare=False)

    @property
    def onnx_model(self) -> bytes:
        model = self.files["model.onnx"]
        assert isinstance(model, bytes)
        return model

    def session(self, *, threads: int | None = None, optimized_model_path: str | None = None) -> Any:
        """A new ONNX Runtime CPU session over ``model.onnx`` (all graph optimizations on).

        Args:
            threads: intra-op threads (default: the ``ort_threads`` option; 0 lets ORT decide).
            optimized_model_path: where ORT should write the graph it actually runs (after its
                QDQ fusions), to check which integer kernels it picked.
        """
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise LoweringError(
                f"running the reference artifact needs onnxruntime ({exc}); `pip install onnxruntime`"
            ) from exc
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        n = self.threads if threads is None else threads
        if n:
            options.intra_op_num_threads = n
            options.inter_op_num_threads = 1
        if optimized_model_path is not None:
            options.optimized_model_filepath = str(optimized_model_path)
        # ORT turns DequantizeLinear(weight) -> MatMul into MatMulNBits; its default accuracy level
        # (4) then quantizes the *activations* to int8 on the fly, which the Q/DQ program does not
        # do. Level 1 keeps them float (the weights stay 4/8-bit): results match the program.
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
        for key, value in self.session_config.items():
            options.add_session_config_entry(key, value)
        options.log_severity_level = 3
        extra = {"disabled_optimizers": list(self.disabled_optimizers)} if self.disabled_optimizers else {}
        return ort.InferenceSession(self.onnx_model, options, providers=[ORT_PROVIDER], **extra)

    def run(self, *inputs: Any) -> Any:
        """Run the model on ``inputs`` (torch tensors or numpy arrays, in the program's order).

        Returns one output as a tensor (numpy arrays in, numpy arrays out), several as a tuple.

        Raises:
            ArtifactInputError: wrong number of inputs, or a shape or dtype that differs from the
                model's (the message lists what the model expects).
        """
        import numpy as np

        arrays = self._check_inputs(inputs)
        if self._session is None:
            self._session = self.session()
        feeds = {spec.name: arr for spec, arr in zip(self.inputs, arrays)}
        results = self._session.run(None, feeds)
        as_torch = any(isinstance(x, torch.Tensor) for x in inputs)
        outs = [torch.from_numpy(np.asarray(r)) if as_torch else r for r in results]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def expected_inputs(self) -> str:
        return ", ".join(f"{s.name}: {s.dtype}[{', '.join(map(str, s.shape))}]" for s in self.inputs)

    def _check_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        import numpy as np

        if len(inputs) != len(self.inputs):
            raise ArtifactInputError(
                f"the model takes {len(self.inputs)} input(s) ({self.expected_inputs()}), got {len(inputs)}"
            )
        arrays = []
        for i, (spec, value) in enumerate(zip(self.inputs, inputs)):
            arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            fixed = all(isinstance(d, int) for d in spec.shape)
            if (fixed and tuple(arr.shape) != tuple(spec.shape)) or arr.ndim != len(spec.shape):
                raise ArtifactInputError(
                    f"input {i} ({spec.name!r}) has shape {list(arr.shape)}, the model expects "
                    f"{list(spec.shape)}; expected inputs: {self.expected_inputs()}. Shapes are fixed "
                    "by the example inputs the model was exported with: export and quantize it again "
                    "with inputs of the shape you need"
                )
            if arr.dtype.name != spec.dtype:
                if arr.dtype.kind == np.dtype(spec.dtype).kind:
                    arr = arr.astype(spec.dtype)  # e.g. float64 -> float32, int32 -> int64
                else:
                    raise ArtifactInputError(
                        f"input {i} ({spec.name!r}) has dtype {arr.dtype.name}, the model expects "
                        f"{spec.dtype}; expected inputs: {self.expected_inputs()}"
                    )
            arrays.append(np.ascontiguousarray(arr))
        return arrays


def write_artifact(program: GraphModule, context: BackendContext) -> ReferenceArtifact:
    """Export the Q/DQ program to QDQ ONNX, keep a re-exported ``model.pt2``, list the encodings."""
    from quantplug.lowering.onnx_export import export_qdq_onnx

    args = example_inputs(program)
    opset = int(context.option("onnx_opset", 21) or 21)
    for_onnx, translations, fused = _for_ort(program)
    result = export_qdq_onnx(for_onnx, args, opset=opset, custom_translations=translations)
    if fused:
        _map_fused_weights(result, program, fused)
    disabled, config = _optimize_for_ort(result)
    exported = result.exported_program if for_onnx is program else None
    if exported is None:
        exported = torch.export.export(program, args)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    table = result.encodings
    onnx_tensors: dict[str, int] = {}  # ONNX tensor name -> index of its entry in "encodings"
    for i, entry in enumerate(table):
        info = entry.get("onnx") or {}
        for name in (info.get("tensor"), info.get("quantized"), *info.get("dequantized", ())):
            if name:
                onnx_tensors.setdefault(name, i)
    doc = {
        "version": 2,
        "model": "model.onnx",
        "encodings": table,
        "onnx_tensors": dict(sorted(onnx_tensors.items())),
    }
    return ReferenceArtifact(
        backend=context.backend,
        files={
            "model.onnx": result.model_bytes(),
            "encodings.json": json.dumps(doc, indent=2, allow_nan=False),
            "model.pt2": buffer.getvalue(),
        },
        metadata={
            "options": dict(context.options),
            "quantized_tensors": len(table),
            "onnx_opset": opset,
            "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in result.inputs],
            "outputs": [{"name": o.name, "shape": list(o.shape), "dtype": o.dtype} for o in result.outputs],
            "ort_disabled_optimizers": list(disabled),
            "ort_session_config": config,
        },
        inputs=list(result.inputs),
        outputs=list(result.outputs),
        threads=int(context.option("ort_threads", 0) or 0),
        disabled_optimizers=list(disabled),
        session_config=dict(config),
    )


def _for_ort(program: GraphModule) -> tuple[GraphModule, dict[Any, Any], dict[str, dict[str, str]]]:
    """The program to export: dynamic linears fused into integer products (on a copy)."""
    qd = torch.ops.quantized_decomposed
    if not any(n.target == qd.dequantize_per_token.default for n in program.graph.nodes):
        return program, {}, {}
    from quantplug.flow.graph_copy import working_copy
    from quantplug_reference.dynamic_linear import fuse_dynamic_linears, translations

    copy = working_copy(program)
    fused = fuse_dynamic_linears(copy)
    return (copy, translations(), fused) if fused else (program, {}, {})


def _map_fused_weights(result: Any, program: GraphModule, fused: dict[str, dict[str, str]]) -> None:
    """Put back the encodings of weights read by fused dynamic linears (the exported copy has
    no dequantize node for them), naming their initializers; keeps the program's order."""
    from quantplug.flow.inspect import encodings

    exported = {e["node"]: e for e in result.encodings}
    initializers = {t.name for t in result.model.graph.initializer}
    merged = []
    for entry in encodings(program):
        found = exported.get(entry["node"])
        if found is not None:
            merged.append(found)
            continue
        names = fused.get(entry["node"])
        entry["onnx"] = None
        if names is not None and names["quantized"] in initializers:
            entry["onnx"] = {
                "tensor": None,
                "quantized": names["quantized"],
                "dequantized": [],
                "node": None,
                "scale": names["scale"] if names["scale"] in initializers else None,
                "zero_point": None,
                "transposed": True,
            }
        merged.append(entry)
    result.encodings = merged


def _optimize_for_ort(result: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """4-bit weights stored as INT4 and 4-bit weight-only linears spelled for ``MatMulNBits``
    (``ort_passes``); the encodings' ONNX names follow. Returns the ORT optimizers to disable and
    the session config entries the model runs best with."""
    from quantplug.lowering.onnx_export import pack_int4_constants
    from quantplug_reference.ort_passes import DISABLED_OPTIMIZERS, int4_weight_matmuls, session_config

    pack_int4_constants(result)
    rewritten = int4_weight_matmuls(result.model)
    disabled = DISABLED_OPTIMIZERS if rewritten or _signed_8bit_activations(result.model) else ()
    for entry in result.encodings:
        info = entry.get("onnx")
        if entry["kind"] == "constant" and info and info["tensor"] in rewritten:
            info.update(rewritten[info["tensor"]])
            info["transposed"] = True  # stored as W^T [in, out], scales on the matching axis
    return disabled, session_config(result.model)


def _signed_8bit_activations(model: Any) -> bool:
    """Whether some activation is quantized to int8. ORT 1.31's MatMulAddFusion breaks such models
    when it reshapes a 3-D linear input (it writes an int8 QuantizeLinear with a uint8 zero point:
    the session fails to load), so their sessions run without it."""
    from onnx import TensorProto

    typed = {t.name: t.data_type for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute:
            typed[node.output[0]] = node.attribute[0].t.data_type
    return any(
        node.op_type == "QuantizeLinear"
        and len(node.input) > 2
        and typed.get(node.input[2]) == TensorProto.INT8
        for node in model.graph.node
    )
