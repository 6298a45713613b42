"""The reference backend's rules modules and the ops each covers.

Op lists are plain names so that listing them imports nothing; the core imports a module only
when a graph contains one of its ops.
"""

from __future__ import annotations

import operator

from quantplug import RulesModule

_P = "quantplug_reference.rules."

RULE_MODULES: tuple[RulesModule, ...] = (
    RulesModule(
        _P + "conv_rules",
        [
            "aten.conv1d.default",
            "aten.conv2d.default",
            "aten.conv3d.default",
            "aten.conv_transpose1d.default",
            "aten.conv_transpose2d.input",
        ],
    ),
    RulesModule(_P + "linear_rules", ["aten.linear.default"]),
    RulesModule(
        _P + "activation_rules",
        [
            "aten.relu.default",
            "aten.relu_.default",
            "aten.hardtanh.default",
            "aten.hardtanh_.default",
            "aten.relu6.default",
            "aten.gelu.default",
            "aten.silu.default",
            "aten.hardswish.default",
            "aten.sigmoid.default",
            "aten.tanh.default",
            "aten.hardsigmoid.default",
            "aten.softmax.int",
            "aten._softmax.default",
        ],
    ),
    RulesModule(
        _P + "binary_rules",
        [
            "aten.add.Tensor",
            "aten.sub.Tensor",
            "aten.mul.Tensor",
            "aten.matmul.default",
            "aten.bmm.default",
            "aten.mm.default",
        ],
    ),
    RulesModule(
        _P + "pool_rules",
        [
            "aten.max_pool2d.default",
            "aten.max_pool1d.default",
            "aten.avg_pool2d.default",
            "aten.avg_pool1d.default",
            "aten.adaptive_avg_pool2d.default",
            "aten.adaptive_avg_pool1d.default",
            "aten.mean.dim",
            "aten.mean.default",
            "aten.sum.dim_IntList",
        ],
    ),
    RulesModule(
        _P + "shape_rules",
        [
            "aten.view.default",
            "aten.reshape.default",
            "aten._unsafe_view.default",
            "aten.permute.default",
            "aten.transpose.int",
            "aten.t.default",
            "aten.flatten.using_ints",
            "aten.squeeze.dim",
            "aten.squeeze.dims",
            "aten.squeeze.default",
            "aten.unsqueeze.default",
            "aten.contiguous.default",
            "aten.clone.default",
            "aten.slice.Tensor",
            "aten.select.int",
            "aten.expand.default",
            "aten.pad.default",
            "aten.constant_pad_nd.default",
            "aten.pixel_shuffle.default",
            "aten.pixel_unshuffle.default",
            "aten.cat.default",
            "aten.concat.default",
            "aten.split.Tensor",
            "aten.split_with_sizes.default",
            "aten.chunk.default",
            "aten.unbind.int",
            operator.getitem,  # the pieces of a split: "_operator.getitem"
        ],
    ),
    RulesModule(
        _P + "resize_rules",
        [
            "aten.upsample_nearest1d.vec",
            "aten.upsample_nearest2d.vec",
            "aten.upsample_nearest2d.default",
            "aten.upsample_bilinear2d.vec",
            "aten.upsample_bilinear2d.default",
            "aten.upsample_linear1d.vec",
        ],
    ),
    RulesModule(_P + "norm_rules", ["aten.layer_norm.default", "aten.group_norm.default"]),
    RulesModule(_P + "embedding_rules", ["aten.embedding.default"]),
)
