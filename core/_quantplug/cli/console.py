"""Terminal output of the CLI: progress bars on a terminal, plain log lines otherwise.

Everything here writes to stderr (the summary a command prints goes to stdout), so
``quantplug quantize > summary.txt`` keeps progress on screen and the summary in the file.
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import TextIO


class Console:
    """Where the CLI talks: ``quiet`` keeps only warnings and errors, ``verbose`` adds details."""

    def __init__(self, *, quiet: bool = False, verbose: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet and not verbose
        self.verbose = verbose
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = _isatty(self.stream)

    def info(self, message: str) -> None:
        if not self.quiet:
            self._write(message)

    def detail(self, message: str) -> None:
        if self.verbose:
            self._write(message)

    def warn(self, message: str) -> None:
        self._write(f"warning: {message}")

    def error(self, message: str) -> None:
        self._write(f"quantplug: error: {message}")

    def _write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def progress(self, label: str, total: int, unit: str, *, done_label: str | None = None) -> Progress:
        return Progress(self, label, total, unit, done_label=done_label)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes}m{secs:02d}s"


class Progress:
    """Counts steps of one phase. On a terminal: a bar redrawn in place with the count, the rate
    and the time left. Otherwise: a start line, a line every ``log_every`` seconds, an end line.
    """

    redraw_every = 0.08  # seconds between bar redraws
    log_every = 10.0  # seconds between plain progress lines

    def __init__(
        self, console: Console, label: str, total: int, unit: str, *, done_label: str | None = None
    ) -> None:
        self.console = console
        self.label = label
        self.done_label = done_label or label
        self.total = max(0, int(total))
        self.unit = unit
        self.count = 0
        self.detail = ""
        self.enabled = not console.quiet
        self.bar = self.enabled and console.interactive
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_log = self._start
        self._drawn = 0

    def __enter__(self) -> Progress:
        self._start = time.perf_counter()
        self._last_log = self._start
        if self.bar:
            self._draw(force=True)
        elif self.enabled:
            self.console.info(f"{self.label}: {self.total or 'streaming'} {self.unit}")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.bar:
            if exc_type is None:
                self._draw(force=True)
            self.console.stream.write("\n")
            self.console.stream.flush()
        if exc_type is None and self.enabled:
            elapsed = self.elapsed
            if not self.bar:
                took = _duration(elapsed)
                self.console.info(
                    f"{self.done_label}: {self.count} {self.unit} in {took} ({self.rate_text()})"
                )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def rate(self) -> float:
        elapsed = self.elapsed
        return self.count / elapsed if elapsed > 0 else 0.0

    def rate_text(self) -> str:
        rate = self.rate()
        singular = {"batches": "batch", "steps": "step"}.get(self.unit, self.unit)
        if rate >= 1 or rate == 0:
            return f"{rate:.1f} {singular}/s"
        return f"{1 / rate:.2f} s/{singular}"

    def advance(self, steps: int = 1, detail: str | None = None) -> None:
        self.count += steps
        if detail is not None:
            self.detail = detail
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.bar:
            self._draw()
        elif now - self._last_log >= self.log_every and (self.count < self.total or not self.total):
            self._last_log = now
            self.console.info(f"{self.label}: {self._counted()} {self.unit} ({self.rate_text()})")

    def _counted(self) -> str:
        """``12/40``, or ``12`` where the total is not known (streamed data)."""
        return f"{self.count}/{self.total}" if self.total else str(self.count)

    def step(self, detail: str) -> None:
        """Name the step about to run (shown on the bar) without counting it yet."""
        self.detail = detail
        if self.bar:
            self._draw(force=True)
        elif self.enabled:
            self.console.detail(f"{self.label}: {detail}")

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_draw < self.redraw_every and self.count < self.total:
            return
        self._last_draw = now
        width = shutil.get_terminal_size((100, 20)).columns
        frac = min(1.0, self.count / self.total) if self.total else float(self.count > 0)
        bar_width = max(10, min(30, width - 70))
        filled = int(frac * bar_width)
        bar = "█" * filled + "░" * (bar_width - filled)
        left = ""
        rate = self.rate()
        if 0 < self.count < self.total and rate > 0:
            left = f"  eta {_duration((self.total - self.count) / rate)}"
        text = (
            f"{self.label:<12} {bar} {self._counted()} {self.unit}  {self.rate_text()}"
            f"  {_duration(self.elapsed)}{left}"
        )
        if self.detail:
            text += f"  {self.detail}"
        text = text[: max(20, width - 1)]
        pad = " " * max(0, self._drawn - len(text))
        self._drawn = len(text)
        self.console.stream.write("\r" + text + pad)
        self.console.stream.flush()


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end was closed (``quantplug ... | head``
    that has read what it wanted): writing there fails with ``BrokenPipeError``."""
    try:
        import select

        fd = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no real stdout
        return False
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def silence_stdout() -> None:
    """Point standard output at the null device, so that the interpreter's final flush of what is
    still buffered for a closed pipe neither fails nor changes the exit status."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
