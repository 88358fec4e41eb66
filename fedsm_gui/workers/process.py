"""Runs the site process with ``QProcess`` and streams its output lines to the GUI thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer

log = logging.getLogger(__name__)


class QtProcessRunner(QObject):
    """:class:`~fedsm_gui.controllers.runners.ProcessRunner` on ``QProcess``.

    ``stop`` terminates the process (SIGTERM: the site leaves cleanly) and kills it when it
    has not exited after the timeout. Output is read as it arrives, split into lines; stdout
    and stderr both reach ``on_line``.
    """

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.process: QProcess | None = None
        self._buffers = {"out": b"", "err": b""}
        self._on_line: Callable[[str], None] = lambda line: None
        self._on_exit: Callable[[int, bool], None] = lambda code, stopped: None
        self._stopping = False
        self._kill_timer = QTimer(self)
        self._kill_timer.setSingleShot(True)
        self._kill_timer.timeout.connect(self._kill)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.state() != QProcess.ProcessState.NotRunning

    def start(self, argv: Sequence[str], *, on_line: Callable[[str], None],
              on_exit: Callable[[int, bool], None]) -> None:
        if self.running:
            raise RuntimeError("a site process is already running; press Leave first")
        self._on_line, self._on_exit = on_line, on_exit
        self._buffers = {"out": b"", "err": b""}
        self._stopping = False
        process = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        process.setProcessEnvironment(env)
        process.readyReadStandardOutput.connect(lambda: self._read("out"))
        process.readyReadStandardError.connect(lambda: self._read("err"))
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self.process = process
        process.start(argv[0], list(argv[1:]))

    def stop(self, timeout_ms: int = 5000) -> None:
        if not self.running:
            return
        assert self.process is not None
        self._stopping = True
        self.process.terminate()
        self._kill_timer.start(timeout_ms)

    def write_line(self, text: str) -> None:
        """Send ``text`` and a newline to the process's standard input (ignored when none runs)."""
        if self.running and self.process is not None:
            self.process.write((text + "\n").encode("utf-8"))

    def wait(self, timeout_ms: int) -> bool:
        """Block until the process has exited (tests and app shutdown only)."""
        if self.process is None:
            return True
        return self.process.waitForFinished(timeout_ms) or not self.running

    def _kill(self) -> None:
        if self.running and self.process is not None:
            log.warning("site process did not stop after SIGTERM; killing it")
            self.process.kill()

    def _read(self, channel: str) -> None:
        if self.process is None:
            return
        data = bytes(self.process.readAllStandardOutput() if channel == "out"
                     else self.process.readAllStandardError())
        buffer = self._buffers[channel] + data
        *lines, rest = buffer.split(b"\n")
        self._buffers[channel] = rest
        for line in lines:
            self._on_line(line.decode("utf-8", errors="replace"))

    def _flush(self) -> None:
        for channel in ("out", "err"):
            self._read(channel)
            if self._buffers[channel].strip():
                self._on_line(self._buffers[channel].decode("utf-8", errors="replace"))
            self._buffers[channel] = b""

    def _finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._kill_timer.stop()
        self._flush()
        crashed = status == QProcess.ExitStatus.CrashExit
        self._on_exit(0 if (self._stopping and crashed) else (code if not crashed else -1), self._stopping)

    def _error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self._kill_timer.stop()
            program = self.process.program() if self.process else "?"
            self._on_line(f"cannot start {program}: {self.process.errorString() if self.process else ''}")
            self.process = None
            self._on_exit(-1, False)
