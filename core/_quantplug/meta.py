"""Every key quantplug stores in ``node.meta`` or ``GraphModule.meta``, defined once.

The phases hand data to each other through the graph they transform: annotation records why a
node stays float, prepare names each observer's sharing group, convert keeps the qparams it
chose, the numeric debugger matches nodes across copies by their handle. A key written in one
module and read in another is defined here, so a reader never spells it again (a typo would read
nothing, silently). ``quantplug.backend`` gives plugins functions over these keys
(:func:`float_reason`, :func:`set_coverage_note` ...), not the keys themselves.

Layer: the lowest; imports nothing of quantplug.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# -- node.meta, written by annotation (Quantizer.annotate) ------------------------------------
#: why a node stays float (text); absent on quantized nodes
FLOAT_REASON_KEY = "quantplug_float_reason"
#: the rule (``AnnotatorRule``) that annotated a node
RULE_KEY = "quantplug_rule"
#: a rule's note on a node it quantizes otherwise than the options asked (a smaller LPBQ block),
#: shown by ``coverage()``
NOTE_KEY = "quantplug_coverage_note"
#: on a fused head, the name of its tail; on a fused tail, the name of its head
FUSED_TAIL_KEY = "quantplug_fused_tail"
FUSED_HEAD_KEY = "quantplug_fused_head"
#: per-node data a backend attaches for its compiler (``quantplug.backend.backend_node_data``),
#: kept through prepare and convert onto the nodes that replace or wrap the annotated one
BACKEND_DATA_KEY = "quantplug_backend_data"

# -- node.meta, written by the rewrites and prepare/convert -----------------------------------
#: the float program's node a node descends from (kept through every copy; the debugger matches
#: on it)
DEBUG_HANDLE_KEY = "quantplug_debug_handle"
#: on a folded weight, the batch-norm it absorbed
FOLDED_FROM = "quantplug_folded_from"
#: on an observer (prepare) or Q/DQ node (convert), its sharing group's id
GROUP_KEY = "quantplug_group"
#: on an algorithm's tap node, the weight site it feeds (or ``"inputs"``)
ALGORITHM_TAP_KEY = "quantplug_algorithm_tap"
#: on a constant's parked observer node (prepare): True; its readers read the constant through
#: it, as PT2E's weight observers are read, and it passes the constant through unobserved
PARKED_KEY = "quantplug_parked"

# -- GraphModule.meta -------------------------------------------------------------------------
#: prepare's state (``PreparedState``): groups, sharing, validation, what convert needs
STATE_KEY = "quantplug_prepared"
#: set on a prepared module ``convert(release_float_weights=True)`` consumed (its float weights gone)
RELEASED_KEY = "quantplug_released_float_weights"
#: the backend a program was prepared for (kept by convert; lower checks it)
BACKEND_KEY = "quantplug_backend"
#: convert's qparams per sharing group (its presence marks a program quantplug converted)
QPARAMS_KEY = "quantplug_qparams"
#: the constraint checks convert ran on the calibrated encodings (``ValidationReport``)
CALIBRATED_REPORT_KEY = "quantplug_calibrated_validation"
#: the accuracy algorithms' state between prepare and convert (``AlgorithmRun``)
ALGORITHMS_KEY = "quantplug_algorithms"

# -- module attribute names ------------------------------------------------------------------
#: the attribute name prefix of a prepared module's observers: group ``N``'s observer is the
#: top-level submodule ``activation_post_process_N``, called by ``call_module`` nodes of that
#: target, as torchao's ``prepare_pt2e`` names them (code written for torchao reads
#: ``getattr(prepared, node.target)`` and checks the prefix)
OBSERVER_PREFIX = "activation_post_process_"
#: the container module holding the algorithms' taps
TAPS = "quantplug_algorithm_taps"
#: on an observer: how many calibration batches ``sync_observers`` merged into it
SYNCED_ATTR = "quantplug_synced_batches"

#: what identifies where a node came from in the model: a rewrite copies it onto the nodes it makes
TRACE_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


def kept_meta(node: Any, *, trace: Sequence[str] = TRACE_META) -> dict[str, Any]:
    """The meta of ``node`` a rewrite puts on the nodes it makes in its place: ``trace`` (where
    in the model it came from) and the debug handle the numeric debugger matches nodes on."""
    return {k: node.meta[k] for k in (*trace, DEBUG_HANDLE_KEY) if k in node.meta}


def observer_target(gid: int) -> str:
    """The attribute name (and ``call_module`` target) of sharing group ``gid``'s observer."""
    return f"{OBSERVER_PREFIX}{gid}"


def observer_gid(target: Any) -> int | None:
    """The sharing group whose observer ``target`` names, or None for any other target."""
    if not isinstance(target, str) or not target.startswith(OBSERVER_PREFIX):
        return None
    digits = target[len(OBSERVER_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def observer_children(module: Any) -> list[tuple[str, Any]]:
    """A prepared module's observers as ``(name, module)``, in group order (top-level children
    named by :func:`observer_target`); empty for any other module."""
    children = getattr(module, "_modules", None)
    if not isinstance(children, dict):
        return []
    found = [
        (gid, name, child) for name, child in children.items() if (gid := observer_gid(name)) is not None
    ]
    return [(name, child) for _, name, child in sorted(found, key=lambda t: t[0])]
