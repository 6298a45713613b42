"""The example vendor's rules modules and the ops each covers.

Op lists are plain names, so listing them imports nothing: the core imports a rules module only
when the graph being annotated contains one of its ops.
"""

from __future__ import annotations

from quantplug.backend import RulesModule

RULE_MODULES: tuple[RulesModule, ...] = (
    RulesModule(
        "quantplug_example_vendor.rules.weighted_rules",
        ["aten.linear.default", "aten.conv2d.default"],
    ),
    RulesModule(
        "quantplug_example_vendor.rules.elementwise_rules",
        ["aten.relu.default", "aten.add.Tensor", "aten.cat.default"],
    ),
)

#: what the ``reference`` extension adds (see ``quantplug_example_vendor.reference_ext``)
REFERENCE_EXTENSION_RULES: tuple[RulesModule, ...] = (
    RulesModule("quantplug_example_vendor.rules.abs_rules", ["aten.abs.default"]),
)
