"""Process-wide state a backend must leave as it found it: what the ``untouched`` check compares.

A plugin that reseeds torch's random generator, changes torch's default dtype or thread count,
switches deterministic algorithms on, sets an environment variable or changes the working folder
changes every other library's results in the user's process, silently. Each item here is read
before and after the flow (and before and after importing the plugin, in a fresh interpreter),
and put back after a change is found, so later checks run in the state they expect.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Item:
    """One piece of process-wide state: how to read it, compare it, describe a change, restore it."""

    label: str
    read: Callable[[], Any]
    restore: Callable[[Any], None]
    same: Callable[[Any, Any], bool] = lambda a, b: bool(a == b)
    #: describes a change from ``before`` to ``after`` (default: the two values)
    change: Callable[[Any, Any], str] | None = None


def _rng_same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a, b))


def _numpy_state() -> Any:
    try:
        import numpy.random
    except ImportError:
        return None
    return numpy.random.get_state()


def _numpy_same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    import numpy

    return all(numpy.array_equal(x, y) if isinstance(x, numpy.ndarray) else x == y for x, y in zip(a, b))


def _numpy_restore(state: Any) -> None:
    if state is not None:
        import numpy.random

        numpy.random.set_state(state)


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _cudnn() -> tuple[bool, bool, bool]:
    cudnn = torch.backends.cudnn
    return bool(cudnn.enabled), bool(cudnn.benchmark), bool(cudnn.deterministic)


def _set_cudnn(flags: tuple[bool, bool, bool]) -> None:
    cudnn = torch.backends.cudnn
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic = flags


def _set_grad_enabled(on: bool) -> None:
    torch.set_grad_enabled(on)  # as a function call: sets the mode


def _set_anomaly_enabled(on: bool) -> None:
    torch.autograd.set_detect_anomaly(on)  # as a function call: sets the mode


def _environ_change(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    names = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return "variables " + ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _set_environ(saved: Mapping[str, str]) -> None:
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    os.environ.update(saved)


_RNG = "reseeded or drawn from: give your code a torch.Generator of its own"

ITEMS: tuple[Item, ...] = (
    Item(
        "torch's global random generator",
        torch.get_rng_state,
        torch.set_rng_state,
        _rng_same,
        lambda a, b: _RNG,
    ),
    Item(
        "Python's random module",
        random.getstate,
        random.setstate,
        change=lambda a, b: "reseeded or drawn from: use a random.Random of your own",
    ),
    Item(
        "NumPy's global random generator",
        _numpy_state,
        _numpy_restore,
        _numpy_same,
        lambda a, b: "reseeded or drawn from: use a numpy.random.Generator of your own",
    ),
    Item("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype),
    Item("torch's default device", torch.get_default_device, torch.set_default_device),
    Item("torch's intra-op thread count", torch.get_num_threads, torch.set_num_threads),
    Item(
        "torch's deterministic algorithms (enabled, warn only)",
        _deterministic,
        lambda s: torch.use_deterministic_algorithms(s[0], warn_only=s[1]),
    ),
    Item(
        "torch's float32 matmul precision",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    Item("torch's grad mode", torch.is_grad_enabled, _set_grad_enabled),
    Item(
        "autograd anomaly detection",
        torch.is_anomaly_enabled,
        _set_anomaly_enabled,
    ),
    Item("torch.backends.cudnn (enabled, benchmark, deterministic)", _cudnn, _set_cudnn),
    Item("environment", lambda: dict(os.environ), _set_environ, change=_environ_change),
    Item("working folder", os.getcwd, os.chdir),
)


def snapshot() -> dict[str, Any]:
    """Every item's current value, by label."""
    return {item.label: item.read() for item in ITEMS}


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What changed between two snapshots, one phrase per item."""
    found = []
    for item in ITEMS:
        a, b = before[item.label], after[item.label]
        if not item.same(a, b):
            what = item.change(a, b) if item.change is not None else f"{a!r} -> {b!r}"
            found.append(f"{item.label}: {what}")
    return found


def restore(before: Mapping[str, Any]) -> None:
    """Put back every item that differs from ``before``."""
    now = snapshot()
    for item in ITEMS:
        if not item.same(before[item.label], now[item.label]):
            item.restore(before[item.label])
