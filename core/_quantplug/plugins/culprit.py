"""Who is at fault when plugin code (a hook, a rule, a pass, a data factory) raises: the hook
being called and the innermost frame outside quantplug, torch, pluggy and the standard library.

Used where quantplug reports such a failure in one line: the conformance kit's failed checks,
the command line's error for a ``sys.exit`` or KeyboardInterrupt that no user caused.
"""

from __future__ import annotations

import sys
from types import FrameType, TracebackType

#: modules whose frames are never the culprit: the kit and core, the hook caller, torch, stdlib
_NOT_CULPRITS = ("_quantplug", "quantplug", "pluggy", "torch", "__main__")


def _is_library(module: str) -> bool:
    top = module.split(".")[0]
    return top in _NOT_CULPRITS or top in sys.stdlib_module_names


def _frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _hook_of(frames: list[FrameType]) -> tuple[str, str | None] | None:
    """(hook name, plugin name) of the innermost pluggy hook call among ``frames``."""
    for frame in reversed(frames):
        if frame.f_code.co_name == "_multicall" and "pluggy" in frame.f_code.co_filename:
            impl = frame.f_locals.get("hook_impl")
            return str(frame.f_locals.get("hook_name")), getattr(impl, "plugin_name", None)
    return None


def culprit(exc: BaseException) -> str:
    """Where ``exc`` came from: the hook being called and the innermost plugin frame
    (``"hook quantplug_op_constraints of 'backend:my_npu', at my_npu/plugin.py:41 in f"``)."""
    frames = _frames(exc.__traceback__)
    parts = []
    hook = _hook_of(frames)
    if hook is not None:
        name, plugin = hook
        parts.append(f"hook {name}" + (f" of {plugin!r}" if plugin else ""))
    own = [f for f in frames if not _is_library(str(f.f_globals.get("__name__", "")))]
    where = own[-1] if own else (frames[-1] if frames else None)
    if where is not None:
        parts.append(f"at {where.f_code.co_filename}:{where.f_lineno} in {where.f_code.co_name}")
    return ", ".join(parts) or "no traceback"


def exit_call(exc: SystemExit) -> str:
    """``sys.exit(...)`` as the code called it."""
    return "sys.exit()" if exc.code is None else f"sys.exit({exc.code!r})"
