"""Checking an installed backend in processes of the kit's own (``worker``), as installed.

Each process is a fresh interpreter (``sys.executable``) started from the environment given
(``os.environ`` by default), in a session of its own, so that the user's Ctrl-C reaches only this
process, which then stops the child. It reports every step; this side applies them to the
report (``steps.Assembly``) and watches the clock. When a process ends before its last step (a
hook calling ``os._exit``, a crash of native code, a hang ``faulthandler`` ended) or stays silent
past the timeout (then it is killed), the step it was running fails with what happened and a new
process runs the cases left, so one bad hook costs one case, never the run.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import IO, Any

from _quantplug.conformance.checks import Check
from _quantplug.conformance.report import ConformanceReport
from _quantplug.conformance.steps import Assembly
from _quantplug.conformance.worker import GRACE_S
from _quantplug.errors import BackendLoadError, QuantplugError

#: what the worker may take beyond its own deadline (``GRACE_S``) before it is killed
KILL_AFTER_S = 2 * GRACE_S


def run(
    name: str,
    options: Mapping[str, Any],
    checks: list[Check],
    *,
    progress: Callable[[str], None] | None,
    timeout: float,
    environ: Mapping[str, str] | None,
) -> ConformanceReport:
    """The report of ``checks`` against installed backend ``name``, from as many worker
    processes as it takes (one, unless a step kills or hangs its process)."""
    assembly = Assembly(name, checks, progress)
    while assembly.remaining():
        for event in steps(
            name, options, assembly.remaining(), timeout=timeout, environ=environ, done=assembly.done
        ):
            if event["event"] == "loaded":
                assembly.report.distribution = event.get("distribution")
                assembly.report.version = event.get("version")
            elif event["event"] == "stopped":
                left = assembly.remaining()
                if assembly.check is None and left:  # between checks: the next one was starting
                    assembly.check = left[0].name
                assembly.fail_running(f"the kit's process running this check {event['reason']}")
            else:
                assembly.feed(event)
    return assembly.finish()


def steps(
    name: str,
    options: Mapping[str, Any],
    checks: Iterable[Check],
    *,
    timeout: float,
    environ: Mapping[str, str] | None,
    done: Collection[tuple[str, str]] = (),
    list_only: bool = False,
) -> Iterator[dict[str, Any]]:
    """The events of one worker process running (or listing) ``checks``; when it stops before
    its last step, a last event ``{"event": "stopped", "reason": ...}`` says why.

    Raises:
        QuantplugError: the backend is unknown or cannot be loaded (the error the worker met).
    """
    if environ is None:  # this environment: a misspelt name fails here, without a process
        from _quantplug.plugins.registry import entry_for

        entry_for(name)
    request = {
        "backend": name,
        "options": dict(options),
        "checks": [c.name for c in checks],
        "done": sorted(done),
        "timeout": timeout,
        "list": list_only,
    }
    loaded = False
    with _Worker(request, environ) as worker:
        for event in worker.events(timeout + KILL_AFTER_S):
            if event["event"] == "load-failed":
                raise _load_error(event)
            loaded = loaded or event["event"] == "loaded"
            yield event
            if event["event"] == "end":
                return
        reason = worker.why_it_stopped(timeout)
    if not loaded:
        raise BackendLoadError(name, None, name, f"the kit's process loading it {reason}")
    yield {"event": "stopped", "reason": reason}


class _Worker:
    """One worker process: its events as they come, its exit, what it wrote to stderr."""

    def __init__(self, request: Mapping[str, Any], environ: Mapping[str, str] | None) -> None:
        self._stderr: IO[bytes] = tempfile.TemporaryFile()
        self.killed_after: float | None = None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "_quantplug.conformance.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=dict(os.environ if environ is None else environ),
            start_new_session=True,  # the terminal's Ctrl-C reaches this process only
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True)
        self._reader.start()
        self.process.stdin.write(json.dumps(request).encode())
        self.process.stdin.close()

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def events(self, silence: float) -> Iterator[dict[str, Any]]:
        """Each event until the process ends, or until it is silent for ``silence`` seconds
        (then it is killed)."""
        while True:
            try:
                line = self._lines.get(timeout=silence)
            except queue.Empty:
                self.killed_after = silence
                self.kill()
                return
            if line is None:
                return
            try:
                yield json.loads(line)
            except ValueError:
                continue  # not an event (cannot happen: the plugin's output goes to stderr)

    def why_it_stopped(self, timeout: float) -> str:
        """What ended the process, for the report: killed, hung, exited, or a signal."""
        code = self.process.wait()
        tail = self._stderr_text()
        if self.killed_after is not None:
            return f"was silent for {self.killed_after:g} s (timeout {timeout:g} s) and was killed"
        if "Timeout (" in tail:
            where = _stack_culprit(tail)
            return f"timed out after {timeout:g} s in native code and was ended" + (
                f" ({where})" if where else ""
            )
        how = (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code} (os._exit, or a crash)"
        )
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        return how + (f"; its last output: {last.strip()}" if last else "")

    def _stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-20000:].decode(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is not None:
            return
        try:  # with the processes it started (its own session: a process group of its own)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (AttributeError, ProcessLookupError, PermissionError):  # no process groups (Windows)
            self.process.kill()

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        deadline = time.monotonic() + 10
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._reader.join(timeout=10)  # it reads to the end of the pipe, then stops
        if self.process.stdout is not None and not self._reader.is_alive():
            self.process.stdout.close()
        self._stderr.close()


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _stack_culprit(dump: str) -> str | None:
    """The innermost plugin frame of a ``faulthandler`` dump (most recent call first)."""
    library = [
        sysconfig.get_paths()["stdlib"],
        os.sep + "_quantplug" + os.sep,
        os.sep + "torch" + os.sep,
        os.sep + "pluggy" + os.sep,
    ]
    for match in _FRAME.finditer(dump):
        if not any(part in match["file"] for part in library):
            return f"at {match['file']}:{match['line']} in {match['func']}"
    return None


def _load_error(event: Mapping[str, Any]) -> QuantplugError:
    """The worker's load failure as the error this process would have raised."""
    if event["kind"] == "BackendLoadError":
        return BackendLoadError(
            event["name"],
            event["distribution"],
            event["module"],
            event["cause"],
            extension_of=event["extension_of"],
        )
    return QuantplugError(event["message"])
