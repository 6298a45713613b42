"""Reading a converted program: its encodings and inputs, for writers, reports and tests."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from _quantplug.errors import QuantplugError
from _quantplug.graph.attrs import attr_value as attr_value  # here since 0.1.0
from _quantplug.graph.attrs import fetch_attr as fetch_attr
from _quantplug.graph.attrs import put_attr as put_attr
from _quantplug.meta import CALIBRATED_REPORT_KEY, GROUP_KEY, STATE_KEY
from _quantplug.observers import block_ops as qp_ops

qd = torch.ops.quantized_decomposed


QUANTIZE_OPS = {
    qd.quantize_per_tensor.default: "tensor",
    qd.quantize_per_channel.default: "channel",
    qp_ops.quantize_per_block: "block",
}
DEQUANTIZE_OPS = {
    qd.dequantize_per_tensor.default: "tensor",
    qd.dequantize_per_channel.default: "channel",
    qp_ops.dequantize_per_block: "block",
}


def _tensor_source(node: Node) -> str:
    src = node.args[0]
    return src.name if isinstance(src, Node) else str(src)


def _requantized_edge(quantize: Node) -> dict[str, Any]:
    """For a quantize that re-encodes an already quantized tensor for some consumers (an edge
    whose group differs from its producer's): ``tensor`` named ``"producer->consumer"`` (consumers
    joined by ``,``) instead of after the dequantize it reads, plus ``producer`` and
    ``consumers``. Empty for any other quantize."""
    source = quantize.args[0]
    if not (isinstance(source, Node) and source.target in DEQUANTIZE_OPS):
        return {}
    upstream = source.args[0]
    if isinstance(upstream, Node) and upstream.target in QUANTIZE_OPS:
        upstream = upstream.args[0]
    producer = upstream.name if isinstance(upstream, Node) else str(upstream)
    consumers = sorted(
        {u.name for dq in quantize.users for u in (dq.users if dq.target in DEQUANTIZE_OPS else [dq])}
    )
    return {"tensor": f"{producer}->{','.join(consumers)}", "producer": producer, "consumers": consumers}


def encodings(gm: GraphModule) -> list[dict[str, Any]]:
    """One entry per quantized tensor: what it is, and its scale/zero point/grid.

    Constants appear through their dequantize (their quantize ran at convert); activations
    through their quantize node.
    """
    found: list[dict[str, Any]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        granularity = QUANTIZE_OPS.get(node.target)
        kind = "activation"
        if granularity is None:
            granularity = DEQUANTIZE_OPS.get(node.target)
            src = node.args[0]
            if granularity is None or not (isinstance(src, Node) and src.op == "get_attr"):
                continue
            kind = "constant"
        args = [attr_value(gm, a) for a in node.args]
        entry: dict[str, Any] = {
            "node": node.name,
            "tensor": _tensor_source(node),
            "kind": kind,
            "granularity": granularity,
            "group": node.meta.get(GROUP_KEY),
        }
        if kind == "activation":
            entry.update(_requantized_edge(node))
        if granularity == "tensor":
            entry.update(scale=float(args[1]), zero_point=int(args[2]), quant_min=args[3], quant_max=args[4])
            entry["dtype"] = str(args[5]).removeprefix("torch.")
        elif granularity == "channel":
            entry.update(
                scale=[float(s) for s in args[1].reshape(-1)],
                zero_point=[int(z) for z in args[2].reshape(-1)],
                axis=args[3],
                quant_min=args[4],
                quant_max=args[5],
            )
            entry["dtype"] = str(args[6]).removeprefix("torch.")
        else:
            entry.update(
                scale=args[1].tolist(),
                zero_point=args[2].tolist(),
                block_size=list(args[3]),
                quant_min=args[4],
                quant_max=args[5],
            )
            entry["dtype"] = str(args[6]).removeprefix("torch.")
        found.append(entry)
    return found


def example_inputs(gm: GraphModule, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs shaped like the program's placeholders (random values), e.g. to re-export it."""
    gen = torch.Generator().manual_seed(seed)
    result = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(
                f"input {node.name!r} has no recorded tensor value; pass example inputs explicitly"
            )
        shape = [int(s) for s in val.shape]
        if val.dtype.is_floating_point:
            result.append(torch.randn(shape, generator=gen, dtype=val.dtype))
        elif val.dtype == torch.bool:
            result.append(torch.zeros(shape, dtype=torch.bool))
        else:
            result.append(torch.zeros(shape, dtype=val.dtype))
    return tuple(result)


def prepared_state(prepared: torch.nn.Module) -> Any:
    """What :func:`quantplug.prepare` recorded on a prepared module: ``groups`` (one per
    observer), ``group_of`` (sharing key -> group id: ``"conv"`` for a node's output,
    ``("x", "conv")`` for an input edge), ``validation`` (the prepare-time ``ValidationReport``).
    Raises ``QuantplugError`` for a module that ``prepare`` did not make."""
    meta = getattr(prepared, "meta", None)
    state = meta.get(STATE_KEY) if isinstance(meta, dict) else None
    if state is None:
        raise QuantplugError(
            f"{type(prepared).__name__} was not made by quantplug.prepare (no prepared state): "
            "pass the module prepare() returned"
        )
    return state


def calibrated_report(quantized: torch.nn.Module) -> Any:
    """The ``ValidationReport`` of the constraint checks :func:`quantplug.convert` ran on the
    calibrated encodings, or None when there were none to run (a foreign PT2E quantizer)."""
    meta = getattr(quantized, "meta", None)
    return meta.get(CALIBRATED_REPORT_KEY) if isinstance(meta, dict) else None
