"""The reference backend's rules modules and the ops each covers.

Op lists are plain names so that listing them imports nothing; the core imports a module only
when a graph contains one of its ops.
"""

from __future__ import annotations

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
            "aten.linear.default",
        ],
    ),
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
            "aten.cat.default",
            "aten.concat.default",
        ],
    ),
    RulesModule(_P + "norm_rules", ["aten.layer_norm.default"]),
    RulesModule(_P + "embedding_rules", ["aten.embedding.default"]),
)
