"""Child processes stopped by PID, and the launcher's watchdog."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from engine.errors import FedSMError
from engine.federation.flower.launch import _CappedTime
from engine.federation.flower.processes import ChildProcess, free_port


def test_child_is_stopped_by_pid_even_if_it_ignores_sigint(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")
    lines: list[str] = []
    child = ChildProcess("stubborn", [sys.executable, "-c", code], tmp_path / "child.log", on_line=lines.append)
    child.start()
    deadline = time.monotonic() + 30
    while "ready" not in lines and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines == ["ready"]
    started = time.monotonic()
    assert child.stop(timeout=0.5) == -15  # SIGINT ignored, SIGTERM ended it
    assert time.monotonic() - started < 30 and not child.running()  # not the child's 60 s (bound for a loaded box)
    assert (tmp_path / "child.log").read_text().strip().endswith(" ready")  # timestamped


def test_child_that_dies_while_starting_is_reported_with_its_output(tmp_path):
    child = ChildProcess("broken", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                         tmp_path / "broken.log")
    child.start()
    with pytest.raises(FedSMError, match=r"broken exited with status 3 while starting(.|\n)*bad flag"):
        child.wait_for_port("127.0.0.1", free_port(), timeout=30)


def test_launcher_watchdog_stops_an_orphan():
    # a parent pid that is not our parent: the watchdog sees "parent gone" and interrupts. The child
    # says when its watchdog is about to run, so the time a loaded machine spends importing is not
    # counted; it says so *before* starting the watchdog, whose interrupt (0.2 s later, or sooner on
    # a machine that stalls the main thread) could otherwise cut the line short. The child starts
    # with SIGINT ignored, as a background job of a non-interactive shell (a CI runner) does: the
    # interrupt must still arrive (it did not, before the watchdog restored SIGINT's handler).
    code = ("import time; from engine.federation.flower.launch import start_parent_watchdog; "
            "print('watching', flush=True); start_parent_watchdog(1); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    hang_guard = threading.Timer(300, proc.kill)  # bounds a child that never gets as far as 'watching'
    hang_guard.start()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"watching"
        watching = time.monotonic()
        try:
            proc.wait(timeout=120)  # the watchdog checks every 0.2 s; 600 s of sleep without it
        except subprocess.TimeoutExpired:
            pytest.fail("the watchdog did not stop the orphan within 120 s")
        assert time.monotonic() - watching < 120
        assert proc.returncode != 0 and b"KeyboardInterrupt" in proc.stderr.read()
    finally:
        hang_guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_capped_sleep(monkeypatch):
    # the sleeps asked of time.sleep are recorded, not timed: a loaded machine may oversleep
    asked: list[float] = []
    monkeypatch.setattr(time, "sleep", asked.append)
    capped = _CappedTime(0.05)
    capped.sleep(3)
    capped.sleep(0.01)
    assert asked == [0.05, 0.01]
    assert capped.monotonic() > 0 and capped.perf_counter is time.perf_counter  # the rest is the real time module


def test_free_port_never_hands_out_a_port_it_was_told_to_avoid(monkeypatch):
    # the system may hand a just-released port out again: the coordinator's Fleet port (chosen, not yet
    # bound) once came back as its SuperLink's loopback port, and the SuperLink died at start
    from engine.federation.flower import processes

    handed = iter([40001, 40001, 40002])

    class Socket:
        def __init__(self, *args):
            self.port = next(handed)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes.socket, "socket", Socket)
    assert processes.free_port(avoid={40001}) == 40002
