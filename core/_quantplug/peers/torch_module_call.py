"""An observer's ``module(x)`` in one Python frame where torch's call would only run ``forward``.

Calibration calls an observer per observed edge, more than a thousand times per forward of a
32-layer decoder; ``nn.Module.__call__`` (torch 2.13) is two frames, ``_wrapped_call_impl`` then
``_call_impl``, before ``forward``, a quarter of a range observer's call (1.2 ms of the 9 ms an
ExecuTorch-configured decoder-32's calibration adds to its float forward). Where torch's two
frames would do nothing but call ``self.forward(*args, **kwargs)`` (no compiled call, no hook
on the module, no global module hook, no JIT trace recording) :func:`observer_call` calls it
directly, with the same arguments, and returns what it returns; in every other case, and
wherever ``nn.Module.__call__`` or the observer's ``_call_impl`` is not torch's own (a
subclass's, or torch.fx's tracer patching ``Module.__call__`` while it traces), it hands the call
to ``nn.Module.__call__`` as installed at that moment. A hook registered at any time, on the
observer or globally, therefore runs exactly as it would: the hook check is the one torch's
``_call_impl`` makes, made at each call. On a torch version this was not verified on, every call
goes to ``nn.Module.__call__``.

Importing this module makes :func:`observer_call` the call of :class:`ObserverBase` (observers sit
a layer below this folder, so they cannot import it; ``flow.prepare`` does, so every prepared
module's observers have it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from _quantplug.observers.base import ObserverBase
from _quantplug.peers.versions import verified

#: torch's own methods, as imported (a subclass or a patch replacing one: torch's call runs)
_WRAPPED_CALL_IMPL = nn.Module._wrapped_call_impl
_CALL_IMPL = nn.Module._call_impl
#: whether the installed torch is one this was verified on (read once: the version cannot change)
ACTIVE = verified("torch_module_call")


def forward_only(module: nn.Module) -> bool:
    """Whether ``module(...)`` would call nothing but ``module.forward(...)``: torch's own
    ``nn.Module.__call__`` and ``_call_impl`` on a verified torch, and ``_call_impl``'s test
    for anything else to run (no compiled call, no hook, no JIT trace recording)."""
    return (
        ACTIVE
        and nn.Module.__call__ is _WRAPPED_CALL_IMPL
        # (a subclass's own _wrapped_call_impl is never called: __call__ is torch's function)
        and type(module)._call_impl is _CALL_IMPL
        and module._compiled_call_impl is None
        # _call_impl's test for hooks, as torch 2.13 writes it
        and not (
            module._backward_hooks
            or module._backward_pre_hooks
            or module._forward_hooks
            or module._forward_pre_hooks
            or _module._global_backward_pre_hooks
            or _module._global_backward_hooks
            or _module._global_forward_hooks
            or _module._global_forward_pre_hooks
        )
        and not torch._C._get_tracing_state()  # looked up as _call_impl looks it up
    )


def observer_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.__call__(self, *args, **kwargs)``: ``self.forward`` called directly where torch's
    ``_wrapped_call_impl`` and ``_call_impl`` would call nothing else (module docstring)."""
    if forward_only(self):
        return self.forward(*args, **kwargs)
    return nn.Module.__call__(self, *args, **kwargs)


ObserverBase.__call__ = observer_call  # type: ignore[method-assign]
