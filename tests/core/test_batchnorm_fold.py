"""Batch-norm folding computes, batched, exactly what torch's per-conv function computes.

:func:`_quantplug.rewrites.batchnorm.fold_batch_norm` does the per-channel arithmetic of all its
convs at once over concatenated vectors (``_fuse_all``) instead of calling
:func:`torch.nn.utils.fusion.fuse_conv_bn_weights` once per conv. Held here to torch's function
bit for bit (values, dtype, shape, strides, a storage of its own per tensor) over conv ranks,
transposed convs, missing bias or affine parameters, eps values, dtypes (the ones it does not
batch go to torch's function), channel counts on both sides of a vector width and channels-last
weights; and end to end on an exported model.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from _quantplug.graph.working_copy import working_copy
from _quantplug.meta import FOLDED_FROM
from _quantplug.rewrites.batchnorm import _Fold, _fuse_all, fold_batch_norm

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return (
        type(ours) is torch.Tensor
        and ours.dtype == theirs.dtype
        and ours.shape == theirs.shape
        and ours.stride() == theirs.stride()
        and ours.storage_offset() == 0
        and ours.untyped_storage().nbytes() == ours.numel() * ours.element_size()
        and not ours.requires_grad
        and torch.equal(_bits(ours), _bits(theirs.detach()))
    )


@st.composite
def _fold(draw: st.DrawFn) -> _Fold:
    rank = draw(st.sampled_from((1, 2, 3)))
    transpose = draw(st.booleans())
    channels = draw(st.sampled_from((1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64)))
    other = draw(st.integers(1, 3))
    kernel = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(DTYPES))
    shape = (other, channels) if transpose else (channels, other)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def vector(scale: float) -> torch.Tensor:
        return (torch.randn(channels, generator=g, dtype=torch.float64) * scale).to(dtype)

    weight = torch.randn(*shape, *[kernel] * rank, generator=g, dtype=torch.float64).to(dtype)
    if rank == 2 and draw(st.booleans()):
        weight = weight.to(memory_format=torch.channels_last)
    var = vector(draw(st.sampled_from((1.0, 1e-3, 1e-20, 1e-40)))).abs()
    if draw(st.booleans()):
        var[0] = 0.0
    bias = vector(1.0) if draw(st.booleans()) else None
    affine = draw(st.booleans())
    bn_w = vector(2.0) if affine else torch.ones(channels, dtype=dtype)
    bn_b = vector(1.0) if affine else torch.zeros(channels, dtype=dtype)
    eps = draw(st.sampled_from((1e-5, 1e-3, 0.1, 1e-12, 0.0)))
    nowhere: Any = None
    return _Fold(
        nowhere, nowhere, nowhere, nowhere, weight, bias, vector(3.0), var, bn_w, bn_b, eps, False, transpose
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(_fold(), min_size=1, max_size=6))
def test_batched_folding_is_torchs_bit_for_bit(folds: list[_Fold]) -> None:
    with torch.no_grad():
        ours = _fuse_all(folds)
    assert len(ours) == len(folds)
    pointers = set()
    for fold, (w, b) in zip(folds, ours, strict=True):
        tw, tb = fuse_conv_bn_weights(
            fold.weight,
            fold.bias,
            fold.mean,
            fold.var,
            fold.eps,
            fold.bn_w,
            fold.bn_b,
            transpose=fold.transpose,
        )
        assert _same(w, tw) and _same(b, tb)
        pointers |= {w.data_ptr(), b.data_ptr()}
    assert len(pointers) == 2 * len(folds)  # no tensor shares another's (or an input's) storage


def test_fold_batch_norm_registers_torchs_fused_weights() -> None:
    """Every conv kind (transposed, 1-D without bias, a non-affine batch norm) and a linear of one
    exported model, folded: the registered tensors are torch's function of the module's own."""
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 17, 3)
            self.bn = torch.nn.BatchNorm2d(17)
            self.up = torch.nn.ConvTranspose2d(17, 9, 2, stride=2, bias=False)
            self.bn_up = torch.nn.BatchNorm2d(9, eps=1e-3)
            self.conv1d = torch.nn.Conv1d(9, 5, 1, bias=False)
            self.bn1d = torch.nn.BatchNorm1d(5, affine=False)
            self.linear = torch.nn.Linear(5, 6)
            self.bn_linear = torch.nn.BatchNorm1d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn_up(self.up(torch.relu(self.bn(self.conv(x)))))
            z = self.bn1d(self.conv1d(y.flatten(2)))
            return self.bn_linear(self.linear(z.mean(-1)))

    model = Model()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.running_mean.normal_()
            module.running_var.uniform_(0.1, 3.0)
            if module.affine:
                torch.nn.init.normal_(module.weight)
                torch.nn.init.normal_(module.bias)
    model.eval()
    gm = working_copy(torch.export.export(model, (torch.randn(2, 3, 6, 6),)))
    assert fold_batch_norm(gm) == 4
    assert not any("batch_norm" in str(n.target) for n in gm.graph.nodes)
    expected = {
        "conv.weight": fuse_conv_bn_weights(
            *(model.conv.weight, model.conv.bias, model.bn.running_mean, model.bn.running_var, 1e-5),
            *(model.bn.weight, model.bn.bias),
        ),
        "up.weight": fuse_conv_bn_weights(
            *(model.up.weight, None, model.bn_up.running_mean, model.bn_up.running_var, 1e-3),
            *(model.bn_up.weight, model.bn_up.bias),
            transpose=True,
        ),
        "conv1d.weight": fuse_conv_bn_weights(
            model.conv1d.weight, None, model.bn1d.running_mean, model.bn1d.running_var, 1e-5, None, None
        ),
        "linear.weight": fuse_linear_bn_weights(
            *(model.linear.weight, model.linear.bias, model.bn_linear.running_mean),
            *(model.bn_linear.running_var, 1e-5, model.bn_linear.weight, model.bn_linear.bias),
        ),
    }
    folded_from = gm.meta[FOLDED_FROM]
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and len(node.args) > 2 and node.args[1].op == "get_attr":
            w_name, b_name = str(node.args[1].target), str(node.args[2].target)
            if w_name in folded_from:
                found[folded_from[w_name]] = (getattr(gm, w_name), getattr(gm, b_name))
    assert found.keys() == expected.keys()
    for name, (w, b) in found.items():
        tw, tb = expected[name]
        assert isinstance(w, torch.nn.Parameter) and not w.requires_grad and not b.requires_grad
        assert _same(w.data, tw) and _same(b.data, tb), name
