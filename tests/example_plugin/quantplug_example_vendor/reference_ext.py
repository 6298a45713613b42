"""An extension of the ``reference`` backend: a rule and a constraint for ``aten.abs``.

Declared in pyproject.toml as::

    [project.entry-points."quantplug.extensions"]
    reference = "quantplug_example_vendor.reference_ext"

The entry-point name is the backend it extends. The core imports this module when a user asks
for ``reference`` (never for other backends) and registers it after the backend, so its rules
modules come after the reference's (and win for ops both cover) and its constraints are checked
alongside the reference's. An extension implements any hook but ``quantplug_backend_info``.
"""

from __future__ import annotations

from collections.abc import Sequence

import quantplug
from quantplug.backend import (
    OUTPUT,
    BackendContext,
    OpConstraint,
    PortConstraint,
    RulesModule,
    rules_from_index,
)

ABS = OpConstraint(
    op="aten.abs.default",
    ports={
        0: PortConstraint(per_tensor_only=True, description="Abs reads one scale per tensor"),
        OUTPUT: PortConstraint(
            per_tensor_only=True,
            symmetric=False,
            description="|x| >= 0: a symmetric grid would waste its negative half",
        ),
    },
    source="quantplug-example-vendor",
)


@quantplug.hookimpl
def quantplug_annotation_rules(context: BackendContext) -> Sequence[RulesModule]:
    return rules_from_index("quantplug_example_vendor.rules", ["abs_rules"])


@quantplug.hookimpl
def quantplug_op_constraints(
    op: str, backend_op: str | None, context: BackendContext
) -> Sequence[OpConstraint]:
    return [ABS] if op == "aten.abs.default" else []
