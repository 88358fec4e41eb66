"""How controllers run long work and child processes, without knowing about Qt.

The app passes Qt implementations (:mod:`fedsm_gui.workers`); tests pass synchronous fakes.
Every callback given to a runner is called on the GUI thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: ``job(progress, cancel)``: ``progress(event: dict)`` reports, ``cancel()`` says whether to stop.
Job = Callable[[Callable[[dict[str, Any]], None], Callable[[], bool]], Any]


class TaskHandle(Protocol):
    """A running job."""

    def cancel(self) -> None:
        """Ask the job to stop at its next cancel check; ``on_error`` then gets a ``CancelledError``."""

    @property
    def done(self) -> bool:
        """Whether the job has finished (result, error or cancellation delivered)."""


class TaskRunner(Protocol):
    """Runs jobs off the GUI thread."""

    def submit(self, job: Job, *, on_done: Callable[[Any], None], on_error: Callable[[BaseException], None],
               on_progress: Callable[[dict[str, Any]], None] | None = None) -> TaskHandle:
        """Start ``job``; exactly one of ``on_done(result)`` or ``on_error(exc)`` follows."""


class ProcessRunner(Protocol):
    """Runs one child process and streams its output lines."""

    def start(self, argv: Sequence[str], *, on_line: Callable[[str], None],
              on_exit: Callable[[int, bool], None]) -> None:
        """Start ``argv``; ``on_line`` gets every stdout/stderr line, ``on_exit(code, stopped_by_user)`` once."""

    def stop(self, timeout_ms: int = 5000) -> None:
        """Ask the process to terminate; kill it when it has not exited after ``timeout_ms``."""

    def write_line(self, text: str) -> None:
        """Send ``text`` and a newline to the process's standard input."""

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
