"""The Qt runners: results on the GUI thread, throttled progress, cancel, process stop and kill."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from engine.errors import CancelledError, DataError
from fedsm_gui.workers.process import QtProcessRunner
from fedsm_gui.workers.tasks import QtTaskRunner


def test_jobs_run_off_the_gui_thread_and_report_on_it(qtbot):
    runner = QtTaskRunner()
    gui = threading.get_ident()
    seen: dict[str, object] = {}
    progress: list[dict] = []

    def job(report, cancel):
        seen["job_thread"] = threading.get_ident()
        for i in range(200):
            report({"done": i + 1, "total": 200})
        return "result"

    def done(result):
        seen["done_thread"] = threading.get_ident()
        seen["result"] = result

    def on_progress(event):
        seen["progress_thread"] = threading.get_ident()
        progress.append(event)

    handle = runner.submit(job, on_done=done, on_error=pytest.fail, on_progress=on_progress)
    qtbot.waitUntil(lambda: handle.done, timeout=60_000)
    assert seen["result"] == "result"
    assert seen["job_thread"] != gui and seen["done_thread"] == gui and seen["progress_thread"] == gui
    assert 1 <= len(progress) < 200  # throttled
    assert progress[-1] == {"done": 200, "total": 200}  # the last one always arrives
    assert runner.active == 0
    assert runner.shutdown(30_000)


def test_throttling_is_per_event_kind_so_a_derived_event_is_never_starved(qtbot):
    """A relay that sends a raw ``batch`` and then a derived ``progress`` for every batch (the
    demo's training relay does) must deliver progress events while the job runs, not only the last."""
    runner = QtTaskRunner()
    progress: list[dict] = []
    release = threading.Event()

    def job(report, cancel):
        for i in range(100):
            report({"event": "batch", "batch": i})
            report({"event": "progress", "done": i + 1, "total": 100})
            time.sleep(0.002)
        release.wait(60)
        return None

    handle = runner.submit(job, on_done=lambda _r: None, on_error=pytest.fail, on_progress=progress.append)
    # Progress arrives before the job finishes (the job waits for us), with a real total.
    qtbot.waitUntil(lambda: any(e.get("event") == "progress" and e["total"] == 100 for e in progress),
                    timeout=60_000)
    assert not handle.done
    release.set()
    qtbot.waitUntil(lambda: handle.done, timeout=60_000)
    kinds = [e["event"] for e in progress]
    assert kinds.count("progress") >= 2 and kinds.count("batch") >= 1
    assert [e for e in progress if e["event"] == "progress"][-1]["done"] == 100
    assert len(progress) < 200  # still throttled
    assert runner.shutdown(30_000)


def test_errors_and_cancellation_arrive_as_data(qtbot):
    runner = QtTaskRunner()
    errors: list[BaseException] = []

    def failing(report, cancel):
        raise DataError("broken file")

    runner.submit(failing, on_done=pytest.fail, on_error=errors.append)
    started = threading.Event()

    def long_job(report, cancel):
        started.set()
        while not cancel():
            time.sleep(0.01)
        raise CancelledError("stopped")

    handle = runner.submit(long_job, on_done=pytest.fail, on_error=errors.append)
    assert started.wait(60)
    handle.cancel()
    qtbot.waitUntil(lambda: len(errors) == 2, timeout=60_000)
    assert {type(e) for e in errors} == {DataError, CancelledError}
    assert runner.shutdown(30_000)


def test_process_lines_exit_and_clean_stop(qtbot):
    runner = QtProcessRunner()
    lines: list[str] = []
    exits: list[tuple[int, bool]] = []
    code = "import sys; print('one'); print('two', flush=True); sys.stderr.write('warn\\n'); print('tail', end='')"
    runner.start([sys.executable, "-c", code], on_line=lines.append, on_exit=lambda c, s: exits.append((c, s)))
    qtbot.waitUntil(lambda: bool(exits), timeout=60_000)
    assert exits == [(0, False)]
    assert lines[:2] == ["one", "two"] and "warn" in lines and "tail" in lines
    assert not runner.running


def test_stop_kills_a_process_that_ignores_sigterm(qtbot):
    runner = QtProcessRunner()
    lines: list[str] = []
    exits: list[tuple[int, bool]] = []
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")
    runner.start([sys.executable, "-c", code], on_line=lines.append, on_exit=lambda c, s: exits.append((c, s)))
    qtbot.waitUntil(lambda: lines == ["ready"], timeout=60_000)
    t0 = time.monotonic()
    runner.stop(timeout_ms=300)
    qtbot.waitUntil(lambda: bool(exits), timeout=30_000)
    assert time.monotonic() - t0 < 30  # killed, not left to its 60 s sleep (bound for a loaded machine)
    assert exits[0][1] is True  # stopped by the user, even though it had to be killed
    assert not runner.running


def test_a_missing_program_is_reported_not_raised(qtbot):
    runner = QtProcessRunner()
    lines: list[str] = []
    exits: list[tuple[int, bool]] = []
    runner.start(["/nonexistent/fedsm-site"], on_line=lines.append, on_exit=lambda c, s: exits.append((c, s)))
    qtbot.waitUntil(lambda: bool(exits), timeout=60_000)
    assert exits == [(-1, False)] and "cannot start" in lines[0]
