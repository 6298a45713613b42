"""Lowering for QNN: a QDQ ONNX model plus an AIMET-format encodings file.

``quantplug.lower(quantized, quantizer)`` runs :data:`LOWERING_PASSES`, then :func:`write_artifact`:

1. ``qnn_htp.check_encodings`` computes every tensor's QNN encoding (``encodings.from_entry``)
   and fails with a ``LoweringError`` listing every tensor QNN cannot encode (per-tensor 2-bit
   weights, non-LPBQ blocks, dynamic or 32-bit activations...), before any export work;
2. the writer exports the Q/DQ program to ONNX with the core's shared exporter
   (``quantplug.lowering.onnx_export.export_qdq_onnx``, opset 21: 16-bit, 4-bit and blocked
   Q/DQ), gives each quantized weight's float tensor (the ``DequantizeLinear`` output) a readable
   name (``conv1_weight`` for the integer initializer ``conv1_weight_q0``), and writes the
   encodings keyed by ONNX tensor names: activations by the tensor a ``QuantizeLinear`` reads,
   parameters (weights, biases, quantized initializers such as embedding tables) by the float
   tensor their ``DequantizeLinear`` produces.

Files: ``model.onnx`` and ``model.encodings`` (AIMET's ``<prefix>.encodings``; version from the
``encodings_version`` option, 1.0.0 by default; one tensor per line), plus ``artifact.json`` with
the options, SoC, HTP arch and a per-tensor summary. 4-bit weight codes are ONNX ``INT4``, two a
byte. A model whose weights exceed :data:`SINGLE_FILE_BYTES` keeps them in ``model.onnx.data``
(ONNX external data, read from beside the model by ``onnx.load`` and the converter): lowering
never copies them, saving streams them from the program one tensor at a time. Pass the pair to
``qnn-onnx-converter --input_network model.onnx --quantization_overrides model.encodings``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from quantplug.backend import Artifact, BackendContext, LoweringError, describe
from quantplug.backend import encodings as program_encodings
from quantplug_qnn_htp import encodings as qnn_enc
from quantplug_qnn_htp.completeness import check_completeness

META_KEY = "qnn_htp_encodings"


def _shape_of(gm: GraphModule, tensor: str) -> tuple[int, ...] | None:
    for node in gm.graph.nodes:
        if node.name == tensor or (node.op == "get_attr" and str(node.target) == tensor):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                return tuple(int(d) for d in val.shape)
            if node.op == "get_attr":
                value: Any = gm
                for part in str(node.target).split("."):
                    value = getattr(value, part, None)
                if isinstance(value, torch.Tensor):
                    return tuple(value.shape)
    return None


def check_encodings(program: GraphModule, context: BackendContext) -> None:
    """Compute every tensor's QNN encoding; raise listing all that QNN cannot encode."""
    act_symmetric = bool(context.option("act_symmetric", False))
    found: list[tuple[str, qnn_enc.QnnEncoding]] = []  # (node, encoding): the entries' lists go
    problems: list[str] = []
    nodes = {n.name: n for n in program.graph.nodes}
    for entry in program_encodings(program):
        try:
            shape = _shape_of(program, entry["tensor"]) if entry["granularity"] == "block" else None
            enc = qnn_enc.from_entry(entry, shape=shape, act_symmetric=act_symmetric)
        except qnn_enc.EncodingError as exc:
            problems.append(f"  {describe(nodes[entry['node']])} (node {entry['node']!r}): {exc}")
            continue
        found.append((entry["node"], enc))
    if problems:
        raise LoweringError(
            f"{len(problems)} quantized tensor(s) cannot be encoded for QNN HTP:\n" + "\n".join(problems)
        )
    program.meta[META_KEY] = found


LOWERING_PASSES: tuple[tuple[str, Any], ...] = (("qnn_htp.check_encodings", check_encodings),)


# --- the writer ---------------------------------------------------------------------------------

#: a model whose initializers hold more bytes than this is written as ``model.onnx`` plus
#: ``model.onnx.data`` (ONNX external data, which ``onnx.load`` and QNN's converter read from
#: beside the model), streamed tensor by tensor from the program when the artifact is saved;
#: a smaller one is a single ``model.onnx`` held as bytes (``artifact.files["model.onnx"]``)
SINGLE_FILE_BYTES = 16 * 2**20

