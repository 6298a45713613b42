"""The reference backend's rules modules and the ops each covers.

Op lists are plain names so that listing them imports nothing; the core imports a module only
when a graph contains one of its ops.
"""

from __future__ import annotations

import operator

from quantplug.backend import RulesModule

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
            "aten.conv_transpose3d.input",
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
            "aten.silu_.default",
            "aten.hardswish.default",
            "aten.hardswish_.default",
            "aten.leaky_relu.default",
            "aten.leaky_relu_.default",
            "aten.elu.default",
            "aten.clamp.default",
            "aten.sigmoid.default",
            "aten.sigmoid_.default",
            "aten.tanh.default",
            "aten.tanh_.default",
            "aten.hardsigmoid.default",
            "aten.hardsigmoid_.default",
            "aten.softmax.int",
            "aten._softmax.default",
            "aten.log_softmax.int",
            "aten._log_softmax.default",
        ],
    ),
    RulesModule(
        _P + "binary_rules",
        [
            "aten.add.Tensor",
            "aten.add_.Tensor",
            "aten.sub.Tensor",
            "aten.mul.Tensor",
            "aten.mul_.Tensor",
            "aten.div.Tensor",
        ],
    ),
    RulesModule(
        _P + "matmul_rules",
        [
            "aten.matmul.default",
            "aten.mm.default",
            "aten.bmm.default",
            "aten.addmm.default",
            "aten.baddbmm.default",
        ],
    ),
    RulesModule(
        _P + "pool_rules",
        [
            "aten.max_pool1d.default",
            "aten.max_pool2d.default",
            "aten.max_pool3d.default",
            "aten.avg_pool1d.default",
            "aten.avg_pool2d.default",
            "aten.avg_pool3d.default",
            "aten.adaptive_avg_pool1d.default",
            "aten.adaptive_avg_pool2d.default",
            "aten.adaptive_avg_pool3d.default",
            "aten.mean.dim",
            "aten.mean.default",
            "aten.sum.dim_IntList",
            "aten.sum.default",
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
            "aten.view_copy.default",
            "aten.permute_copy.default",
            "aten.squeeze_copy.dim",
            "aten.squeeze_copy.dims",
            "aten.unsqueeze_copy.default",
            "aten.slice_copy.Tensor",
            "aten.select_copy.int",
            "aten.expand_copy.default",
            "aten.alias.default",
            "aten.dropout.default",
            "aten.unflatten.int",
            "aten.narrow.default",
            "aten.repeat.default",
            "aten.flip.default",
            "aten.roll.default",
            "aten.index_select.default",
            "aten.cat.default",
            "aten.concat.default",
            "aten.stack.default",
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
    RulesModule(
        _P + "norm_rules",
        [
            "aten.layer_norm.default",
            "aten.group_norm.default",
            "aten.batch_norm.default",
            "aten.instance_norm.default",
            "aten.rms_norm.default",
        ],
    ),
    RulesModule(_P + "embedding_rules", ["aten.embedding.default"]),
    RulesModule(_P + "gather_rules", ["aten.index.Tensor"]),
    RulesModule(_P + "attention_rules", ["aten.scaled_dot_product_attention.default"]),
    RulesModule(
        _P + "rnn_rules", ["aten.gru.input", "aten.lstm.input", "aten.rnn_tanh.input", "aten.rnn_relu.input"]
    ),
)
