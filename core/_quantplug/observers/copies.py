"""Copies of observers that cost what they must: their statistics, not a deep copy.

Calibration runs a fresh copy of an observer beside the prepared module (the algorithms' and the
debugger's side computations, per-rank merges), and prepare builds one observer per sharing group
from a prototype; a leaf observer whose attributes are immutable values copies by cloning its
buffers, about 15x cheaper than ``copy.deepcopy``.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from _quantplug.observers import kernels, seen
from _quantplug.observers.base import SCALAR_VIEWS
from _quantplug.observers.binning import LinearBinning
from _quantplug.observers.parked import unparked

_MODULE_STATE = frozenset(nn.Module().__dict__)
_IMMUTABLE = (
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.qscheme,
    torch.device,
    tuple,
    frozenset,
    LinearBinning,  # never changed once made
    types.FunctionType,  # a parked observer's ``forward`` (observers/parked.py)
)


#: instance attributes a copy leaves out: what an observer keeps of its recent batches, and the
#: native step bound to its own buffers (both made again as the copy is fed)
_DROPPED = (seen.ATTR, kernels.STEP_ATTR, SCALAR_VIEWS)


def fresh_copy(obs: nn.Module) -> nn.Module:
    """An independent copy of an observer, to feed without touching the prepared module.

    Observers keep their statistics in buffers, so a leaf observer whose other attributes are
    immutable values is copied by cloning its buffers (about 15x cheaper than ``deepcopy``);
    anything else is deep-copied. The copy is never parked (:mod:`_quantplug.observers.parked`):
    a copy is made to be fed, and the observer of a constant is fed its constant through one.
    """
    return copier(obs)()


def copier(obs: nn.Module) -> Callable[[], nn.Module]:
    """A function making :func:`fresh_copy` copies of ``obs`` (left unchanged meanwhile): whether
    ``obs`` can be copied by its buffers is asked once, not for every copy (prepare copies one
    prototype per spec for every group that has the spec)."""
    simple = not obs._modules and not obs._parameters
    if simple:
        simple = all(
            isinstance(v, _IMMUTABLE)
            for k, v in obs.__dict__.items()
            if k not in _MODULE_STATE and k not in _DROPPED
        )
    if not simple:
        return lambda: unparked(copy.deepcopy(obs))
    # nn.Module.__setattr__ puts the plain containers below into the instance dict: written there
    # directly (its checks for parameters, modules and buffers were a third of a copy), unless the
    # class assigns attributes its own way
    direct = type(obs).__setattr__ is nn.Module.__setattr__
    return partial(_copy_simple, obs, direct)


def _copy_simple(obs: nn.Module, direct: bool) -> nn.Module:
    new = object.__new__(type(obs))
    new.__dict__ = obs.__dict__.copy()
    seen.forget(new)  # a copy has seen no batch
    step = new.__dict__.pop(kernels.STEP_ATTR, None)  # it writes the original's buffers
    new.__dict__.pop(SCALAR_VIEWS, None)  # views of the original's buffers
    state = {
        "_buffers": {k: None if v is None else v.clone() for k, v in obs._buffers.items()},
        "_non_persistent_buffers_set": set(obs._non_persistent_buffers_set),
        "_parameters": {},
        "_modules": {},
    }
    if direct:
        new.__dict__.update(state)
    else:
        for name, value in state.items():
            setattr(new, name, value)
    if step is not None:
        rebound = step.rebound(new._buffers)  # the same step for the clones, where it has one
        if rebound is not None:
            new.__dict__[kernels.STEP_ATTR] = rebound
    return unparked(new)
