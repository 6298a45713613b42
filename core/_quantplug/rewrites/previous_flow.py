"""What a previous quantization flow left on a program's nodes, forgotten before this one.

A converted program can be quantized again (re-entrant quantization, as torchao's
``prepare_pt2e`` allows): a part quantized by one quantizer, the rest by another. Its nodes still
carry the first flow's annotations, keyed by nodes of the graph that flow prepared (not by this
program's nodes), and the sharing groups and float reasons it derived from them. The second
quantizer must see the program as it is, quantize/dequantize ops included, so they are dropped
before it annotates; torch.export drops them the same way when the program is re-exported.
The Q/DQ ops themselves stay: to the second quantizer they are ops like any other, and convert
keeps them as they are.
"""

from __future__ import annotations

from torch.fx import GraphModule

from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.meta import FLOAT_REASON_KEY, FUSED_HEAD_KEY, FUSED_TAIL_KEY, GROUP_KEY, NOTE_KEY, RULE_KEY

#: the meta a flow derives from annotation (the annotation itself, its rule and notes, fusion
#: links, why a node stayed float, the observer sharing group)
FLOW_META = (
    Q_ANNOTATION_KEY,
    RULE_KEY,
    NOTE_KEY,
    FUSED_HEAD_KEY,
    FUSED_TAIL_KEY,
    FLOAT_REASON_KEY,
    GROUP_KEY,
)


def forget_previous_flow(gm: GraphModule) -> None:
    """Drop :data:`FLOW_META` from every node of ``gm`` (a working copy)."""
    for node in gm.graph.nodes:
        for key in FLOW_META:
            node.meta.pop(key, None)
