"""The rewrites a program goes through before annotation, declared once, in order, with their conditions.

``prepare`` runs :data:`PIPELINE` on its working copy (then the algorithms' transforms, the
backend's ``transform_for_annotation`` and annotation); ``Quantizer.coverage`` runs the same
pipeline to report what prepare would annotate. Neither lists the rewrites itself, so the two
cannot drift apart: a rewrite added here is run by both.

Each :class:`Step` runs under a condition (:class:`When`) on the two facts that change what
prepare does to the float program: whether it is prepared for quantization-aware training
(training keeps the graph's own parameters and batch norms), and whether accuracy algorithms run
(they need layers as layers).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch.fx import GraphModule

from _quantplug.graph.working_copy import own_parameters
from _quantplug.meta import DEBUG_HANDLE_KEY
from _quantplug.rewrites.batchnorm import fold_batch_norm
from _quantplug.rewrites.computed_weights import (
    linear_from_addmm,
    linear_from_matmul_in_out,
    materialize_computed_weights,
)
from _quantplug.rewrites.embedding_bag import rewrite_fixed_bags
from _quantplug.rewrites.hand_written_linear import linear_from_matmul
from _quantplug.rewrites.no_op_arguments import drop_no_op_arguments
from _quantplug.rewrites.parameter_writes import functionalize_parameter_writes
from _quantplug.rewrites.previous_flow import forget_previous_flow
from _quantplug.rewrites.unread_writes import drop_unread_writes


class When(enum.Enum):
    """When a step runs, on how the program is being prepared."""

    ALWAYS = "always"
    NOT_QAT = "not in QAT"
    ONLY_QAT = "only in QAT"
    #: training must keep updating the one parameter a layer's pieces come from
    WITH_ALGORITHMS = "only with algorithms, not in QAT"

    def holds(self, *, qat: bool, algorithms: bool) -> bool:
        """Whether a step runs on a program prepared with ``qat`` and (some) ``algorithms``."""
        if self is When.ALWAYS:
            return True
        if self is When.ONLY_QAT:
            return qat
        if self is When.NOT_QAT:
            return not qat
        return algorithms and not qat


@dataclass(frozen=True)
class Step:
    """One rewrite of the working copy, what it is for, and when it runs."""

    name: str
    rewrite: Callable[[GraphModule], object]
    when: When
    why: str


def _keep_debug_handles(gm: GraphModule) -> None:
    """Name every node for the numeric debugger (the name survives every later copy)."""
    for node in gm.graph.nodes:
        node.meta.setdefault(DEBUG_HANDLE_KEY, node.name)


#: the rewrites, in the order they run
PIPELINE: tuple[Step, ...] = (
    Step(
        "forget_previous_flow",
        forget_previous_flow,
        When.ALWAYS,
        "a converted program quantized again: the first flow's annotations name another graph's nodes",
    ),
    Step(
        "functionalize_parameter_writes",
        functionalize_parameter_writes,
        When.NOT_QAT,
        "weights prepared on a first forward (RWKV) become constants",
    ),
    Step(
        "report_parameter_writes",
        partial(functionalize_parameter_writes, rewrite=False),
        When.ONLY_QAT,
        "a weight written in place is still the one trained: only warned about",
    ),
    Step("debug_handles", _keep_debug_handles, When.ALWAYS, "the numeric debugger matches nodes on them"),
    Step("own_parameters", own_parameters, When.ONLY_QAT, "training must not write the caller's weights"),
    Step("fold_batch_norm", fold_batch_norm, When.NOT_QAT, "a batch norm after a conv is its weights"),
    Step("rewrite_fixed_bags", rewrite_fixed_bags, When.ALWAYS, "no ONNX Loop, a quantized table"),
    Step(
        "drop_no_op_arguments",
        drop_no_op_arguments,
        When.ALWAYS,
        "empty cat inputs, own dtypes: ONNX drops them",
    ),
    Step("drop_unread_writes", drop_unread_writes, When.ALWAYS, "a cache written that nothing returns"),
    Step(
        "linear_from_matmul", linear_from_matmul, When.ALWAYS, "x @ W.T (Falcon) is a linear every rule knows"
    ),
    Step(
        "materialize_computed_weights",
        materialize_computed_weights,
        When.WITH_ALGORITHMS,
        "sliced/transposed weights become parameters the algorithms see",
    ),
    Step(
        "linear_from_addmm",
        linear_from_addmm,
        When.WITH_ALGORITHMS,
        "transformers' Conv1D (GPT-2) is a layer",
    ),
    Step(
        "linear_from_matmul_in_out",
        linear_from_matmul_in_out,
        When.WITH_ALGORITHMS,
        "x @ W with W [in, out] (SwiftFormer) is a layer",
    ),
)


def rewrite_for_annotation(gm: GraphModule, *, qat: bool, algorithms: bool) -> list[str]:
    """Run every step of :data:`PIPELINE` whose condition holds on ``gm`` (a working copy), in
    order; returns the names of the steps run."""
    ran = []
    for step in PIPELINE:
        if step.when.holds(qat=qat, algorithms=algorithms):
            step.rewrite(gm)
            ran.append(step.name)
    return ran
