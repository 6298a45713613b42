"""Pooling and resizing: single-in-single-out (each output gets its own encoding, as ExecuTorch)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import QuantizationConfig, annotate_single_in_single_out, register_annotator

aten = torch.ops.aten

_SISO = {
    "PoolAvg2d": [
        aten.adaptive_avg_pool1d.default,
        aten.adaptive_avg_pool2d.default,
        aten.avg_pool1d.default,
        aten.avg_pool2d.default,
    ],
    "PoolAvg3d": [aten.avg_pool3d.default, aten.adaptive_avg_pool3d.default],
    # max_pool2d_with_indices returns a tuple: its input is annotated here, the values via getitem
    "PoolMax2d": [
        aten.max_pool2d.default,
        aten.max_pool2d_with_indices.default,
        aten.adaptive_max_pool2d.default,
    ],
    "Resize": [aten.upsample_bicubic2d.vec],
    "ResizeBilinear": [aten.upsample_bilinear2d.vec],
    "ResizeNearestNeighbor": [aten.upsample_nearest2d.vec],
}


def _siso(backend_op: str, ops: list) -> None:
    @register_annotator(ops, backend_op=backend_op)
    def annotate(node: Node, config: QuantizationConfig) -> None:
        annotate_single_in_single_out(node, config)

    annotate.__name__ = f"annotate_{backend_op}"
    globals()[annotate.__name__] = annotate


for _op, _ops in _SISO.items():
    _siso(_op, _ops)
