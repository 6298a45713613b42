"""Which values reach a softmax as its scores (``_quantplug.graph.softmax_inputs``): there, and only
there, -1e4 is an attention mask (see ``tests/core/test_nonfinite.py`` for what observers do with
it). Exported attention patterns, and chains of ops built at random."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import Graph, Node

from _quantplug.graph.softmax_inputs import score_values

aten = torch.ops.aten


def _names(module: nn.Module, *args: torch.Tensor) -> tuple[set[str], dict[str, Any]]:
    program = torch.export.export(module.eval(), args)
    graph = program.graph_module.graph
    return score_values(graph), {n.name: n.target for n in graph.nodes}


class OpenAIStyle(nn.Module):
    """OpenAI GPT's attention: ``w * b + -1e4 * (1 - b)``, scaled scores, a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("b", torch.ones(6, 6).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.q(x) @ self.k(x).transpose(-1, -2) / 8**0.5
        w = w * self.b + -1e4 * (1 - self.b)
        return torch.softmax(w, dim=-1) @ x


def test_openai_style_masking_reaches_the_softmax_but_the_projections_do_not() -> None:
    scores, targets = _names(OpenAIStyle(), torch.randn(2, 6, 8))
    by_target = {t: n for n, t in targets.items()}
    masked_sum = next(n for n, t in targets.items() if t == aten.add.Tensor)
    assert masked_sum in scores
    # the additive mask, -1e4 * (1 - b), and the masked product w * b both become scores
    products = [n for n, t in targets.items() if t == aten.mul.Tensor]
    assert products and set(products) <= scores
    # the raw scores pass through the division by a number, not through the 0/1 product
    assert by_target[aten.div.Tensor] not in scores
    assert not {n for n, t in targets.items() if t in (aten.linear.default, aten.softmax.int)} & scores


class AdditiveMask(nn.Module):
    """BERT-era extended masks: ``(1 - mask) * -10000`` viewed to [B, 1, 1, T], added to the scores,
    then ``where`` with a causal mask and a cast before the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.register_buffer("causal", torch.ones(6, 6).tril().bool())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        extended = (1.0 - mask[:, None, None, :].float()) * -10000.0
        scores = (self.q(x) @ x.transpose(-1, -2))[:, None] + extended
        scores = torch.where(self.causal, scores, torch.full_like(scores, -1e4))
        return F.softmax(scores.float(), dim=-1)


def test_an_additive_mask_is_a_score_as_its_sum_is() -> None:
    scores, targets = _names(AdditiveMask(), torch.randn(2, 6, 8), torch.ones(2, 6))
    # the scores (matmul), the additive mask ((1 - mask) * -10000, viewed) and the sum, the
    # causal fill and the cast before the softmax
    assert {targets[n] for n in scores} == {
        aten.matmul.default,
        aten.unsqueeze.default,
        aten.rsub.Scalar,
        aten.mul.Tensor,
        aten.add.Tensor,
        aten.full_like.default,
        aten.where.self,
        aten.to.dtype,
    }
    # the 0/1 mask before ``1 - mask`` is data, and so are the inputs and the projection
    assert not {"x", "mask", "to", "unsqueeze", "linear"} & scores


class SdpaMask(nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = (1.0 - mask) * -1e4
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias)


def test_the_attention_mask_of_sdpa_is_a_score() -> None:
    scores, targets = _names(SdpaMask(), torch.randn(1, 2, 4, 8), torch.ones(1, 1, 4, 4))
    assert any(targets[n] == aten.mul.Tensor for n in scores)
    assert "q" not in scores


# --- chains built at random -----------------------------------------------------------------------

Step = Callable[[Graph, Node], Node]


def _op(target: Any, *rest: Any) -> Step:
    return lambda g, x: g.call_function(target, (x, *rest))


#: one step each: the value of ``x`` reaches the output, moved, cast, shifted or scaled
CARRIERS: dict[str, Step] = {
    "view": _op(aten.view.default, [-1]),
    "reshape": _op(aten.reshape.default, [-1]),
    "permute": _op(aten.permute.default, [0]),
    "transpose": _op(aten.transpose.int, 0, 0),
    "clone": _op(aten.clone.default),
    "to": _op(aten._to_copy.default),
    "unsqueeze": _op(aten.unsqueeze.default, 0),
    "expand": _op(aten.expand.default, [-1]),
    "mul_number": _op(aten.mul.Tensor, 0.125),
    "div_number": _op(aten.div.Tensor, 8.0),
    "add_bias": lambda g, x: g.call_function(aten.add.Tensor, (g.placeholder("bias"), x)),
    "masked_fill": lambda g, x: g.call_function(aten.masked_fill.Scalar, (x, g.placeholder("m"), -1e4)),
    "where": lambda g, x: g.call_function(aten.where.self, (g.placeholder("c"), x, g.placeholder("o"))),
}
#: one step each after which a mask entry no longer stands for one: a nonlinearity or a product
#: with another tensor
BREAKERS: dict[str, Step] = {
    "relu": _op(aten.relu.default),
    "exp": _op(aten.exp.default),
    "mul_tensor": lambda g, x: g.call_function(aten.mul.Tensor, (x, g.placeholder("w"))),
    "linear": lambda g, x: g.call_function(aten.linear.default, (x, g.placeholder("weight"))),
}
SOFTMAXES = [
    aten.softmax.int,
    aten._softmax.default,
    aten._safe_softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
]


def _chain(steps: list[str], softmax: Any) -> tuple[Graph, Node]:
    graph = Graph()
    start = graph.placeholder("x")
    value = start
    for name in steps:
        value = {**CARRIERS, **BREAKERS}[name](graph, value)
    three = (aten._softmax.default, aten._log_softmax.default)  # (x, dim, half_to_float)
    args = (value, -1, False) if softmax in three else (value, -1)
    graph.output(graph.call_function(softmax, args))
    return graph, start


@settings(max_examples=60, deadline=None)
@given(
    before=st.lists(st.sampled_from(sorted(CARRIERS) + sorted(BREAKERS)), max_size=4),
    after=st.lists(st.sampled_from(sorted(CARRIERS)), max_size=5),
    softmax=st.sampled_from(SOFTMAXES),
)
def test_a_value_is_a_score_exactly_when_only_carriers_lead_to_the_softmax(
    before: list[str], after: list[str], softmax: Any
) -> None:
    graph, start = _chain([*before, *after], softmax)
    scores = score_values(graph)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    # the value right after the last breaker, and everything from there on, are scores
    last_breaker = max((i for i, name in enumerate(before) if name in BREAKERS), default=-1)
    chain = [n for n in nodes if n.target not in SOFTMAXES]
    values = [start, *chain[: len(before) + len(after)]]
    for i, value in enumerate(values):
        assert (value.name in scores) == (i > last_breaker), (before, after, value.name)
