"""The SuperLink's two listeners: everything on 127.0.0.1, Flower's Fleet API alone on the sites' address.

Flower's SuperLink (1.41, 1.42) serves its Fleet API (what SuperNodes call), its Control API (start
runs with any app bundle, register nodes) and its Runtime API (what a ServerApp calls) from
one FastAPI application on one port. Exposing that port would let anyone who reaches it push
an app to every site. So the SuperLink process (started by :mod:`.launch`) serves the same
application twice, in one event loop:

- on ``127.0.0.1:<port>``, whole and in plain HTTP, for the coordinator's own ServerApp and
  control calls (loopback traffic never leaves the machine; TLS there cost a full encryption
  and decryption of every weight byte, twice);
- on the federation's address, with the coordinator's TLS certificate, behind
  :class:`FleetOnly`: ``POST /v1/fleet/*`` reaches the application, every other request is
  answered 404 without touching it, and a body larger than ``max_body`` (or of unstated
  length) is refused before it is read.

SuperNode authentication is the SuperLink's own (every fleet request is signed by the site's
key and checked against the enrolled keys). Before, a separate front door in the
coordinator process forwarded the fleet routes to a loopback-only SuperLink; serving them
from the SuperLink itself saves a hop with two TLS sessions for every byte of every weight
chunk (~300 MB per FedSM round for three sites), a third of the coordinator's CPU.

Both hand the application each request body in one piece
(:class:`engine.federation.flower.request_body.WholeBody`).

``record_dir``: every request body a site sends is also written there (``<n>.bin`` with the
path in ``<n>.path``), for tests and audits of exactly what leaves the sites.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.federation.flower.asgi import App, Message, Receive, Scope, Send
from engine.federation.flower.local_auth import guard
from engine.federation.flower.request_body import WholeBody, read_body, replaying
from engine.federation.flower.upload_limits import MAX_BODY as UPLOAD_MAX_BODY
from engine.federation.flower.upload_limits import (
    MAX_INFLIGHT,
    MAX_INFLIGHT_PER_SITE,
    REFUSED_REPLY,
    InflightBudget,
    ReplyBytes,
)

FLEET_PREFIX = "/v1/fleet/"
#: Largest request body accepted: an object chunk is 5 MiB in Flower 1.41 and 1.42, plus framing (upload_limits).
MAX_BODY = UPLOAD_MAX_BODY
#: Bodies above this size reach Flower one at a time (see :meth:`FleetOnly.__call__`).
LARGE_BODY = 64 * 1024
#: A body must arrive within this many seconds plus one second per :data:`MIN_BODY_RATE` bytes
#: (408 and the connection closed otherwise): a sender that announces a body and trickles it holds
#: its share of the in-flight budget only that long. 8 MiB may take 30 + 128 s.
BODY_DEADLINE_S = 30.0
MIN_BODY_RATE = 64 * 1024


class FleetOnly:
    """ASGI wrapper that lets only ``POST /v1/fleet/*`` with a body of known, bounded length through.

    The body is read whole before the application is called, and handed to it as one
    message (as :class:`engine.federation.flower.request_body.WholeBody` does).

    Parameters
    ----------
    app
        The SuperLink's FastAPI application.
    max_body
        Largest ``Content-Length`` accepted (413 above it). A request without one (a chunked
        body) is answered 411: Flower's clients always state the length.
    record_dir
        Write every forwarded body there (see the module's docstring).
    max_inflight
        Bytes of bodies received at once (503 beyond; :class:`.upload_limits.InflightBudget`).
    max_reply_bytes
        Largest reply a site may upload (413 beyond; :class:`.upload_limits.ReplyBytes`).
    auth
        :class:`.fleet_auth.HeaderAuth`: a request whose headers are not signed by an enrolled
        site is answered 401 before a byte of its body is read, whatever its size (every fleet
        request Flower's SuperNodes send is signed; Flower checks them only after reading the
        body). Anonymous traffic therefore never holds any of the in-flight budget, and each
        enrolled site's share is its own. ``None``: insecure mode, no check.
    body_deadline_s, min_body_rate
        A body must arrive within ``body_deadline_s + length / min_body_rate`` seconds
        (408 otherwise).
    """

    def __init__(self, app: App, max_body: int = MAX_BODY,
                 record_dir: Path | None = None, max_inflight: int = MAX_INFLIGHT,
                 max_reply_bytes: int | None = None, auth: Any = None,
                 body_deadline_s: float = BODY_DEADLINE_S, min_body_rate: float = MIN_BODY_RATE) -> None:
        self.app, self.max_body, self.record_dir = app, max_body, record_dir
        self.body_deadline_s, self.min_body_rate = body_deadline_s, min_body_rate
        self.auth = auth  # HeaderAuth: enrolled sites only, decided from the headers (.fleet_auth)
        self.inflight = InflightBudget(max(max_inflight, max_body), max(MAX_INFLIGHT_PER_SITE, max_body))
        self.replies = ReplyBytes(max_reply_bytes)
        self._large = asyncio.Lock()  # large bodies reach Flower one at a time (see __call__)
        # the coordinator reads this line and gives the reply up at once (upload_limits.RefusedReplies)
        self.replies.on_refused = lambda root, reason: print(f"{REFUSED_REPLY} {root} {reason}", flush=True)
        self._recorded = 0
        if record_dir is not None:
            record_dir.mkdir(parents=True, exist_ok=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan: the loopback listener runs the application's
            return
        if scope["method"] != "POST" or not scope["path"].startswith(FLEET_PREFIX):
            await _answer(send, 404, b"not found\n")
            return
        length = _content_length(scope)
        if length is None:
            await _answer(send, 411, b"a fleet request must state its Content-Length\n")
            return
        if length > self.max_body:
            await _answer(send, 413, b"request body too large\n")
            return
        # only an enrolled site's request is worth a byte of its body, however small
        sender = None
        if self.auth is not None:
            if not self.auth.allowed(scope):
                await _refuse_unauthenticated(scope["path"], send)
                return
            sender = _header(scope, b"flwr-public-key")  # authenticated: its key names the site
        # too many bytes on their way in, or in Flower's hands, at once (or from this site): come back later
        if not self.inflight.take(length, sender):
            await _answer(send, 503, b"busy, retry later\n")
            return
        try:
            try:  # bounded in size by the checks above, and in time here
                body = await asyncio.wait_for(read_body(receive),
                                              self.body_deadline_s + length / self.min_body_rate)
            except TimeoutError:
                await _answer(send, 408, b"request body too slow\n")
                return
            if body is None:  # the client left before its body was complete
                return
            if scope["path"].endswith("/push-messages"):
                refused = self.replies.messages_pushed(body)
            elif scope["path"].endswith("/push-object"):
                refused = self.replies.object_pushed(body)
            else:
                refused = None
            if refused is not None:
                await _answer(send, 413, refused.encode() + b"\n")
                return
            if self.record_dir is not None:
                self._record(scope["path"], body)
            # the bytes stay counted until Flower has answered: it parses and copies the body
            status: list[int] = []

            async def answered(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status.append(int(message["status"]))
                await send(message)

            if length > LARGE_BODY:
                # one large body in Flower's hands at a time: handled concurrently, Flower's copies of
                # several bodies fragment the single-arena heap (memory.py) so that it grows with every
                # upload (an enrolled site's junk: 136 -> 1303 MiB for 192 bodies 3 at a time; one at
                # a time: 161 MiB). Receiving stays concurrent; Flower's handling holds the GIL anyway.
                async with self._large:
                    await self.app(scope, replaying(body, receive), answered)
            else:
                await self.app(scope, replaying(body, receive), answered)
            if length > LARGE_BODY and (not status or status[0] >= 400):
                # a refused body is held by the error's traceback (a reference cycle), which the
                # federation processes' sparse collections (memory.freeze_startup_objects) would
                # free only much later: junk uploads would pile up in the heap
                del body
                gc.collect(1)
        finally:
            self.inflight.give(length, sender)

    def _record(self, path: str, body: bytes) -> None:
        assert self.record_dir is not None
        stem = self.record_dir / f"{self._recorded:06d}"
        self._recorded += 1
        stem.with_suffix(".path").write_text(path)
        # the .bin appears whole or not at all (a reader globs for it)
        stem.with_suffix(".part").write_bytes(body)
        stem.with_suffix(".part").replace(stem.with_suffix(".bin"))


async def _refuse_unauthenticated(path: str, send: Send) -> None:
    """401, or for a node's activation Flower's own answer to a key it does not know.

    A SuperNode whose key is not enrolled first asks to activate its node; Flower refuses that
    with its public error 2004 ("Failed to activate SuperNode"), which the SuperNode reports (and
    ``fedsm site`` turns into "this site's key is not enrolled"). Refused here before Flower sees
    it, the SuperNode gets the same answer (:data:`NODE_ACTIVATION_FAILED`, Flower's wire form of
    that error) and the SuperLink's log the same line.
    """
    if not path.endswith("/activate-node"):
        await _answer(send, 401, b"Invalid SuperNode authentication\n")
        return

    code, status, detail = NODE_ACTIVATION_FAILED
    body = json.dumps({"code": code, "detail": detail}).encode()
    print(f"[{path}][ApiError:{code}] refused from its headers: the node's key is not enrolled", flush=True)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


#: Flower's public error for a node it cannot activate: (code, HTTP status, detail), as its Fleet API
#: sends it (``tests/federation/test_fleet_listener.py`` compares it with the installed Flower's catalogue).
NODE_ACTIVATION_FAILED = (2004, 412, "Failed to activate SuperNode.")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def read_recorded(record_dir: Path) -> list[tuple[str, bytes]]:
    """The bodies :class:`FleetOnly` recorded, as (path, body), in the order they arrived."""
    out = []
    for body in sorted(record_dir.glob("*.bin")):
        out.append((body.with_suffix(".path").read_text(), body.read_bytes()))
    return out


async def _run(server: Any) -> None:
    """Serve until told to stop; a port that cannot be opened shows as ``server.started`` false."""
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits when it cannot bind (it has logged why)
        pass


def serve(app: Any, *, local: tuple[str, int], public: tuple[str, int], ssl_certfile: str | None,
          ssl_keyfile: str | None, log_config: Any = None, record_dir: Path | None = None,
          local_secret: str | None = None, max_reply_bytes: int | None = None, auth: Any = None) -> None:
    """Serve ``app`` whole on ``local`` and fleet-only on ``public`` until SIGINT or SIGTERM.

    The application's lifespan (which starts and stops the SuperLink's state) runs once,
    with the loopback listener. With ``local_secret``, the loopback listener answers only
    requests that carry it (:mod:`.local_auth`).
    """
    import uvicorn

    class _Quiet(uvicorn.Server):
        """A server that leaves signals to :func:`serve`."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    tls = {"ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile}
    # Flower's middleware then sees each body as one message (FleetOnly reads bodies whole too)
    inner = _Quiet(uvicorn.Config(guard(WholeBody(app), local_secret), host=local[0], port=local[1],
                                  log_config=log_config, access_log=False))
    outer = _Quiet(uvicorn.Config(FleetOnly(app, record_dir=record_dir, max_reply_bytes=max_reply_bytes, auth=auth),
                                  host=public[0], port=public[1], lifespan="off", log_config=log_config,
                                  access_log=False, **tls))

    async def both() -> None:
        loop = asyncio.get_running_loop()
        stopped = False

        def stop() -> None:
            nonlocal stopped
            # a second signal while stopping forces both servers to close their connections
            for server in (outer, inner):
                server.force_exit = stopped
                server.should_exit = True
            stopped = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        inner_task = asyncio.create_task(_run(inner))
        while not inner.started:  # the fleet routes open once the SuperLink's state is up
            if inner_task.done():
                break
            await asyncio.sleep(0.02)
        outer_task = asyncio.create_task(_run(outer) if inner.started else asyncio.sleep(0))
        await asyncio.wait({inner_task, outer_task}, return_when=asyncio.FIRST_COMPLETED)
        if not stopped:  # a port could not be opened or a server failed: end the other one too
            stop()
        await asyncio.gather(inner_task, outer_task)
        if not inner.started:
            raise SystemExit(f"the SuperLink's loopback listener on {local[0]}:{local[1]} did not start "
                             "(see the log above)")
        if not outer.started:
            raise SystemExit(f"the fleet listener could not open {public[0]}:{public[1]} (see the log above)")

    # uvicorn's own choice of event loop (uvloop when installed: its TLS is much cheaper per byte)
    with asyncio.Runner(loop_factory=inner.config.get_loop_factory()) as runner:
        runner.run(both())
