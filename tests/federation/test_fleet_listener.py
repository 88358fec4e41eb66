"""The SuperLink's two listeners: the whole API on loopback, the Fleet API alone on the sites' address.

``FleetOnly`` is exercised in a uvicorn server in a thread with a small ASGI application in
place of the SuperLink's; ``serve`` runs in a child process (it owns the process's signals),
stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.federation.flower.fleet_listener import FleetOnly, read_recorded
from engine.federation.flower.processes import free_port
from engine.federation.preflight import port_open


class EchoApp:
    """Stands in for the SuperLink's application: answers every request with what it read."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        signature = dict(scope["headers"]).get(b"x-node-signature", b"").decode()
        self.seen.append((scope["path"], signature, body))
        reply = b"echo:" + body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(reply)).encode()), (b"x-upstream", b"superlink")]})
        await send({"type": "http.response.body", "body": reply})


@pytest.fixture
def listener(tmp_path):
    import uvicorn

    app = EchoApp()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(FleetOnly(app, max_body=1000, record_dir=tmp_path / "sent"),
                                           host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test listener did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", port, app, tmp_path / "sent"
    server.should_exit = True
    thread.join(timeout=10)


def test_fleet_calls_reach_the_application_with_their_signature_and_are_recorded(listener):
    url, _, app, sent = listener
    res = httpx.post(f"{url}/v1/fleet/pull-messages", content=b"abc", headers={"x-node-signature": "signed"})
    assert res.status_code == 200 and res.content == b"echo:abc" and res.headers["x-upstream"] == "superlink"
    assert app.seen == [("/v1/fleet/pull-messages", "signed", b"abc")]
    httpx.post(f"{url}/v1/fleet/push-object", content=b"z" * 1000)
    assert read_recorded(sent) == [("/v1/fleet/pull-messages", b"abc"), ("/v1/fleet/push-object", b"z" * 1000)]
    assert not list(sent.glob("*.part"))  # recorded bodies appear whole


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/control/start-run"), ("POST", "/v1/control/register-node"), ("POST", "/v1/runtime/acquire-task"),
    ("POST", "/v1/runtime/push-messages"), ("GET", "/docs"), ("GET", "/v1/fleet/pull-messages"),
    ("POST", "/"), ("PUT", "/v1/fleet/push-object"),
])
def test_everything_but_the_fleet_api_is_refused_without_reaching_the_application(listener, method, path):
    url, _, app, sent = listener
    assert httpx.request(method, f"{url}{path}", content=b"x").status_code == 404
    assert app.seen == [] and read_recorded(sent) == []


def test_a_declared_oversized_body_is_refused_before_it_is_read(listener):
    _, port, app, sent = listener
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        # announces a gigabyte, sends none of it: the answer must come without the body, not after a read
        # (the bound is generous for a loaded machine; a listener that waited for the body never answers)
        sock.sendall(b"POST /v1/fleet/push-object HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n")
        started = time.monotonic()
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:80]
    assert time.monotonic() - started < 30
    assert app.seen == [] and read_recorded(sent) == []


def test_bodies_of_unstated_length_are_refused_and_those_within_the_limit_pass(listener):
    url, _, app, _ = listener

    def chunks(total: int):
        for _ in range(total // 100):
            yield b"x" * 100

    assert httpx.post(f"{url}/v1/fleet/push-object", content=chunks(500), timeout=10).status_code == 411
    assert httpx.post(f"{url}/v1/fleet/push-object", content=b"y" * 1001, timeout=10).status_code == 413
    assert app.seen == []
    with httpx.Client(timeout=10) as client:  # one kept-alive connection
        for _ in range(3):
            assert client.post(f"{url}/v1/fleet/push-object", content=b"z" * 1000).content == b"echo:" + b"z" * 1000
    assert [body for _, _, body in app.seen] == [b"z" * 1000] * 3


def test_a_body_that_trickles_in_is_given_up_at_its_deadline_and_its_budget_returned(tmp_path):
    import asyncio

    app = EchoApp()
    only = FleetOnly(app, max_body=1000, body_deadline_s=0.3, min_body_rate=1e9)
    sent: list[dict] = []

    async def trickle():  # the headers announce 500 bytes, 10 arrive, then nothing
        await asyncio.sleep(0)
        if not sent:
            trickle.calls += 1
            if trickle.calls == 1:
                return {"type": "http.request", "body": b"x" * 10, "more_body": True}
        await asyncio.sleep(3600)
    trickle.calls = 0

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/fleet/push-object",
             "headers": [(b"content-length", b"500")]}
    started = time.monotonic()
    asyncio.run(only(scope, trickle, send))
    assert time.monotonic() - started < 5
    assert sent[0]["status"] == 408 and app.seen == []
    assert only.inflight.used == 0  # the trickler's share of the in-flight budget is free again


_SERVE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engine.federation.flower.fleet_listener import serve

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":  # the application's state starts once, with the loopback listener
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    with open(sys.argv[3], "a") as f:
                        f.write("started\\n")
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body", False):
            pass
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    serve(app, local=("127.0.0.1", int(sys.argv[1])), public=("127.0.0.1", int(sys.argv[2])),
          ssl_certfile=None, ssl_keyfile=None, log_config=None)
""")


def _start_serve(tmp_path: Path, local: int, public: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SERVE, str(local), str(public), str(tmp_path / "lifespan")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_serve_answers_everything_on_loopback_only_fleet_calls_outside_and_stops_on_sigterm(tmp_path):
    local = free_port()
    public = free_port(avoid={local})
    proc = _start_serve(tmp_path, local, public)
    try:
        deadline = time.monotonic() + 60
        while not port_open("127.0.0.1", public):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve did not open its ports"
            time.sleep(0.05)
        for path in ("/v1/control/start-run", "/v1/runtime/acquire-task", "/v1/fleet/pull-messages"):
            assert httpx.post(f"http://127.0.0.1:{local}{path}", content=b"x").content == path.encode()
        assert httpx.post(f"http://127.0.0.1:{public}/v1/control/start-run", content=b"x").status_code == 404
        assert httpx.post(f"http://127.0.0.1:{public}/v1/fleet/pull-messages", content=b"x").status_code == 200
        assert (tmp_path / "lifespan").read_text() == "started\n"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not port_open("127.0.0.1", local) and not port_open("127.0.0.1", public)
    finally:
        _stop(proc)


def test_serve_exits_with_a_reason_when_the_fleet_port_is_taken(tmp_path):
    local = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start_serve(tmp_path, local, port)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            _stop(proc)
    assert proc.returncode != 0
    assert f"could not open 127.0.0.1:{port}" in out
    assert not port_open("127.0.0.1", local)  # the loopback listener was closed too


def test_the_refusal_of_an_unenrolled_node_is_flowers_own_error():
    # the fleet listener answers an unknown key's activation as Flower would, from Flower's wire form
    from flwr.supercore.error.base import ApiErrorCode, FlowerError
    from flwr.supercore.error.catalog import API_ERROR_MAP

    from engine.federation.flower.fleet_listener import NODE_ACTIVATION_FAILED

    code, status, detail = NODE_ACTIVATION_FAILED
    spec = API_ERROR_MAP[ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED]
    assert (code, status) == (int(ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED), int(spec.http_status_code))
    assert FlowerError(ApiErrorCode(code), "key not enrolled").to_json(spec.public_message) == {
        "code": code, "detail": detail}
