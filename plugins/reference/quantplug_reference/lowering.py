"""Lowering for the reference backend: a QDQ ONNX model run by ONNX Runtime's CPU kernels.

The artifact holds

* ``model.onnx``: the quantized program as a QDQ ONNX model (opset 21 by default). ONNX Runtime
  fuses ``DequantizeLinear -> op -> QuantizeLinear`` groups into integer kernels (``QLinearConv``,
  ``QGemm``, ``QLinearMatMul``...) at session creation, which is where the int8 speed-up comes from;
* ``encodings.json``: every quantized tensor's encoding (``quantplug.flow.inspect.encodings``),
  each with the names of its tensors in ``model.onnx``;
* ``model.pt2``: the Q/DQ program itself, exported (the numerical reference, loadable with
  ``torch.export.load``).

``artifact.run(*inputs)`` runs ``model.onnx`` in an ONNX Runtime CPU session. The file needs no
session option: ``onnxruntime.InferenceSession("model.onnx")`` computes what the Q/DQ program
computes on every CPU (``ort_passes`` spells it so, ``accumulation`` checks ORT's optimized graph
at lowering; ``metadata["ort_integer_kernels"]`` records the result).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from quantplug.backend import Artifact, BackendContext, LoweringError, QuantplugError

ORT_PROVIDER = "CPUExecutionProvider"


class ArtifactInputError(QuantplugError, ValueError):
    """Inputs given to ``ReferenceArtifact.run`` that do not match the model's inputs."""


