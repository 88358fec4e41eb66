"""The fleet-only front door, child processes stopped by PID, and the launcher's watchdog."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from typing import ClassVar

import httpx
import pytest

from engine.errors import FedSMError
from engine.federation.flower.fleet_front import FleetFront
from engine.federation.flower.launch import _CappedTime
from engine.federation.flower.processes import ChildProcess, free_port


class _Upstream(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.seen.append((self.path, self.headers.get("x-node-signature", ""), body))
        reply = b"echo:" + body
        self.send_response(200)
        self.send_header("content-length", str(len(reply)))
        self.send_header("x-upstream", "superlink")
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def front():
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    _Upstream.seen = []
    recorded: list[tuple[str, bytes]] = []
    door = FleetFront("127.0.0.1", free_port(), f"http://127.0.0.1:{upstream.server_address[1]}",
                      record=lambda path, body: recorded.append((path, body)))
    door.start()
    yield door, recorded
    door.stop()
    upstream.shutdown()


def test_front_forwards_fleet_calls_with_their_signature(front):
    door, recorded = front
    res = httpx.post(f"http://127.0.0.1:{door.port}/v1/fleet/pull-messages", content=b"abc",
                     headers={"x-node-signature": "signed"})
    assert res.status_code == 200 and res.content == b"echo:abc" and res.headers["x-upstream"] == "superlink"
    assert _Upstream.seen == [("/v1/fleet/pull-messages", "signed", b"abc")]
    assert recorded == [("/v1/fleet/pull-messages", b"abc")]


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/control/start-run"), ("POST", "/v1/control/register-node"), ("POST", "/v1/runtime/acquire-task"),
    ("POST", "/v1/runtime/push-messages"), ("GET", "/docs"), ("GET", "/v1/fleet/pull-messages"),
    ("POST", "/"), ("PUT", "/v1/fleet/push-object"),
])
def test_front_refuses_everything_else_without_asking_the_superlink(front, method, path):
    door, recorded = front
    assert httpx.request(method, f"http://127.0.0.1:{door.port}{path}", content=b"x").status_code == 404
    assert _Upstream.seen == [] and recorded == []


def test_front_refuses_a_port_in_use(front):
    door, _ = front
    with pytest.raises(FedSMError, match=r"could not listen on 127\.0\.0\.1"):
        FleetFront("127.0.0.1", door.port, "http://127.0.0.1:1").start()


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
    assert time.monotonic() - started < 5 and not child.running()
    assert (tmp_path / "child.log").read_text().strip().endswith(" ready")  # timestamped


def test_child_that_dies_while_starting_is_reported_with_its_output(tmp_path):
    child = ChildProcess("broken", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                         tmp_path / "broken.log")
    child.start()
    with pytest.raises(FedSMError, match=r"broken exited with status 3 while starting(.|\n)*bad flag"):
        child.wait_for_port("127.0.0.1", free_port(), timeout=30)


def test_launcher_watchdog_stops_an_orphan():
    # a parent pid that is not our parent: the watchdog sees "parent gone" and interrupts
    code = ("import threading, time; from engine.federation.flower.launch import _watch_parent; "
            "threading.Thread(target=_watch_parent, args=(1,), daemon=True).start(); time.sleep(30)")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode != 0 and b"KeyboardInterrupt" in proc.stderr
    assert time.monotonic() - started < 20


def test_capped_sleep():
    capped = _CappedTime(0.05)
    started = time.monotonic()
    capped.sleep(3)
    assert time.monotonic() - started < 1
    assert capped.monotonic() > 0  # everything else is the real time module
