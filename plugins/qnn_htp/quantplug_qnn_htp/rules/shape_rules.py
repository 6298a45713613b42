"""Data movement. Reshape/Transpose/DepthToSpace/SpaceToDepth/ChannelShuffle/Tile/Gather share the
input encoding (QNN math-invariant ops: no requantization); StridedSlice and Pad get their own
output encoding, as in ExecuTorch."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    annotate_shared_in_out,
    annotate_single_in_single_out,
    register_annotator,
)

aten = torch.ops.aten

_SHARED = {
    "Transpose": [aten.permute.default, aten.swapaxes.default, aten.transpose.int],
    "DepthToSpace": [aten.pixel_shuffle.default],
    "SpaceToDepth": [aten.pixel_unshuffle.default],
    "ChannelShuffle": [aten.channel_shuffle.default],
    "Tile": [aten.expand.default, aten.repeat.default],
    "Reshape": [
        aten.flatten.using_ints,
        aten.reshape.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze_copy.dims,
        aten.unflatten.int,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.unsqueeze_copy.default,
        aten.view_copy.default,
        aten.view.default,
    ],
}

_SISO = {
    "StridedSlice": [aten.flip.default, aten.narrow.default, aten.select.int, aten.slice.Tensor],
    "Pad": [aten.pad.default, aten.reflection_pad1d.default, aten.reflection_pad2d.default],
}


def _register(backend_op: str | None, ops: list, fn, tag: str) -> None:  # type: ignore[no-untyped-def]
    @register_annotator(ops, backend_op=backend_op)
    def annotate(node: Node, config: QuantizationConfig) -> None:
        fn(node, config)

    annotate.__name__ = f"annotate_{tag}"
    globals()[annotate.__name__] = annotate


for _op, _ops in _SHARED.items():
    _register(_op, _ops, annotate_shared_in_out, _op)
for _op, _ops in _SISO.items():
    _register(_op, _ops, annotate_single_in_single_out, _op)
# no 1:1 QNN op in ExecuTorch's table: never validated
_register(None, [aten.expand_as.default], annotate_shared_in_out, "expand_as")
_register(None, [aten.gather.default], annotate_shared_in_out, "gather")  # index: embedding_rules
