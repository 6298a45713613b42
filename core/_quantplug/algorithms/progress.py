"""Progress of convert's per-layer algorithm work (SeqMSE, GPTQ, AdaRound...): a log line per
layer with the time left, and the hook the command line's progress bar listens on.

On an LLM convert with algorithms runs for minutes, layer after layer; without a word per layer
a user cannot tell a slow run from a stuck one. The time left is extrapolated from the weights
done so far (the algorithms' work grows with a layer's size, not with the count of layers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

logger = logging.getLogger("quantplug.algorithms")

#: ``(layers done, layers, weight label, seconds left or None)``
Listener = Callable[[int, int, str, "float | None"], None]

_LISTENER: ContextVar[Listener | None] = ContextVar("quantplug_layer_progress", default=None)


@contextmanager
def layer_progress(listener: Listener) -> Iterator[None]:
    """Call ``listener`` after each layer convert's algorithms choose, within this block."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def seconds_left(elapsed: float, done: int, total: int) -> float | None:
    """The time the rest takes at the rate so far (``done`` of ``total`` units in ``elapsed``)."""
    if done <= 0 or total <= done:
        return None if done <= 0 else 0.0
    return elapsed * (total - done) / done


class LayerProgress:
    """Counts the layers (weight sites) convert's algorithms have chosen, weighed by their size."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.layers = len(sizes)
        self.total = sum(int(s) for s in sizes)
        self.done = 0
        self.done_size = 0
        self.start = time.perf_counter()

    def advance(self, label: str, size: int) -> None:
        self.done += 1
        self.done_size += int(size)
        elapsed = time.perf_counter() - self.start
        left = seconds_left(elapsed, self.done_size, self.total)
        logger.info(
            "algorithms: layer %d/%d %s chosen (%.1f s so far%s)",
            self.done,
            self.layers,
            label,
            elapsed,
            "" if left is None else f", about {left:.0f} s left",
        )
        listener = _LISTENER.get()
        if listener is not None:
            listener(self.done, self.layers, label, left)
