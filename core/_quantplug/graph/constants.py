"""Which values of a graph are constants, and what they are.

A constant is a value that does not depend on the program's inputs: a parameter, a buffer or a
lifted tensor constant (``get_attr``), and any pure ATen op computed only from constants (a
transposed weight, the rows an embedding looks up at fixed positions, the ``zeros`` initial state
of an LSTM), including what torch.export wraps in a no-grad region (Llama's rotary ``cos``/``sin``
tables, computed from a buffer and fixed positions). convert() stores every quantized constant as
integers, so no weight is quantized again at every forward, whatever the group it shares its
encoding with (an embedding table and its looked-up rows, weights in QAT).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, Node, map_arg

from _quantplug.errors import NonFiniteError
from _quantplug.graph.attrs import fetch_attr
from _quantplug.graph.mutation import written_args


def written(attr_node: Node) -> bool:
    """Whether an op writes into this parameter/buffer (``copy_``, in-place updates)."""
    return any(attr_node in written_args(user) for user in attr_node.users)


#: higher-order ops that only run their subgraph under a grad/autocast setting (torch.export
#: records ``with torch.no_grad():`` regions this way): as pure as the subgraph they run
REGION_OPS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


def _foldable(node: Node, attr: Callable[[str], Any]) -> bool:
    """An op whose result is a function of its arguments only (no randomness, no side effect)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        # asserts (tensor metadata, scalars) have an effect only when they fail
        return not node.is_impure() or node.target.__name__.startswith("_assert")
    if getattr(node.target, "__name__", None) in REGION_OPS:
        region = next((a for a in node.args if isinstance(a, Node) and a.op == "get_attr"), None)
        body = attr(str(region.target)) if region is not None else None
        return isinstance(body, torch.fx.GraphModule) and all(
            _foldable(n, module_attr(body)) for n in body.graph.nodes if n.op == "call_function"
        )
    return False


def constant_nodes(graph: Graph, attr: Callable[[str], Any]) -> set[Node]:
    """The nodes of ``graph`` whose value is a constant tensor (or a tuple of them).

    Args:
        graph: the graph.
        attr: reads the value of a ``get_attr`` target (tensors are constants, and so are the
            subgraphs that higher-order ops run).
    """
    found: set[Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            value = attr(str(node.target))
            if isinstance(value, (torch.Tensor, torch.fx.GraphModule)) and not written(node):
                found.add(node)
        elif (
            node.op == "call_function"
            and all(n in found for n in node.all_input_nodes)
            and _foldable(node, attr)
        ):
            found.add(node)
    return found


def constant_test(attr: Callable[[str], Any]) -> Callable[[Node], bool]:
    """Whether a node is one of :func:`constant_nodes` (same ``attr``), deciding only what it needs.

    The same rule, asked of a few nodes (the quantizes convert folds, on a graph where most read
    activations): a node's inputs are decided first, depth first, and one input known not to be
    constant decides it, so a quantize of an activation walks one chain of inputs back to a
    placeholder, each node decided once across calls, instead of the whole graph being analysed
    and every parameter read. Ask it before editing the graph (the answers are kept).
    """
    known: dict[Node, bool] = {}

    def test(root: Node) -> bool:
        stack = [root]
        while stack:
            node = stack[-1]
            if node in known:
                stack.pop()
                continue
            if node.op == "get_attr":
                value = attr(str(node.target))
                known[node] = isinstance(value, (torch.Tensor, torch.fx.GraphModule)) and not written(node)
            elif node.op != "call_function":
                known[node] = False
            else:
                inputs = node.all_input_nodes
                verdicts = [known.get(n) for n in inputs]
                if False not in verdicts and None in verdicts:  # an input to decide first
                    stack.append(inputs[verdicts.index(None)])
                    continue
                known[node] = False not in verdicts and _foldable(node, attr)
            stack.pop()
        return known[root]

    return test


class ConstantValues:
    """Computes constant nodes' values on demand, each once (an interpreter over constants only)."""

    def __init__(self, attr: Callable[[str], Any]) -> None:
        self._attr = attr
        self._values: dict[Node, Any] = {}

    def __call__(self, node: Node) -> Any:
        value = self._values.get(node)
        if value is None:
            value = self._values[node] = self._compute(node)
        return value

    def _compute(self, node: Node) -> Any:
        if node.op == "get_attr":
            value = self._attr(str(node.target))
            return value.detach() if isinstance(value, torch.Tensor) else value
        args = map_arg(node.args, self)
        kwargs = map_arg(node.kwargs, self)
        with torch.no_grad():
            return node.target(*args, **kwargs)  # type: ignore[operator]


def module_attr(module: torch.nn.Module) -> Callable[[str], Any]:
    """A ``get_attr`` reader over ``module`` (missing attributes read as None: not constants)."""

    def read(target: str) -> Any:
        try:
            return fetch_attr(module, target)
        except AttributeError:
            return None

    return read


def check_finite_constant(node: Node, value: torch.Tensor, group: str) -> None:
    """A quantized constant (a weight) holding NaN or inf: a broken model, never calibration data.

    Convert calls it where a constant's observer refused the values, so the error names the
    parameter (and says to fix the model) rather than an observer's input, whatever
    ``nonfinite`` says (that policy is for calibration data). Not checked up front at prepare:
    a pass over every weight there cost a quarter of prepare's time on the bench's decoders.
    """
    if not value.is_floating_point() or bool(torch.isfinite(value).all()):
        return
    nan = int(torch.isnan(value).sum())
    inf = int(torch.isinf(value).sum())
    counts = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "inf")) if n)
    raise NonFiniteError(
        f"the model's constant {str(node.target)!r} (node {node.name!r}, quantized as {group}) holds "
        f"{counts} value(s): a weight's encoding cannot be computed from them; fix the model's "
        "weights (no calibration data causes this)",
        where=node.name,
        nan=nan,
        inf=inf,
        reached=f"the weight {str(node.target)!r}",
    )
