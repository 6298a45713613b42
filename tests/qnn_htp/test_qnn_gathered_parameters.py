"""Parameters looked up by index: embedding tables and mixture-of-experts weights.

``W[expert_ids]`` (``aten.index.Tensor``) and ``index_select(W, dim, ids)`` on a parameter are a
QNN Gather of a static tensor, as an embedding's lookup is, and follow ``per_channel_embedding``:
off (ExecuTorch's default), the table takes the activation grid and the gathered rows share it;
on, the table takes the preset's weight grid with one scale per row along the axis looked up and
the rows get their own activation encoding. A gather from a computed tensor moves values and
always shares its input's encoding.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import quantplug

pytest.importorskip("quantplug_qnn_htp")

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed


class GatheredTables(nn.Module):
    """Four experts' ``[4, 8, 16]`` weights gathered per token before a ``bmm``, a table read
    with ``index_select`` along its second axis, and rows gathered from a computed tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.Parameter(torch.randn(4, 8, 16) * 0.2)
        self.table = nn.Parameter(torch.randn(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.router(x).argmax(dim=-1)
        rows = torch.bmm(self.experts[ids], x.unsqueeze(-1)).squeeze(-1)  # [tokens, 8]
        picked = torch.index_select(self.table, 1, ids[:8] * 2)  # [16, 8], columns chosen at run time
        moved = (x * 2.0)[ids]  # a computed tensor's rows
        return rows + x @ picked + moved[:, :8]


def _converted(**options: Any) -> tuple[torch.fx.GraphModule, Any, torch.Tensor, nn.Module]:
    torch.manual_seed(0)
    model, x = GatheredTables().eval(), torch.randn(12, 16)
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w", **options)
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    prepared(x)
    return quantplug.convert(prepared), quantizer, x, model


def _gathers(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """Each gather by the parameter (or the computed tensor) it reads, through its dequantize."""
    found = {}
    for node in gm.graph.nodes:
        if node.target in (aten.index.Tensor, aten.index_select.default):
            dq = node.args[0]
            source = dq.args[0]
            while source.op == "call_function":  # quantize of the computed tensor
                source = source.args[0]
            name = source.name if source.op != "get_attr" else str(source.target)
            found[name.removesuffix("_q0")] = node  # stored integers are named by their group
    return found


def test_by_default_gathered_parameters_take_the_activation_grid_shared_with_their_rows() -> None:
    gm = _converted()[0]
    gathers = _gathers(gm)
    assert set(gathers) == {"experts", "table", "x"}
    for gather in gathers.values():
        dq = gather.args[0]
        assert dq.target == qd.dequantize_per_tensor.default
        assert dq.args[-1] == torch.uint16  # 16a4w's activation grid, not the 4-bit weight one
        requantized = [u for u in gather.users if u.target == qd.quantize_per_tensor.default]
        assert all(q.args[1:] == dq.args[1:] for q in requantized)  # the rows keep the table's encoding


def test_per_channel_embedding_gives_gathered_parameters_one_weight_scale_per_row() -> None:
    gm, quantizer, x, model = _converted(per_channel_embedding=True)
    gathers = _gathers(gm)
    for name, axis, rows in (("experts", 0, 4), ("table", 1, 10)):
        dq = gathers[name].args[0]
        assert dq.target == qd.dequantize_per_channel.default, name
        scales = getattr(gm, dq.args[1].target)
        assert dq.args[3] == axis and scales.numel() == rows, name
        assert (dq.args[4], dq.args[5]) == (-7, 7), name  # the 4-bit weight grid
        codes = getattr(gm, dq.args[0].target)
        assert int(codes.abs().max()) == 7, name
    moved = gathers[next(k for k in gathers if k not in ("experts", "table"))]
    assert moved.args[0].target == qd.dequantize_per_tensor.default  # computed rows: shared, as before
    with torch.no_grad():
        ref = model(x)
        assert float((gm(x) - ref).pow(2).mean() / ref.pow(2).mean()) < 0.02

    artifact = quantplug.lower(gm, quantizer)  # strict: every tensor encoded
    params = {e["name"]: e for e in json.loads(artifact.files["model.encodings"])["param_encodings"]}
    experts = next(e for n, e in params.items() if "experts" in n)
    assert experts["enc_type"] == "PER_CHANNEL" and experts["bw"] == 4 and len(experts["scale"]) == 4


def test_per_channel_experts_dequantize_to_the_weights_within_half_a_step() -> None:
    """The stored 4-bit codes times their expert's scale reproduce each expert's weights."""
    gm, _, _, model = _converted(per_channel_embedding=True)
    dq = _gathers(gm)["experts"].args[0]
    codes, scales = getattr(gm, dq.args[0].target), getattr(gm, dq.args[1].target)
    dequantized = codes.float() * scales.view(-1, 1, 1)
    assert torch.allclose(dequantized, model.experts.detach(), atol=float(scales.max()) / 2 + 1e-6)
