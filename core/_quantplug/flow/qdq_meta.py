"""Which metadata the quantize/dequantize nodes convert makes carry, by torchao's rules.

Tools downstream of PT2E read two kinds of metadata on Q/DQ nodes:

* ``quantization_tag`` and ``stack_trace``, which a backend's quantizer puts on the ops of a
  pattern it annotates, so that its partitioner (ExecuTorch delegates) can group each op with
  the Q/DQ nodes around it. torchao's ``convert_pt2e`` ports them with its
  ``PortNodeMetaForQDQ`` pass; :func:`port_qdq_meta` applies the same rules to quantplug's
  converted graph, so a partitioner written against torchao finds the same tags here.
* ``from_node``, the provenance torchao's numeric debugger matches nodes by (its
  ``NodeSourceDebugInfo`` is the oldest ancestor in that chain). A Q/DQ node made from an
  observer descends from that observer, and an output observer from the node it observes
  (:func:`provenance`), as in torchao, so ``prepare_for_propagation_comparison`` logs a
  quantized op's dequantized output under the float op's debug info.

The rules of :func:`port_qdq_meta`, for each node whose ``quantization_annotation`` asks for any
quantization (torchao's, including its limits, which a partitioner may rely on):

* an input with a static spec: the dequantize among the node's positional arguments that reads
  that input (through Q/DQ ops only) takes the node's metadata, if a quantize (or, for a weight
  stored as integers, the integer constant) precedes it; that quantize, and the view-like ops
  between it and a weight, take the weight's metadata. Nothing is ported through any other op.
* an input with a dynamic spec: the first ``choose_qparams`` reachable from the input, the
  quantize reading its scale and that quantize's dequantize take the node's metadata.
* an output spec: the quantize reading the node takes the node's metadata.

Other metadata (``custom``, ``nn_module_stack``) stays on the ops, as in torchao.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

import torch
from torch.fx import Graph, Node
from torch.fx.traceback import NodeSource, NodeSourceAction

from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.observers import block_ops as qp_ops

qd = torch.ops.quantized_decomposed

#: the metadata torchao's port pass copies onto Q/DQ nodes
PORTED_META = ("stack_trace", "quantization_tag")
#: torchao's provenance key (``torchao.quantization.pt2e.FROM_NODE_KEY``)
FROM_NODE = "from_node"
#: the pass name torchao's convert records in the provenance of the Q/DQ nodes it makes
CONVERT_PASS = "replace_observer_with_quantize_dequantize_node"

QUANTIZE = frozenset(
    {
        qd.quantize_per_tensor.default,
        qd.quantize_per_tensor.tensor,
        qd.quantize_per_channel.default,
        qd.quantize_per_token.default,
        qp_ops.quantize_per_block,
    }
)
DEQUANTIZE = frozenset(
    {
        qd.dequantize_per_tensor.default,
        qd.dequantize_per_tensor.tensor,
        qd.dequantize_per_channel.default,
        qd.dequantize_per_token.default,
        qp_ops.dequantize_per_block,
    }
)
CHOOSE_QPARAMS = frozenset(
    {
        qd.choose_qparams.tensor,
        qd.choose_qparams_symmetric.tensor,
        qd.choose_qparams_per_token_asymmetric.default,
    }
)
#: what may lie between a weight and its quantize (torchao's list: layout changes only)
_VIEW_LIKE = frozenset(
    {
        torch.ops.aten.flatten.using_ints,
        torch.ops.aten.permute.default,
        torch.ops.aten.permute_copy.default,
        torch.ops.aten.slice_copy.Tensor,
        torch.ops.aten.squeeze.dim,
        torch.ops.aten.squeeze_copy.dim,
        torch.ops.aten.transpose.int,
        torch.ops.aten.transpose_,
        torch.ops.aten.view_copy.default,
        torch.ops.aten.view.default,
    }
)
_SYM_SIZE = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default})
_QUANT_WORKFLOW = QUANTIZE | DEQUANTIZE | CHOOSE_QPARAMS


#: the ``graph_id`` of the provenance records convert writes (see :func:`provenance`)
STABLE_GRAPH_ID = 0


def provenance(origin: Node) -> list[NodeSource]:
    """``from_node`` of a Q/DQ node made from ``origin`` (an observer node, or for a weight
    quantized at convert, the weight's node): torchao's record, so the numeric debugger traces it
    to ``origin``'s oldest ancestor.

    ``NodeSource(origin)`` would deep-copy ``origin``'s whole provenance chain for every Q/DQ
    node; the records are never changed once made, so the new one refers to that chain instead.
    """
    info = getattr(NodeSource, "NodeInfo", None)
    if info is None:  # another torch: its own (copying) constructor
        return [NodeSource(origin, CONVERT_PASS, [NodeSourceAction.CREATE])]
    source = NodeSource(None, CONVERT_PASS, [NodeSourceAction.CREATE])
    # torch records id(graph), a memory address: in a saved program that makes two identical runs
    # write different files (one process against two, 42.4's byte-for-byte check). The debugger
    # matches records by name and chain, never by this id, so a fixed one is written instead.
    source.node_info = info(origin.name, str(origin.target), STABLE_GRAPH_ID)
    source.from_node = origin.meta.get(FROM_NODE, [])
    return [source]


def observes_output(node: Node) -> bool:
    """Whether ``node``'s observer is an output observer in torchao's terms (its annotation has
    an output spec), whose provenance torchao's prepare copies from the node."""
    annotation = node.meta.get(Q_ANNOTATION_KEY)
    return FROM_NODE in node.meta and getattr(annotation, "output_qspec", None) is not None


def _copy_meta(to: Node, source_meta: Mapping[str, Any]) -> None:
    for key in PORTED_META:
        if key in source_meta:
            to.meta[key] = source_meta[key]


def _is_call(node: Any, ops: Iterable[Any]) -> TypeGuard[Node]:
    return isinstance(node, Node) and node.op == "call_function" and node.target in ops


def _valid(annotation: Any) -> bool:
    if annotation is None:
        return False
    inputs = getattr(annotation, "input_qspec_map", None)
    return bool(inputs) or getattr(annotation, "output_qspec", None) is not None


def port_qdq_meta(graph: Graph, weight_sources: Mapping[Node, Node]) -> None:
    """Copy ``quantization_tag``/``stack_trace`` onto ``graph``'s Q/DQ nodes (module docstring).

    ``weight_sources`` maps each integer constant convert stored for a weight to the weight's node
    in the prepared graph (its annotation keys name those nodes; torchao would have read the
    weight through a quantize node that its constant folding then replaced).
    """
    source_names = {const: weight.name for const, weight in weight_sources.items()}
    by_name = {n.name: n for n in graph.nodes}

    def reads(dq: Node, input_name: str) -> bool:
        """Whether ``dq`` reads ``input_name`` through quantize/dequantize ops only."""
        node: Any = dq
        while _is_call(node, _QUANT_WORKFLOW):
            node = node.args[0]
        if not isinstance(node, Node):
            return False
        return node.name == input_name or source_names.get(node) == input_name

    for node in list(graph.nodes):
        annotation = node.meta.get(Q_ANNOTATION_KEY)
        if not _valid(annotation):
            continue
        for input_node, spec in annotation.input_qspec_map.items():
            if spec is None:
                continue
            name = input_node.name if isinstance(input_node, Node) else str(input_node)
            if getattr(spec, "is_dynamic", False):
                _port_dynamic_input(by_name.get(name), node)
            else:
                _port_static_input(node, name, reads, weight_sources)
        if annotation.output_qspec is not None:
            users = [u for u in node.users if not _is_call(u, _SYM_SIZE)]
            quantizes = [u for u in users if _is_call(u, QUANTIZE)]
            if len(quantizes) == 1:
                _copy_meta(quantizes[0], node.meta)


def _port_static_input(
    node: Node, name: str, reads: Callable[[Node, str], bool], weight_sources: Mapping[Node, Node]
) -> None:
    dq = next((a for a in node.args if _is_call(a, DEQUANTIZE) and reads(a, name)), None)
    if dq is None:
        return
    before = dq.args[0]
    if isinstance(before, Node) and before in weight_sources:  # a weight stored as integers
        _copy_meta(before, weight_sources[before].meta)
    elif _is_call(before, QUANTIZE):
        chain = [before]
        source = before.args[0]
        while _is_call(source, _VIEW_LIKE):
            chain.append(source)
            source = source.args[0]
        if isinstance(source, Node) and source.op == "get_attr":
            for link in chain:
                _copy_meta(link, source.meta)
    else:
        return
    _copy_meta(dq, node.meta)


def _port_dynamic_input(input_node: Node | None, node: Node) -> None:
    if input_node is None:
        return
    choose = _first_choose_qparams(input_node)
    if choose is None:
        return
    outputs = [u for u in choose.users if not _is_call(u, _SYM_SIZE)]
    if not outputs:
        return
    quantize = next((u for u in outputs[-1].users if _is_call(u, QUANTIZE)), None)
    if quantize is None:
        return
    dequantizes = [u for u in quantize.users if _is_call(u, DEQUANTIZE)]
    for made in (choose, quantize, *dequantizes[:1]):
        _copy_meta(made, node.meta)


def _first_choose_qparams(start: Node) -> Node | None:
    """The first ``choose_qparams`` reachable from ``start``'s users, breadth first."""
    queue = deque(start.users)
    seen: set[Node] = set()
    while queue:
        current = queue.popleft()
        if current in seen or current.op == "output":
            continue
        seen.add(current)
        if _is_call(current, CHOOSE_QPARAMS):
            return current
        queue.extend(current.users)
    return None