@dataclass
class ReferenceArtifact(Artifact):
    """The reference backend's artifact: a QDQ ONNX model plus encodings, runnable on the CPU.

    ``inputs`` / ``outputs`` describe the ONNX graph's tensors (name, shape, dtype). Shapes are
    the program's: an ``int`` per static dimension, a name (``"batch"``) per dimension exported
    as dynamic (``torch.export.Dim``), which takes any size.
    """

    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    threads: int = 0
    _session: Any = field(default=None, repr=False, compare=False)

    @property
    def onnx_model(self) -> bytes:
        model = self.files["model.onnx"]
        assert isinstance(model, bytes)
        return model

    def session(self, *, threads: int | None = None, optimized_model_path: str | None = None) -> Any:
        """A new ONNX Runtime CPU session over ``model.onnx``: ORT's defaults (all graph
        optimizations), as in ``onnxruntime.InferenceSession("model.onnx")``; the file needs no
        session option to compute what the Q/DQ program computes.

        Args:
            threads: intra-op threads (default: the ``ort_threads`` option; 0 lets ORT decide).
            optimized_model_path: where ORT should write the graph it actually runs (after its
                QDQ fusions), to check which integer kernels it picked.
        """
        ort = _onnxruntime()
        options = ort.SessionOptions()
        self._configure(options, threads)
        if optimized_model_path is not None:
            options.optimized_model_filepath = str(optimized_model_path)
        return ort.InferenceSession(self.onnx_model, options, providers=[ORT_PROVIDER])

    def _configure(self, options: Any, threads: int | None = None) -> None:
        """Thread counts and log level only: nothing that changes the numbers."""
        n = self.threads if threads is None else threads
        if n:
            options.intra_op_num_threads = n
            options.inter_op_num_threads = 1
        options.log_severity_level = 3

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
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu()
                # numpy has no bfloat16; the model computes it in float32 (ort_passes.bfloat16_in_float32)
                arr = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
            else:
                arr = np.asarray(value)
            fits = arr.ndim == len(spec.shape) and all(
                not isinstance(d, int) or d == n for d, n in zip(spec.shape, arr.shape)
            )
            if not fits:
                raise ArtifactInputError(
                    f"input {i} ({spec.name!r}) has shape {list(arr.shape)}, the model expects "
                    f"{list(spec.shape)} (named dimensions take any size); expected inputs: "
                    f"{self.expected_inputs()}. Other dimensions are fixed by the program: export the "
                    "model again with torch.export.Dim for those you want dynamic"
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


def _onnxruntime() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise LoweringError(
            f"running the reference artifact needs onnxruntime ({exc}); `pip install onnxruntime`"
        ) from exc
    return ort


def write_artifact(program: GraphModule, context: BackendContext) -> ReferenceArtifact:
    """Export the Q/DQ program to QDQ ONNX, keep it as ``model.pt2``, list the encodings, and
    check that ORT's integer kernels reproduce the program on every CPU."""
    from quantplug.backend import compact_node_metadata, export_qdq_onnx
    from quantplug_reference.peers import unverified
    from quantplug_reference.peers.session_probe import ensure_session_survives

    opset = int(context.option("onnx_opset", 21) or 21)
    for_onnx, translations, fused = _for_ort(program)
    result = export_qdq_onnx(for_onnx, opset=opset, custom_translations=translations)
    if fused:
        _map_fused_weights(result, program, fused)
    _spell_for_ort(result)
    table = result.encodings
    onnx_tensors: dict[str, int] = {}  # ONNX tensor name -> index of its entry in "encodings"
    for i, entry in enumerate(table):
        info = entry.get("onnx") or {}
        for name in (info.get("tensor"), info.get("quantized"), *info.get("dequantized", ())):
            if name:
                onnx_tensors.setdefault(name, i)
    compact_node_metadata(result.model)
    model_bytes = result.model_bytes()
    artifact = ReferenceArtifact(
        backend=context.backend,
        inputs=list(result.inputs),
        outputs=list(result.outputs),
        threads=int(context.option("ort_threads", 0) or 0),
    )
    ensure_session_survives(result.model, model_bytes)
    checked = _check_integer_kernels(model_bytes, artifact)
    doc = {
        "version": 2,
        "model": "model.onnx",
        "encodings": table,
        "onnx_tensors": dict(sorted(onnx_tensors.items())),
    }
    artifact.files = {
        "model.onnx": model_bytes,
        "encodings.json": json.dumps(doc, indent=2, allow_nan=False),
        "model.pt2": _program_writer(program),
    }
    artifact.metadata = {
        "options": dict(context.options),
        "quantized_tensors": len(table),
        "onnx_opset": opset,
        "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in result.inputs],
        "outputs": [{"name": o.name, "shape": list(o.shape), "dtype": o.dtype} for o in result.outputs],
        "ort_integer_kernels": checked,
        # what to recheck before trusting this artifact's exactness on an ORT the pieces were not
        # read on (empty on a verified ORT); see quantplug_reference.peers
        "ort_unverified": unverified(),
    }
    return artifact


def _check_integer_kernels(model_bytes: bytes, artifact: ReferenceArtifact) -> dict[str, Any]:
    """Build the session ORT builds for ``model.onnx`` and check every integer kernel of the graph
    it runs on every CPU's accumulation path (``accumulation``). A product that can overflow is a
    ``LoweringError`` (the artifact would silently differ from the program on some CPUs); an
    integer kernel the model does not know is recorded and warned about. The session is kept for
    ``artifact.run``."""
    import warnings

    from quantplug_reference.peers.accumulation import verify_model

    ort = _onnxruntime()

    def plain(options: Any) -> Any:
        artifact._configure(options)
        try:
            return ort.InferenceSession(model_bytes, options, providers=[ORT_PROVIDER])
        except Exception as exc:  # ORT's own errors have no common type
            raise LoweringError(f"ONNX Runtime cannot load the lowered model.onnx: {exc}") from exc

    report, artifact._session = verify_model(model_bytes, plain)
    if report.violations:
        raise LoweringError(
            "model.onnx would not compute what the Q/DQ program computes on every CPU:\n  "
            + "\n  ".join(f.format() for f in report.violations)
            + "\n"
            + _advice(report.violations)
        )
    if report.unverified:
        warnings.warn(
            "model.onnx has integer kernels whose accumulation quantplug does not model: "
            + "; ".join(f.format() for f in report.unverified),
            stacklevel=3,
        )
    return report.summary()


def _advice(violations: Sequence[Any]) -> str:
    """A product that can saturate has a remedy the user can apply; anything else is ours."""
    if any(f.path not in ("numerics", "model") for f in violations):
        return (
            "quantize conv/linear weights on [-64, 64] (the reference backend's weight_bits=7) or "
            "report this as a quantplug bug"
        )
    return "this is a quantplug bug: please report it with the model (ORT's optimized graph above)"


def _program_writer(program: GraphModule) -> Callable[[Path], None]:
    """Writes ``model.pt2`` when the artifact is saved (torch takes longer to serialize a program
    than quantplug to lower it): the Q/DQ program as an ExportedProgram, dynamic shapes kept."""

    def write(path: Path) -> None:
        from quantplug.backend import to_exported_program

        buffer = io.BytesIO()  # named after the file, the archive's folder would be the temp name
        torch.export.save(to_exported_program(program), buffer)
        path.write_bytes(buffer.getvalue())

    return write


def _for_ort(program: GraphModule) -> tuple[GraphModule, dict[Any, Any], dict[str, dict[str, str]]]:
    """The program to export: dynamic linears fused into integer products (on a copy)."""
    qd = torch.ops.quantized_decomposed
    if not any(n.target == qd.dequantize_per_token.default for n in program.graph.nodes):
        return program, {}, {}
    from quantplug.backend import working_copy
    from quantplug_reference.dynamic_linear import fuse_dynamic_linears, translations

    copy = working_copy(program)
    fused = fuse_dynamic_linears(copy)
    return (copy, translations(), fused) if fused else (program, {}, {})


def _map_fused_weights(result: Any, program: GraphModule, fused: dict[str, dict[str, str]]) -> None:
    """Put back the encodings of weights read by fused dynamic linears (the exported copy has
    no dequantize node for them), naming their initializers; keeps the program's order."""
    from quantplug.backend import encodings

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
                "zero_point": names.get("zero_point"),
                "transposed": True,
            }
            if names.get("zero_point"):  # stored as uint8 w + 128 (see dynamic_linear)
                entry["onnx"].update(stored_as="uint8", stored_offset=128)
        merged.append(entry)
    result.encodings = merged


def _spell_for_ort(result: Any) -> None:
    """The ``ort_passes`` rewrites, in order; the encodings' ONNX names follow."""
    from quantplug.backend import pack_int4_constants
    from quantplug_reference.peers import ort_passes

    pack_int4_constants(result)
    retyped = set(ort_passes.bfloat16_in_float32(result.model))
    if retyped:  # the graph's inputs and outputs are float32 now
        result.inputs = [replace(i, dtype="float32") if i.name in retyped else i for i in result.inputs]
        result.outputs = [replace(o, dtype="float32") if o.name in retyped else o for o in result.outputs]
    ort_passes.int4_linears_as_matmulnbits(result.model, result.encodings)
    ort_passes.dequantize_weights_as_arithmetic(result.model, result.encodings)
    ort_passes.retype_signed_activations(result.model, result.encodings)
    ort_passes.retype_wide_product_weights(result.model, result.encodings)
