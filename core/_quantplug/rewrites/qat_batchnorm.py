"""Conv + batch norm under quantization-aware training: simulated folding, then the real fold.

Post-training prepare folds an inference batch norm into its conv before annotation
(:mod:`_quantplug.rewrites.batchnorm`). In training the batch norm must keep normalizing with
batch statistics and updating its running ones, yet the weight the network learns to tolerate
being fake-quantized must be the one the deployed, folded conv will use. PT2E (torchao's
``prepare_qat_pt2e``, after ``nniqat.ConvBn2d._forward_approximate``) solves this by rewriting::

    bn(conv(x, w, b))
      ->  bn(conv(x, fq(w * sf), zeros_like(b)) / sf + b)     sf = bn.weight / sqrt(running_var + eps)

so the conv sees the folded weight ``w * sf`` (observed and fake-quantized) while the float
result is unchanged; :func:`fuse_conv_bn_for_training` does this after annotation, moving the
conv's weight and bias specs (and every shared or derived spec naming those edges) onto the new
nodes. At convert, :func:`fold_trained_batch_norms` replaces the pattern by the conv with the
batch norm folded into its weight and bias (the batch norm node is gone, in train mode too), and
the weight is quantized with the encoding its fake-quantize learned.

Matched directly (the conv's single user is the batch norm), not by subgraph patterns: torchao
matches a traced pattern per conv kind and bias variant, which costs minutes per model on a
loaded machine. Differences from torchao, on purpose: the batch norm's own ``eps`` and
``momentum`` are kept (torchao's replacement pattern hard-codes 1e-5 and 0.1); only convs whose
weight is annotated are rewritten (torchao also rewrites convs it leaves float, and never folds
those back).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.nn.utils.fusion import fuse_conv_bn_weights

from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.graph.attrs import fetch_attr
from _quantplug.graph.working_copy import AttrNamer
from _quantplug.meta import DEBUG_HANDLE_KEY

aten = torch.ops.aten

#: conv op -> whether it is transposed (its weight holds output channels on axis 1)
_CONVS = {
    aten.conv1d.default: False,
    aten.conv2d.default: False,
    aten.conv3d.default: False,
    aten.conv_transpose1d.default: True,
    aten.conv_transpose2d.input: True,
    aten.conv_transpose3d.input: True,
}
#: the batch-norm ops a trained conv can feed: training (export's training IR), and the inference
#: forms torchao's ``move_exported_model_to_eval`` rewrites them to
_TRAINING_BN = (aten.batch_norm.default,)
_ANY_BN = (
    aten.batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default,
)
#: ``conv.meta`` key marking a conv rewritten here (convert folds only those)
FUSED_KEY = "quantplug_qat_conv_bn"
#: meta copied from the conv onto the nodes that compute its folded weight and bias
_CONV_META = ("nn_module_stack", "source_fn_stack", "stack_trace", "from_node")


def fuse_conv_bn_for_training(gm: GraphModule) -> int:
    """Rewrite every annotated ``conv -> batch_norm`` of ``gm`` into the simulated-folding form.

    Runs after annotation, before observers go in; returns how many were rewritten.
    """
    nodes: dict[Node, Node] = {}  # old node -> the node now holding its value
    edges: dict[tuple[Node, Node], tuple[Node, Node]] = {}
    count = 0
    for bn in list(gm.graph.nodes):
        found = _trainable_pair(bn)
        if found is None:
            continue
        conv, weight, bias = found
        new_weight, new_bias, unscaled = _rewrite(gm.graph, conv, bn, weight, bias)
        nodes.update({weight: new_weight, conv: unscaled})
        edges.update({(weight, conv): (new_weight, conv), (conv, bn): (unscaled, bn)})
        if bias is not None and new_bias is not None:
            nodes[bias] = new_bias
            edges[(bias, conv)] = (new_bias, conv)
        _move_input_specs(conv, {weight: new_weight, **({bias: new_bias} if bias is not None else {})})
        _move_input_specs(bn, {conv: unscaled})
        _move_output_spec(conv, unscaled)
        conv.meta[FUSED_KEY] = True
        count += 1
    if nodes:
        _update_spec_references(gm.graph, nodes, edges)
    return count


def _trainable_pair(bn: Node) -> tuple[Node, Node, Node | None] | None:
    """(conv, weight, bias) when ``bn`` is a training batch norm of an annotated conv it alone reads."""
    if bn.op != "call_function" or bn.target not in _TRAINING_BN or len(bn.args) < 8:
        return None
    conv = bn.args[0]
    if not isinstance(conv, Node) or conv.op != "call_function" or conv.target not in _CONVS:
        return None
    if len(conv.users) != 1 or FUSED_KEY in conv.meta:
        return None
    bn_weight, running_var = bn.args[1], bn.args[4]
    if not isinstance(bn_weight, Node) or not isinstance(running_var, Node):
        return None  # an affine-free batch norm has no scale to fold
    weight = conv.args[1]
    bias = conv.args[2] if len(conv.args) > 2 else None
    if not isinstance(weight, Node) or (bias is not None and not isinstance(bias, Node)):
        return None
    annotation = conv.meta.get(Q_ANNOTATION_KEY)
    if annotation is None or weight not in (getattr(annotation, "input_qspec_map", None) or {}):
        return None
    groups = conv.args[8] if _CONVS[conv.target] and len(conv.args) > 8 else 1  # type: ignore[index]
    if groups != 1:  # a grouped transposed conv's output channels span two weight axes
        return None
    return conv, weight, bias


def _rewrite(
    graph: Graph, conv: Node, bn: Node, weight: Node, bias: Node | None
) -> tuple[Node, Node | None, Node]:
    """Insert the simulated folding around ``conv``; returns its new weight and bias arguments
    and the node computing what the conv computed before (the batch norm's new input)."""
    rank = _rank(weight)
    transposed = _CONVS[conv.target]  # type: ignore[index]
    weight_shape = [1] * rank
    weight_shape[1 if transposed else 0] = -1
    channel_shape = [1] * rank
    channel_shape[1] = -1
    bn_weight, running_var, eps = bn.args[1], bn.args[4], bn.args[7]
    made: list[Node] = []

    def add(target: Any, *args: Any, **kwargs: Any) -> Node:
        node = graph.call_function(target, args, kwargs)
        made.append(node)
        return node

    with graph.inserting_before(conv):
        std = add(aten.sqrt.default, add(aten.add.Tensor, running_var, eps))
        scale = add(aten.div.Tensor, bn_weight, std)
        scaled_weight = add(aten.mul.Tensor, weight, add(aten.reshape.default, scale, weight_shape))
        zero_bias = None
        if bias is not None:
            dtype = _dtype(conv.args[0])
            zero_bias = add(aten.zeros_like.default, bias, **({"dtype": dtype} if dtype is not None else {}))
    with graph.inserting_before(conv.next):  # in order, right after the conv
        out = add(aten.div.Tensor, conv, add(aten.reshape.default, scale, channel_shape))
        if bias is not None:
            out = add(aten.add.Tensor, out, add(aten.reshape.default, bias, channel_shape))
    bn.replace_input_with(conv, out)
    args = list(conv.args)
    args[1] = scaled_weight
    if len(args) > 2:
        args[2] = zero_bias
    conv.args = tuple(args)
    for node in made:
        for key in _CONV_META:
            if key in conv.meta:
                node.meta[key] = conv.meta[key]
        node.meta[DEBUG_HANDLE_KEY] = node.name
    _infer_values(made)
    return scaled_weight, zero_bias, out


def _rank(weight: Node) -> int:
    val = weight.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dim()
    raise ValueError(f"conv weight {weight.name} has no recorded shape")


def _dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _infer_values(nodes: list[Node]) -> None:
    """Record the ``val`` (fake tensor) of each new node, as export would have."""

    def val(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, Node) else arg

    for node in nodes:
        args = [val(a) for a in node.args]
        kwargs = {k: val(v) for k, v in node.kwargs.items()}
        fakes = [a for a in args if isinstance(a, torch.Tensor)]
        if len(fakes) != len([a for a in node.args if isinstance(a, Node)]):
            continue
        mode = getattr(fakes[0], "fake_mode", None) if fakes else None
        try:
            if mode is not None:
                with mode:
                    node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception:  # a value the fake mode cannot compute is left unrecorded, as FX does
            node.meta.pop("val", None)


def _move_input_specs(node: Node, moved: dict[Node, Node | None]) -> None:
    """``node``'s specs on its old inputs now sit on their replacements."""
    annotation = node.meta.get(Q_ANNOTATION_KEY)
    specs = getattr(annotation, "input_qspec_map", None)
    if not specs:
        return
    new: dict[Node, Any] = {}
    for arg, spec in specs.items():
        target = moved.get(arg, arg)
        if target is not None:
            new[target] = spec
    annotation.input_qspec_map = new  # type: ignore[union-attr]


def _move_output_spec(conv: Node, unscaled: Node) -> None:
    """A spec on the conv's output measures what the conv computed: it now sits on the node that
    computes it again (the conv itself now computes the scaled product)."""
    annotation: Any = conv.meta.get(Q_ANNOTATION_KEY)
    if getattr(annotation, "output_qspec", None) is None:
        return
    moved = copy.copy(annotation)
    moved.input_qspec_map = {}
    unscaled.meta[Q_ANNOTATION_KEY] = moved
    annotation.output_qspec = None


def _update_spec_references(
    graph: Graph, nodes: dict[Node, Node], edges: dict[tuple[Node, Node], tuple[Node, Node]]
) -> None:
    """Shared and derived specs anywhere that name a rewritten node or edge name its replacement."""

    def edge_or_node(ref: Any) -> Any:
        if isinstance(ref, Node):
            return nodes.get(ref, ref)
        if isinstance(ref, tuple) and len(ref) == 2:
            return edges.get(ref, ref)
        return ref

    def updated(spec: Any) -> Any:
        if spec is None or not dataclasses.is_dataclass(spec) or isinstance(spec, type):
            return spec
        if hasattr(spec, "edge_or_node"):
            new = edge_or_node(spec.edge_or_node)
            return spec if new is spec.edge_or_node else dataclasses.replace(spec, edge_or_node=new)
        if hasattr(spec, "derived_from"):
            sources = [edge_or_node(s) for s in spec.derived_from]
            return dataclasses.replace(spec, derived_from=sources)
        return spec

    for node in graph.nodes:
        annotation = node.meta.get(Q_ANNOTATION_KEY)
        if annotation is None:
            continue
        specs = getattr(annotation, "input_qspec_map", None) or {}
        annotation.input_qspec_map = {k: updated(v) for k, v in specs.items()}
        annotation.output_qspec = updated(getattr(annotation, "output_qspec", None))


# -- convert --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Trained:
    """One rewritten conv's nodes, as found in a prepared graph."""

    conv: Node
    weight_product: Node  # w * reshape(sf), read by the weight's fake-quantize
    weight: Node
    bias: Node | None  # the conv's own bias (get_attr), None without one
    zero_bias: Node | None  # zeros_like(bias), the conv's bias argument in training
    bn: Node
    bn_output: Node  # the node whose users read the normalized value (bn, or its getitem 0)
    between: list[Node]  # div (and add) between the conv and the batch norm


def fold_trained_batch_norms(prepared: GraphModule, is_observer: Callable[[Node], bool]) -> GraphModule:
    """``prepared`` with every conv rewritten by :func:`fuse_conv_bn_for_training` folded.

    Returns ``prepared`` itself when there is none; otherwise a new GraphModule over a copy of
    its graph (sharing its modules and tensors, never writing them) in which each batch norm is
    folded into its conv's weight and bias, as inference would run it: the weight's
    fake-quantize now reads the folded weight, the conv the folded bias, and the batch norm
    (with its ``num_batches_tracked`` update) is gone.
    """
    if not any(FUSED_KEY in n.meta for n in prepared.graph.nodes):
        return prepared
    graph = Graph(owning_module=None, tracer_cls=prepared.graph._tracer_cls)
    graph._codegen = prepared.graph._codegen
    env: dict[Node, Node] = {}
    output = graph.graph_copy(prepared.graph, env)
    graph.output(output)
    folded = GraphModule(prepared, graph, class_name=type(prepared).__name__)
    for name, child in prepared.named_children():  # whole containers, observers without nodes too
        folded.add_module(name, child)
    folded.meta.update(prepared.meta)
    namer = AttrNamer(folded)
    for conv in [n for n in graph.nodes if FUSED_KEY in n.meta]:
        trained = _find_trained(conv, is_observer)
        if trained is not None:
            _fold(folded, trained, namer)
    graph.eliminate_dead_code()
    folded.recompile()
    return folded


def _find_trained(conv: Node, is_observer: Callable[[Node], bool]) -> _Trained | None:
    weight_arg = conv.args[1]
    product = weight_arg.args[0] if isinstance(weight_arg, Node) and is_observer(weight_arg) else weight_arg
    if not isinstance(product, Node) or product.target != aten.mul.Tensor:
        return None
    weight = product.args[0]
    bias_arg = conv.args[2] if len(conv.args) > 2 else None
    zero_bias = bias_arg.args[0] if isinstance(bias_arg, Node) and is_observer(bias_arg) else bias_arg
    bias = zero_bias.args[0] if isinstance(zero_bias, Node) else None
    if not isinstance(zero_bias, (Node, type(None))) or not isinstance(bias, (Node, type(None))):
        return None
    between: list[Node] = []
    node = conv
    while len(node.users) == 1:
        (user,) = node.users
        if user.target in _ANY_BN:
            break
        if user.target not in (aten.div.Tensor, aten.add.Tensor) or len(between) >= 2:
            return None
        between.append(user)
        node = user
    else:
        return None
    bn = next(iter(node.users))
    bn_output = bn
    if bn.target != aten.batch_norm.default:  # the native forms return (out, mean, rstd)
        outputs = [u for u in bn.users if u.target is operator.getitem and u.args[1] == 0]
        if len(outputs) != 1:
            return None
        bn_output = outputs[0]
    if not isinstance(weight, Node) or weight.op != "get_attr":
        return None
    return _Trained(conv, product, weight, bias, zero_bias, bn, bn_output, between)


def _bn_arguments(gm: GraphModule, bn: Node) -> tuple[list[torch.Tensor | None], float]:
    """(weight, bias, running mean, running var) values and eps of a batch-norm node."""
    eps_index = 6 if bn.target == aten._native_batch_norm_legit_no_training.default else 7
    values = [fetch_attr(gm, str(a.target)) if isinstance(a, Node) else None for a in bn.args[1:5]]
    return values, float(bn.args[eps_index])  # type: ignore[arg-type]


def _fold(gm: GraphModule, trained: _Trained, namer: AttrNamer) -> None:
    graph = gm.graph
    conv, bn = trained.conv, trained.bn
    (bn_w, bn_b, mean, var), eps = _bn_arguments(gm, bn)
    assert mean is not None and var is not None
    weight = fetch_attr(gm, str(trained.weight.target))
    bias = fetch_attr(gm, str(trained.bias.target)) if trained.bias is not None else None
    with torch.no_grad():
        fused_w, fused_b = fuse_conv_bn_weights(
            weight.detach(),
            bias.detach() if bias is not None else None,
            mean,
            var,
            eps,
            bn_w.detach() if bn_w is not None else torch.ones_like(mean),
            bn_b.detach() if bn_b is not None else torch.zeros_like(mean),
            transpose=_CONVS[conv.target],  # type: ignore[index]
        )
    base = str(trained.weight.target)
    w_name, b_name = namer(base + "_bnfold_w"), namer(base + "_bnfold_b")
    gm.register_parameter(w_name, torch.nn.Parameter(fused_w.detach(), requires_grad=False))
    gm.register_parameter(b_name, torch.nn.Parameter(fused_b.detach(), requires_grad=False))
    with graph.inserting_before(trained.weight_product):  # before the zeros_like and its observer
        w_node = graph.get_attr(w_name)
        b_node = graph.get_attr(b_name)
    for new, like, value in ((w_node, trained.weight, fused_w), (b_node, conv, fused_b)):
        for key in _CONV_META:
            if key in conv.meta:
                new.meta[key] = conv.meta[key]
        fake = like.meta.get("val")
        mode = getattr(fake, "fake_mode", None)
        if mode is not None:
            new.meta["val"] = mode.from_tensor(value, static_shapes=True)
        new.meta[DEBUG_HANDLE_KEY] = new.name
    trained.weight_product.replace_all_uses_with(w_node)
    if trained.zero_bias is not None:
        trained.zero_bias.replace_all_uses_with(b_node)
    else:
        args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
        args[2] = b_node
        conv.args = tuple(args)
    trained.bn_output.replace_all_uses_with(conv)
    _drop_batch_count(graph, bn)
    for node in [trained.bn_output, bn, *reversed(trained.between)]:
        if node in graph.nodes and not node.users:
            graph.erase_node(node)
    del conv.meta[FUSED_KEY]


def _drop_batch_count(graph: Graph, bn: Node) -> None:
    """Erase the ``num_batches_tracked += 1`` of a folded batch norm (its module is gone)."""
    running_var = bn.args[4]
    if not isinstance(running_var, Node) or running_var.op != "get_attr":
        return
    owner = str(running_var.target).rpartition(".")[0]
    counter = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target in (aten.add_.Tensor, aten.add.Tensor)
            and isinstance(node.args[0], Node)
            and node.args[0].op == "get_attr"
            and node.args[0].target == counter
            and not node.users
        ):
            graph.erase_node(node)
