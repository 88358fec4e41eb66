"""Runs engine calls on a thread pool and delivers their results on the GUI thread.

Each job gets a :class:`QtTaskHandle`, a ``QObject`` that lives on the GUI thread. The worker
emits the handle's signals from the pool thread; because the handle (the receiver) lives on
the GUI thread, Qt queues those signals and the callbacks run on the GUI thread, never on the
worker. Progress is throttled to at most one event of each kind per ``PROGRESS_INTERVAL_S`` (the
last one of each kind is always delivered), so a job reporting every batch cannot flood the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal, Slot

from engine.errors import CancelledError
from fedsm_gui.controllers.runners import Job

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.05


class QtTaskHandle(QObject):
    """A submitted job: cancel it, see whether it is done; relays its signals to the callbacks."""

    progressed = Signal(object)
    succeeded = Signal(object)
    failed = Signal(object)

    def __init__(self, on_done: Callable[[Any], None], on_error: Callable[[BaseException], None],
                 on_progress: Callable[[dict[str, Any]], None] | None,
                 finished: Callable[[QtTaskHandle], None]) -> None:
        super().__init__()
        self._on_done, self._on_error, self._on_progress = on_done, on_error, on_progress
        self._finished = finished
        self._cancel = threading.Event()
        self._done = False
        self.progressed.connect(self._relay_progress)
        self.succeeded.connect(self._relay_done)
        self.failed.connect(self._relay_error)

    def cancel(self) -> None:
        """Ask the job to stop at its next cancel check."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        """Whether the result (or error) has been delivered."""
        return self._done

    @Slot(object)
    def _relay_progress(self, event: dict[str, Any]) -> None:
        if self._on_progress is not None and not self._done:
            self._on_progress(event)

    @Slot(object)
    def _relay_done(self, result: Any) -> None:
        self._done = True
        try:
            self._on_done(result)
        finally:
            self._finished(self)

    @Slot(object)
    def _relay_error(self, exc: BaseException) -> None:
        self._done = True
        try:
            self._on_error(exc)
        finally:
            self._finished(self)


class _Runnable(QRunnable):
    def __init__(self, job: Job, handle: QtTaskHandle) -> None:
        super().__init__()
        self.job = job
        self.handle = handle
        # Throttled per event kind: a job that relays a raw ``batch`` event and then a derived
        # ``progress`` event for the same batch must not have the second always dropped.
        self._last_emit: dict[Any, float] = {}
        self._pending: dict[Any, dict[str, Any]] = {}

    def _progress(self, event: dict[str, Any]) -> None:
        now = time.monotonic()
        kind = event.get("event")
        if now - self._last_emit.get(kind, float("-inf")) >= PROGRESS_INTERVAL_S:
            self._last_emit[kind] = now
            self._pending.pop(kind, None)
            self.handle.progressed.emit(event)
        else:
            self._pending[kind] = event
        # Deliver what other kinds have been holding back once their interval has passed.
        for other in [k for k in self._pending if now - self._last_emit.get(k, float("-inf")) >= PROGRESS_INTERVAL_S]:
            self._last_emit[other] = now
            self.handle.progressed.emit(self._pending.pop(other))

    def _flush(self) -> None:
        for event in self._pending.values():
            self.handle.progressed.emit(event)
        self._pending.clear()

    def run(self) -> None:
        handle = self.handle
        try:
            if handle.cancelled:
                raise CancelledError("cancelled before it started")
            result = self.job(self._progress, lambda: handle.cancelled)
        except BaseException as exc:  # every failure is delivered to the GUI thread as data
            self._flush()
            handle.failed.emit(exc)
            return
        self._flush()
        handle.succeeded.emit(result)


class QtTaskRunner:
    """:class:`~fedsm_gui.controllers.runners.TaskRunner` on a ``QThreadPool``.

    Parameters
    ----------
    max_threads
        Jobs that may run at once (opening, segmenting and checking data can overlap).
    """

    def __init__(self, max_threads: int = 2) -> None:
        self.pool = QThreadPool()
        self.pool.setMaxThreadCount(max_threads)
        self._active: set[QtTaskHandle] = set()

    def submit(self, job: Job, *, on_done: Callable[[Any], None], on_error: Callable[[BaseException], None],
               on_progress: Callable[[dict[str, Any]], None] | None = None) -> QtTaskHandle:
        handle = QtTaskHandle(on_done, on_error, on_progress, self._active.discard)
        self._active.add(handle)
        self.pool.start(_Runnable(job, handle))
        return handle

    @property
    def active(self) -> int:
        """Jobs whose result has not been delivered yet."""
        return len(self._active)

    def shutdown(self, timeout_ms: int = 10000) -> bool:
        """Cancel every job and wait for the pool; return whether it emptied in time."""
        for handle in list(self._active):
            handle.cancel()
        return self.pool.waitForDone(timeout_ms)
