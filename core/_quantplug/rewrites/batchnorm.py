"""Folding inference batch norm into the conv or linear before it, before annotation.

Quantizing a conv and then a batch norm would put an encoding between them that no backend
wants; folding first gives one weighted op. New fused tensors are registered as new attributes
so the caller's parameters are never written.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch.fx import GraphModule, Node
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from _quantplug.graph.attrs import attr_value
from _quantplug.graph.working_copy import AttrNamer
from _quantplug.meta import FOLDED_FROM
from _quantplug.peers.torch_dead_code import eliminate_dead_code

aten = torch.ops.aten

_CONVS = {
    aten.conv1d.default: False,
    aten.conv2d.default: False,
    aten.conv3d.default: False,
    # padding="same"/"valid" (a string): the same weights and bias to fold
    aten.conv1d.padding: False,
    aten.conv2d.padding: False,
    aten.conv3d.padding: False,
    aten.conv_transpose1d.default: True,
    aten.conv_transpose2d.input: True,
    aten.conv_transpose3d.input: True,
}
_BN = (aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)


def _constant(gm: GraphModule, node: object) -> torch.Tensor | None:
    if isinstance(node, Node) and node.op == "get_attr":
        value = attr_value(gm, node)
        return value if isinstance(value, torch.Tensor) else None
    return None


def _rank(node: object) -> int:
    """The rank of ``node``'s tensor (0 if unknown)."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _like(node: object, fake: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """``node``'s fake value if it is what ``fake.new_empty(shape)`` would make (a contiguous
    tensor of that shape and of ``fake``'s dtype and device that needs no grad), else None.

    The folded bias of a conv without one describes a per-channel vector: the batch norm's running
    mean (whose node the fold leaves unread) already is one. Reusing it spares a fake-tensor
    dispatch per fold (a fifth of folding a ResNet's batch norms), as the folded weight and a
    folded existing bias reuse their originals' values."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if (
        isinstance(val, torch.Tensor)
        and val.dtype == fake.dtype
        and val.device == fake.device
        and val.shape == shape
        and val.is_contiguous()
        and not val.requires_grad
    ):
        return val
    return None


#: ``gm.meta`` key: folded weight attribute -> the weight it was folded from (``"layer1.0.conv1.weight"``),
#: so messages about a folded weight name what the user wrote


def fold_batch_norm(gm: GraphModule) -> int:
    """Fold eval-mode batch norms into a preceding conv/linear (single user); returns how many."""
    namer = AttrNamer(gm)
    folded_from: dict[str, str] = gm.meta.setdefault(FOLDED_FROM, {})
    folded = 0
    graph = gm.graph
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target not in _BN:
            continue
        producer = bn.args[0]
        if not isinstance(producer, Node) or producer.op != "call_function" or len(producer.users) != 1:
            continue
        is_linear = producer.target == aten.linear.default
        if producer.target not in _CONVS and not is_linear:
            continue
        if bn.target == aten.batch_norm.default:
            training, eps = bn.args[5], bn.args[7]
        else:
            training, eps = False, bn.args[6]
        if training:
            continue
        if is_linear and _rank(producer.args[0]) > 2:
            # linear maps the last dim, batch norm the channel dim (1): the same dim only for a
            # 2-D input. Folding a 3-D one would change the float model (by up to 4 on a small
            # Linear+BatchNorm1d); torchao skips it with this warning, so does quantplug
            warnings.warn(
                f"Not fusing linear+bn for node '{producer.name}': the linear input is "
                f"{_rank(producer.args[0])}-D so Linear and BatchNorm operate on different dimensions",
                UserWarning,
                stacklevel=2,
            )
            continue
        tensors = [_constant(gm, a) for a in bn.args[1:5]]
        weight_node = producer.args[1]
        if not isinstance(weight_node, Node):
            continue
        weight = _constant(gm, weight_node)
        bias_arg = producer.args[2] if len(producer.args) > 2 else None
        bias = _constant(gm, bias_arg)
        bn_w, bn_b, mean, var = tensors
        if weight is None or mean is None or var is None or (bias_arg is not None and bias is None):
            continue
        if bn_w is None:
            bn_w = torch.ones_like(mean)
        if bn_b is None:
            bn_b = torch.zeros_like(mean)
        with torch.no_grad():
            if is_linear:
                fused_w, fused_b = fuse_linear_bn_weights(weight, bias, mean, var, eps, bn_w, bn_b)
            else:
                fused_w, fused_b = fuse_conv_bn_weights(
                    weight,
                    bias,
                    mean,
                    var,
                    eps,
                    bn_w,
                    bn_b,
                    transpose=_CONVS[producer.target],  # type: ignore[index]
                )
        base = str(weight_node.target)
        w_name, b_name = namer(base + "_bnfold_w"), namer(base + "_bnfold_b")
        folded_from[w_name] = folded_from.get(base, base)
        gm.register_parameter(w_name, torch.nn.Parameter(fused_w.detach(), requires_grad=False))
        gm.register_parameter(b_name, torch.nn.Parameter(fused_b.detach(), requires_grad=False))
        with graph.inserting_before(producer):
            w_node = graph.get_attr(w_name)
            b_node = graph.get_attr(b_name)
        for new, old in ((w_node, weight_node), (b_node, bias_arg)):
            if isinstance(old, Node) and "val" in old.meta:
                new.meta["val"] = old.meta["val"]
            elif "val" in weight_node.meta:
                fake = weight_node.meta["val"]
                like = _like(bn.args[3], fake, fused_b.shape)
                new.meta["val"] = like if like is not None else fake.new_empty(fused_b.shape)
        args = list(producer.args)
        if len(args) < 3:
            args.append(None)
        args[1], args[2] = w_node, b_node
        producer.args = tuple(args)
        if bn.target == aten.batch_norm.default:
            bn.replace_all_uses_with(producer)
        else:
            for user in list(bn.users):
                if user.target is operator.getitem and user.args[1] == 0:
                    user.replace_all_uses_with(producer)
        folded += 1
    if folded:
        eliminate_dead_code(gm)
    return folded
