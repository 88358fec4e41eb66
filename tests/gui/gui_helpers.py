"""GUI test helpers: synchronous stand-ins for the Qt runners (controllers tested without Qt), shared constants."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from testsupport import SHARED_DATA  # noqa: F401 (re-exported for GUI tests)

from engine.errors import CancelledError

#: Demo settings small enough for tests: one 32-pixel round (a few seconds on one core).
TINY_DEMO = {"image_size": 32, "rounds": 1, "epochs": 1, "photo_size": 64, "cases_scale": 1}


class SyncHandle:
    def __init__(self) -> None:
        self.cancelled = False
        self.done = False

    def cancel(self) -> None:
        self.cancelled = True


class SyncTaskRunner:
    """Runs every job at once on the calling thread; records what was submitted."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, job, *, on_done, on_error, on_progress=None) -> SyncHandle:
        self.submitted += 1
        handle = SyncHandle()

        def progress(event: dict[str, Any]) -> None:
            if on_progress is not None:
                on_progress(event)

        try:
            result = job(progress, lambda: handle.cancelled)
        except Exception as exc:  # delivered as data, like the Qt runner
            handle.done = True
            on_error(exc)
            return handle
        handle.done = True
        on_done(result)
        return handle


class DeferredTaskRunner:
    """Keeps jobs until :meth:`run_all`, to test what happens while work is in flight."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, SyncHandle, Any, Any, Any]] = []

    def submit(self, job, *, on_done, on_error, on_progress=None) -> SyncHandle:
        handle = SyncHandle()
        self.jobs.append((job, handle, on_done, on_error, on_progress))
        return handle

    def run_all(self) -> None:
        jobs, self.jobs = self.jobs, []
        for job, handle, on_done, on_error, on_progress in jobs:
            try:
                if handle.cancelled:
                    raise CancelledError("cancelled")
                result = job(on_progress or (lambda e: None), lambda h=handle: h.cancelled)
            except Exception as exc:
                handle.done = True
                on_error(exc)
                continue
            handle.done = True
            on_done(result)


class FakeProcess:
    """Records start/stop; the test feeds output lines and the exit by hand."""

    def __init__(self) -> None:
        self.argv: list[str] | None = None
        self.on_line: Callable[[str], None] | None = None
        self.on_exit: Callable[[int, bool], None] | None = None
        self.stopped = False
        self._running = False
        self.written: list[str] = []  # lines sent to the process's standard input

    @property
    def running(self) -> bool:
        return self._running

    def start(self, argv: Sequence[str], *, on_line, on_exit) -> None:
        self.argv, self.on_line, self.on_exit = list(argv), on_line, on_exit
        self._running = True

    def stop(self, timeout_ms: int = 5000) -> None:
        self.stopped = True
        self.exit(0, True)

    def write_line(self, text: str) -> None:
        self.written.append(text)

    def exit(self, code: int, stopped: bool = False) -> None:
        self._running = False
        assert self.on_exit is not None
        self.on_exit(code, stopped)
