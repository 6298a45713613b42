"""Observers of constants, kept in the prepared graph but idle during calibration.

A sharing group whose tensors are all parameters or buffers (a weight, a bias) is observed once,
at convert, into a copy of its observer: feeding it every calibration batch would measure the
same tensor again at every forward. Its observer still needs a node in the prepared graph: PT2E
tools find observers through the graph (``getattr(prepared, node.target)``), and graph rewrites a
PT2E user runs between prepare and convert (torchao's ``move_exported_model_to_eval`` through
``torch.fx.subgraph_rewriter``, which ends with ``GraphModule.delete_all_unused_submodules()``)
delete every submodule no node calls, which lost the weights' observers (convert then failed with
``no attribute 'g1'``).

So a constant's observer is *parked*: prepare gives it one ``call_module`` node on the constant,
which the constant's readers read, as torchao's weight observers are read
(``linear(x, activation_post_process_1(weight), bias)``; code written for torchao takes a layer's
weight argument for its observer), and this module makes that call cheap and durable. The
instance's ``forward`` returns its input (the weight is not observed per batch; one call costs a
module call, about a microsecond) and ``_is_impure`` tells ``Graph.eliminate_dead_code`` to keep
the node should a rewrite leave nothing reading it. Both are instance attributes, so the
observer stays an instance of its own class (``isinstance`` and its settings, such as
``qscheme``, read as before) and pickles and deep-copies as before. :func:`unparked` gives the
copy convert feeds the constant to; convert replaces the node by the constant's dequantize.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: the instance attributes parking sets
_PARKED_ATTRS = ("forward", "_is_impure")


def pass_through(x: Any, *args: Any, **kwargs: Any) -> Any:
    """A parked observer's ``forward``: its input, unobserved (module-level: it pickles by name)."""
    return x


def park(observer: nn.Module) -> None:
    """Make ``observer`` idle in calibration and its graph node immune to dead-code elimination."""
    observer.__dict__["forward"] = pass_through
    observer.__dict__["_is_impure"] = True


def is_parked(observer: nn.Module) -> bool:
    return observer.__dict__.get("forward") is pass_through


def unparked(observer: nn.Module) -> nn.Module:
    """``observer`` itself restored to its class's behaviour (call it on a copy)."""
    for attr in _PARKED_ATTRS:
        observer.__dict__.pop(attr, None)
    return observer
