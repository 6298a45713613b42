"""Foreign observers that find their peers by node name work under quantplug.prepare (issue 16.1).

ExecuTorch's ``ConcatObserver`` widens the observers of a ``cat``'s inputs and finds them as
``getattr(gm, observer_node.name)``, which holds in torchao's prepare (a node's name is its
module's attribute) but not in quantplug's single observer container unless the prepared module
resolves node names. Every model here has a ``cat``; each runs through ExecuTorch's QnnQuantizer
with torchao's ``prepare_pt2e``/``convert_pt2e`` and with ``quantplug.prepare``/``convert`` on the
same batches, and both must give the same program: same outputs, same scales and zero points.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.flow.inspect import encodings
from _quantplug.flow.prepare import PreparedModule
from _quantplug.meta import OBSERVER_PREFIX, observer_children

from ..qnn_htp.real_models import small_vit, torchvision_model

pytest.importorskip("torchao.quantization.pt2e")
os.environ.setdefault("QNN_SDK_ROOT", "")  # or ExecuTorch tries to download an SDK
qnn = pytest.importorskip("executorch.backends.qualcomm.quantizer.quantizer")

pytestmark = pytest.mark.executorch


class TwoConvCat(nn.Module):
    """Two convolutions of one input, concatenated: the smallest graph that broke (issue 16.1)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, channels, 3, padding=1)
        self.b = nn.Conv2d(3, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), torch.relu(self.b(x))], dim=1)


class CatOfCat(nn.Module):
    """cat of three branches, one of them itself a cat, and an input used twice."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, channels, 1)
        self.b = nn.Conv2d(3, channels, 3, padding=1)
        self.c = nn.Conv2d(2 * channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        inner = torch.cat([a, self.b(x)], dim=1)
        return torch.cat([inner, self.c(inner), a], dim=1)


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: torchvision_model(name, **kwargs)


# name -> (factory, input shape)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "two_conv_cat_8": (lambda: TwoConvCat(8), (1, 3, 8, 8)),
    "two_conv_cat_24": (lambda: TwoConvCat(24), (2, 3, 12, 12)),
    "cat_of_cat_4": (lambda: CatOfCat(4), (1, 3, 8, 8)),
    "cat_of_cat_16": (lambda: CatOfCat(16), (1, 3, 16, 16)),
    "squeezenet1_1": (_torchvision("squeezenet1_1", num_classes=10), (1, 3, 64, 64)),
    "shufflenet_v2_x0_5": (_torchvision("shufflenet_v2_x0_5", num_classes=10), (1, 3, 64, 64)),
    "vit_tiny": (small_vit, (1, 3, 32, 32)),
}


def _scales(gm: torch.fx.GraphModule) -> list[object]:
    """The distinct encodings' grids, scales and zero points. Not their kinds or counts: ViT's
    class token shares the ``cat``'s group through ``expand``; torchao folds the parameter's
    quantize into a constant and quantizes the expanded copy again at run time (two encodings),
    quantplug stores the expanded copy as integers once (one), with the same qparams."""
    return sorted({(e["dtype"], repr(e["scale"]), repr(e["zero_point"])) for e in encodings(gm)})


def _flows(name: str, batches: int = 3) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, torch.Tensor]:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(*shape, generator=g) for _ in range(batches + 1)]
    ep = torch.export.export(model, (data[0],))
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for flow in ("torchao", "quantplug"):
            quantizer = qnn.QnnQuantizer()
            prepared = (
                prepare_pt2e(ep.module(), quantizer)
                if flow == "torchao"
                else quantplug.prepare(ep, quantizer)
            )
            with torch.no_grad():
                for x in data[:batches]:
                    prepared(x)
            results.append(convert_pt2e(prepared) if flow == "torchao" else quantplug.convert(prepared))
    return results[0], results[1], data[-1]


@pytest.mark.parametrize("name", list(MODELS))
def test_qnn_quantizer_with_cat_matches_torchao(name: str) -> None:
    ao, qp, x = _flows(name)
    assert any(n.target == torch.ops.aten.cat.default for n in ao.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(qp(x), ao(x), rtol=0, atol=1e-5)
    assert _scales(qp) == _scales(ao)


def test_observer_nodes_resolve_by_name() -> None:
    ep = torch.export.export(TwoConvCat().eval(), (torch.randn(1, 3, 8, 8),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = quantplug.prepare(ep, qnn.QnnQuantizer())
    assert isinstance(prepared, PreparedModule)
    observer_nodes = [n for n in prepared.graph.nodes if n.op == "call_module"]
    assert observer_nodes and all(str(n.target).startswith(OBSERVER_PREFIX) for n in observer_nodes)
    for node in observer_nodes:  # a group's second node is named activation_post_process_N_1
        assert getattr(prepared, node.name) is getattr(prepared, str(node.target))
    # one attribute per group: no module registered twice, no duplicate state
    observers = observer_children(prepared)
    assert len({id(m) for _, m in observers}) == len(observers)
    assert {name.split(".")[0] for name in prepared.state_dict() if name.startswith(OBSERVER_PREFIX)} <= {
        name for name, _ in observers
    }
    with pytest.raises(AttributeError):
        prepared.no_such_attribute  # noqa: B018
