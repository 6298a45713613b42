"""Reading and replacing what a ``get_attr`` node of a GraphModule points at."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from _quantplug.meta import PARKED_KEY

_MODULE_GETATTR = torch.nn.Module.__getattr__


def module_getattr(obj: Any, name: str, *default: Any) -> Any:
    """``getattr(obj, name, *default)``, faster where ``obj`` is an ``nn.Module`` lacking ``name``.

    ``nn.Module.__getattr__`` (called once the instance and its class lack ``name``) looks in the
    module's parameters, buffers and submodules, then formats an AttributeError message, which
    ``getattr`` with a default discards: about 1.3 us per missing name, asked of every observer
    several times during convert. Where the class's ``__getattr__`` is torch's own, the same
    three dicts are read here, in the same order, without the error; everything else is
    ``getattr``'s own answer (without a default, too: the error is what is asked for).
    """
    cls = type(obj)
    if not default or getattr(cls, "__getattr__", None) is not _MODULE_GETATTR:
        return getattr(obj, name, *default)
    state = obj.__dict__
    if name in state or hasattr(cls, name):  # found without torch's __getattr__
        return getattr(obj, name, *default)
    for store in ("_parameters", "_buffers", "_modules"):
        found = state.get(store)
        if found is not None and name in found:
            return found[name]
    return default[0]  # where torch's __getattr__ raises


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute at dotted path ``target`` below ``module`` (what a get_attr node reads)."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def put_attr(module: torch.nn.Module, target: str, value: Any) -> Any:
    """Put ``value`` (the very object) at dotted path ``target`` below ``module``, as a parameter,
    buffer or plain attribute like what it replaces; returns what was there."""
    owner_path, _, attr = target.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    old = getattr(owner, attr)
    if attr in owner._parameters:
        owner._parameters[attr] = value
    elif attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        setattr(owner, attr, value)
    return old


def attr_value(gm: torch.nn.Module, arg: Any) -> Any:
    """What ``arg`` stands for in ``gm``: the value a get_attr node reads, anything else as is."""
    if isinstance(arg, Node) and arg.op == "get_attr":
        return fetch_attr(gm, str(arg.target))
    return arg


def behind_parked(arg: Any) -> Any:
    """The constant a prepared graph's reader reads through a parked observer node (``arg``
    itself for anything else).

    A weight's observer in a prepared graph sits on the weight's edge, as in torchao's
    (``linear(x, activation_post_process_1(weight), bias)``), but passes the weight through
    unobserved (:mod:`_quantplug.observers.parked`): code asking which constant an op reads
    looks through it.
    """
    if isinstance(arg, Node) and arg.meta.get(PARKED_KEY):
        return arg.args[0]
    return arg
