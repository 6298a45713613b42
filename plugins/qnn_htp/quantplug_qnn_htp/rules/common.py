"""Annotation patterns shared by the HTP rules modules (no rules are registered here)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from quantplug.backend import (
    BackendContext,
    QuantizationConfig,
    QuantizationSpecBase,
    SharedQuantizationSpec,
    SpecKind,
    annotate_node,
    annotate_single_in_single_out,
    get_annotation,
    is_annotated,
    is_float_tensor,
    output_spec_of,
    spec_kind,
)
from quantplug_qnn_htp.configs import BLOCK_MAP_STATE, QnnQuantizationConfig, bias_spec_for, weight_spec_for
from quantplug_qnn_htp.decompositions import ABSOLUTE_RANGE_KEY

#: node meta set by the ``mark_masks`` pass: argument positions holding ``±inf`` mask constants
MASK_ARGS_KEY = "qnn_htp_mask_args"

aten = torch.ops.aten


def act_spec(config: QuantizationConfig) -> QuantizationSpecBase | None:
    return config.input_activation


def out_spec(config: QuantizationConfig, node: Node) -> QuantizationSpecBase | None:
    return config.output_activation if is_float_tensor(node) else None


def block_map(context: BackendContext | None) -> Mapping[str, int] | None:
    """The per-node LPBQ block sizes of this quantizer (``block_size_map``)."""
    return None if context is None else context.state.get(BLOCK_MAP_STATE)


def annotate_weighted_op(
    node: Node,
    config: QuantizationConfig,
    kind: str,
    *,
    input_index: int = 0,
    weight_index: int = 1,
    bias_index: int | None = 2,
    groups: int = 1,
    context: BackendContext | None = None,
) -> None:
    """Conv / transpose conv / linear / addmm: input, weight (per-tensor/channel or LPBQ),
    derived bias, output."""
    if is_annotated(node):
        return
    args = node.args
    act = args[input_index] if len(args) > input_index else None
    weight = args[weight_index] if len(args) > weight_index else None
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    if is_float_tensor(act) and config.input_activation is not None:
        inputs[act] = config.input_activation  # type: ignore[index]
    w_spec = None
    if is_float_tensor(weight):
        w_spec = weight_spec_for(node, weight, config, kind, block_map(context))  # type: ignore[arg-type]
        if w_spec is not None:
            inputs[weight] = w_spec  # type: ignore[index]
    if (
        bias_index is not None
        and len(args) > bias_index
        and is_float_tensor(args[bias_index])
        and act in inputs
    ):
        b = bias_spec_for(node, act, weight, w_spec, config, bias=args[bias_index], groups=groups)  # type: ignore[arg-type]
        if b is not None:
            inputs[args[bias_index]] = b  # type: ignore[index]
    out = out_spec(config, node)
    if inputs or out is not None:
        annotate_node(node, inputs, out)


def annotate_all_float_args(node: Node, config: QuantizationConfig, *, limit: int | None = None) -> None:
    """Every float tensor argument gets the activation spec; the output too (where, masked_fill).

    With ``-inf`` masks (marked by the ``mark_masks`` pass) the output is observed without the
    mask values and the mask constant shares the output's encoding, so a masked entry lands on
    the grid's minimum, ``mask_margin`` below the real data (see ``observers.MaskAwareObserver``);
    a mask computed at run time gets its own grid, observed without its mask values.
    """
    if is_annotated(node):
        return
    mask_args = set(node.meta.get(MASK_ARGS_KEY, ()))
    masked = bool(mask_args) and isinstance(config, QnnQuantizationConfig)
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    out = out_spec(config, node)
    if masked and out is not None:
        out = config.masked(out)  # type: ignore[attr-defined]
    args = node.args if limit is None else node.args[:limit]
    for i, a in enumerate(args):
        if not is_float_tensor(a) or config.input_activation is None or a in inputs:
            continue
        if masked and i in mask_args and out is not None and a.op == "get_attr":  # type: ignore[union-attr]
            inputs[a] = SharedQuantizationSpec(node)  # type: ignore[index]
        elif masked and i in mask_args and out is not None:
            # a mask made at run time (T5's where(causal, position_bias, finfo.min)): its own
            # grid, observed without the mask values (its real values are not this output's)
            inputs[a] = config.masked(config.input_activation)  # type: ignore[attr-defined,index]
        else:
            inputs[a] = config.input_activation  # type: ignore[index]
    if inputs or out is not None:
        annotate_node(node, inputs, out)


def observe_absolute_range(node: Node, config: QuantizationConfig) -> None:
    """A per-row statistic (``ABSOLUTE_RANGE_KEY``, set by the decompositions) is observed over
    its absolute range: its output spec takes the config's ``statistic`` observer, whose group
    priority also governs the consumers sharing it. Call after the node's rule annotated it."""
    if not node.meta.get(ABSOLUTE_RANGE_KEY) or not isinstance(config, QnnQuantizationConfig):
        return
    ann = get_annotation(node)
    spec = None if ann is None else ann.output_qspec
    if spec is None or spec_kind(spec) is not SpecKind.PLAIN or config.statistic is None:
        return
    ctr = config.statistic.observer_or_fake_quant_ctr  # type: ignore[attr-defined]
    ann.output_qspec = dataclasses.replace(spec, observer_or_fake_quant_ctr=ctr)  # type: ignore[union-attr]


def annotate_siso(node: Node, config: QuantizationConfig) -> None:
    """Single input, single output, on the activation grid (per-row statistics: absolute range)."""
    annotate_single_in_single_out(node, config)
    observe_absolute_range(node, config)


def annotate_input_shared_out(node: Node, config: QuantizationConfig, *, output: bool = True) -> Node | None:
    """Input 0 gets the activation spec; the output (if a tensor) shares that edge. Returns the input."""
    if is_annotated(node):
        return None
    arg = node.args[0] if node.args else None
    if not is_float_tensor(arg) or config.input_activation is None:
        return None
    out = SharedQuantizationSpec((arg, node)) if output and is_float_tensor(node) else None
    annotate_node(node, {arg: config.input_activation}, out)  # type: ignore[dict-item]
    return arg  # type: ignore[return-value]


def is_fixed_output(node: Any) -> bool:
    """True when ``node``'s output resolves to a fixed-qparams spec (sigmoid, tanh...)."""
    seen = 0
    spec = output_spec_of(node) if isinstance(node, Node) else None
    while spec is not None and spec_kind(spec) is SpecKind.SHARED and seen < 64:
        target = spec.edge_or_node  # type: ignore[attr-defined]
        if isinstance(target, tuple):
            ann = get_annotation(target[1])
            spec = None if ann is None else ann.input_qspec_map.get(target[0])
        else:
            spec = output_spec_of(target)
        seen += 1
    return spec is not None and spec_kind(spec) is SpecKind.FIXED


#: ops returning a tuple whose float pieces share the op's input encoding
SHARED_PIECE_OPS = frozenset(
    {
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.split_with_sizes_copy.default,
        aten.chunk.default,
        aten.unbind.int,
        aten.topk.default,
        aten.sort.default,
    }
)
GETITEM = operator.getitem