_Q_SUFFIX = re.compile(r"_q\d*$")


def _rename_param_tensors(model: Any, result: Any) -> dict[str, str]:
    """Give each quantized constant's DequantizeLinear output a readable, unique name."""
    graph = model.graph
    taken = {v for n in graph.node for v in (*n.input, *n.output)} | {i.name for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    taken |= {i.name for i in graph.input} | outputs
    renames: dict[str, str] = {}
    for entry in result.encodings:
        info = entry.get("onnx")
        if not info or entry["kind"] != "constant":
            continue
        old = info["tensor"]
        if old in renames or old in outputs:
            continue
        base = _Q_SUFFIX.sub("", str(info["quantized"])) or old
        new = base
        i = 1
        while new in taken and new != old:
            new = f"{base}_{i}"
            i += 1
        if new == old:
            continue
        taken.add(new)
        renames[old] = new
    if not renames:
        return renames
    for node in graph.node:  # rewriting a proto's fields is slow: only those that change
        if any(o in renames for o in node.output):
            node.output[:] = [renames.get(o, o) for o in node.output]
        if any(i in renames for i in node.input):
            node.input[:] = [renames.get(i, i) for i in node.input]
    for vi in graph.value_info:
        if vi.name in renames:
            vi.name = renames[vi.name]
    return renames


def _parameters_stored_twice(result: Any) -> list[dict[str, Any]]:
    """Parameters whose uses quantize them differently, so that the model holds several integer
    tables for one parameter (convert names each form ``<parameter>_q<N>``).

    The usual case is a tied embedding / LM-head table (``tie_word_embeddings``): the embedding's
    table on the activation grid (16-bit per tensor), the LM head's on the weight grid. With
    ``per_channel_embedding=True`` both take the weight grid, convert keeps one table, and the
    model stores it once, read by both ``DequantizeLinear`` nodes.
    """
    initializers = {t.name: t for t in result.model.graph.initializer}
    forms: dict[str, set[str]] = {}
    for entry in result.encodings:
        info = entry.get("onnx")
        if entry["kind"] == "constant" and info and info["quantized"] in initializers:
            forms.setdefault(_Q_SUFFIX.sub("", info["quantized"]), set()).add(info["quantized"])
    return [
        {
            "parameter": base,
            "initializers": sorted(names),
            "hint": "its uses quantize it differently (a tied embedding table on the activation grid, "
            "the LM head's on the weight grid); per_channel_embedding=True quantizes both alike and "
            "stores it once",
        }
        for base, names in sorted(forms.items())
        if len(names) > 1
    ]


def _initializer_names(model: Any) -> set[str]:
    names = {i.name for i in model.graph.initializer}
    for node in model.graph.node:  # constants the exporter kept as Constant nodes
        if node.op_type == "Constant":
            names.update(node.output)
    return names


def onnx_encodings(
    program: GraphModule, context: BackendContext, example_inputs: Sequence[torch.Tensor] | None = None
) -> tuple[Any, list[qnn_enc.QnnEncoding], list[str]]:
    """Export ``program`` to QDQ ONNX; return ``(export result, encodings keyed by ONNX names,
    conflicts)``.

    The result's model holds no weight data (``external_data=True``): the weights stay in the
    program's tensors until the artifact is written, 4-bit ones stored as ``INT4`` (two codes a
    byte, :func:`quantplug.backend.pack_int4_constants`); the ``DequantizeLinear`` outputs the
    encodings describe are the same.
    """
    try:
        from quantplug.backend import export_qdq_onnx, pack_int4_constants
    except ImportError as exc:  # pragma: no cover - the core ships it
        raise LoweringError(f"qnn_htp lowering needs quantplug.lowering.onnx_export ({exc})") from exc
    found = program.meta.get(META_KEY)
    if found is None:
        check_encodings(program, context)
        found = program.meta[META_KEY]
    by_node = dict(found)
    result = export_qdq_onnx(program, example_inputs, external_data=True)
    pack_int4_constants(result)
    model = result.model
    renames = _rename_param_tensors(model, result)
    initializers = _initializer_names(model)
    names: dict[str, qnn_enc.QnnEncoding] = {}
    conflicts: list[str] = []
    missing: list[str] = []  # program nodes whose tensor is not in the model
    for entry in result.encodings:
        enc = by_node.get(entry["node"])
        info = entry.get("onnx")
        if enc is None:
            continue
        if not info:
            missing.append(entry["node"])
            continue
        tensor = renames.get(info["tensor"], info["tensor"])
        kind = "param" if entry["kind"] == "constant" or tensor in initializers else "activation"
        named = dataclasses.replace(enc, name=tensor, kind=kind)
        previous = names.get(tensor)
        if previous is not None and (previous.scale, previous.zero_point, previous.bw) != (
            named.scale,
            named.zero_point,
            named.bw,
        ):
            conflicts.append(f"{tensor}: {previous.source} vs {named.source}")
            continue
        names.setdefault(tensor, named)
    if missing:
        raise LoweringError(_missing_message(program, missing))
    return result, list(names.values()), conflicts


def _missing_message(program: GraphModule, missing: Sequence[str]) -> str:
    nodes = {n.name: n for n in program.graph.nodes}
    lines = [
        f"  {describe(nodes[name]) if name in nodes else name} (node {name!r})" for name in sorted(missing)
    ]
    return (
        f"{len(missing)} quantized tensor(s) are not in the exported ONNX model, so QNN would get no "
        "encoding for them:\n" + "\n".join(lines) + "\nA lowering pass removed them, or nothing reads them; "
        "report this with the model if neither is the case"
    )


def _quantizer_args(context: BackendContext, encs: Sequence[qnn_enc.QnnEncoding]) -> qnn_enc.QuantizerArgs:
    acts = [e.bw for e in encs if e.kind == "activation"]
    params = [e.bw for e in encs if e.kind == "param" and e.bw < 32]
    return qnn_enc.QuantizerArgs(
        activation_bitwidth=max(acts) if acts else 8,
        param_bitwidth=max(params) if params else 8,
        is_symmetric=bool(context.option("act_symmetric", False)),
        per_channel_quantization=any(e.axis is not None for e in encs if e.kind == "param"),
    )


def write_artifact(program: GraphModule, context: BackendContext) -> Artifact:
    """``model.onnx`` + ``model.encodings`` (AIMET ``encodings_version``) for QNN converters."""
    from quantplug.backend import compact_node_metadata

    version = context.option("encodings_version") or qnn_enc.DEFAULT_VERSION
    result, encs, conflicts = onnx_encodings(program, context)
    model = result.model
    completeness = check_completeness(model, [e.name for e in encs], program, strict=context.strict)
    compact_node_metadata(model)  # the check above read the exporter's notes; the file ships without
    try:
        document = qnn_enc.to_aimet(encs, version, quantizer_args=_quantizer_args(context, encs))
    except qnn_enc.EncodingError as exc:
        raise LoweringError(str(exc)) from exc
    soc = context.state.get("soc")
    summary = [
        {
            "name": e.name,
            "kind": e.kind,
            "qnn_datatype": e.datatype,
            "qnn_encoding": e.encoding_type,
            "bitwidth": e.bw,
            "granularity": e.granularity,
            "source": e.source,
        }
        for e in encs
    ]
    external = result.external_bytes > SINGLE_FILE_BYTES
    return Artifact(
        backend=context.backend,
        files={
            qnn_enc.MODEL_FILE: result.model_writer() if external else result.model_bytes(),
            qnn_enc.ENCODINGS_FILE: qnn_enc.dumps(document),
        },
        metadata={
            "options": dict(context.options),
            "soc_model": getattr(soc, "name", context.option("soc_model")),
            "htp_arch": getattr(soc, "arch_name", None),
            "encodings_version": version,
            "onnx_opset": 21,
            "onnx_external_data": qnn_enc.MODEL_FILE + ".data" if external else None,
            "quantized_tensors": len(encs),
            "encoding_conflicts": conflicts,
            "parameters_stored_twice": _parameters_stored_twice(result),
            "tensors": summary,
            **completeness.metadata(),
        },
    )
