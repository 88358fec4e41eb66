"""The coordinator's front door: the only port sites reach, serving Flower's Fleet API only.

Flower 1.41's SuperLink serves its Fleet API (what SuperNodes call), its Control API (start
runs with any app bundle, register nodes) and its Runtime API (what a ServerApp calls) on one
HTTP port. Exposing that port would let anyone who reaches it push an app to every site. So
the SuperLink listens on 127.0.0.1 only, and this front listens on the address sites use and
forwards ``POST /v1/fleet/*`` to it, nothing else: every other path is answered 404 without
touching the SuperLink. It terminates TLS with the coordinator's certificate and passes the
SuperNode authentication headers (signed by each site's key) through unchanged, so the
SuperLink still checks every request's signature against the enrolled keys.

A request body larger than ``max_body`` is refused with 413 before it is read when its
``Content-Length`` says so, and as soon as it grows past the limit when it is streamed
(chunked), so no client can make the coordinator buffer more than ``max_body`` bytes.

The hop to the SuperLink is a small keep-alive HTTP/1.1 client on asyncio streams (h11 for
the framing, bodies written and read in 1 MB pieces, connections reused): every weight
chunk of every site passes here twice per round (~300 MB for three FedSM sites), and this
client costs about a third less CPU per byte than a general-purpose one (httpx), which on a
small coordinator is time taken from the rounds.

An optional ``record`` callback sees every forwarded request body (used by tests to inspect
exactly what sites send).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import h11

from engine.errors import FedSMError

log = logging.getLogger(__name__)

FLEET_PREFIX = "/v1/fleet/"
#: Largest request body forwarded: an object chunk is 5 MB in Flower 1.41, plus framing.
MAX_BODY = 64 * 1024 * 1024
_DROP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                 "proxy-connection", "te", "trailer", "content-encoding"}
#: Bytes read from a socket at a time, and the most a response's head may take.
_READ_SIZE = 1 << 20
#: Seconds to connect to the SuperLink, and for a whole forwarded request.
CONNECT_TIMEOUT = 10.0
REQUEST_TIMEOUT = 120.0


class UpstreamError(Exception):
    """The SuperLink could not be reached or broke the exchange."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=_READ_SIZE)
        self.used = False

    def close(self) -> None:
        self.writer.close()


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to one upstream (``http://`` or ``https://host:port``).

    Used from one event loop only. A request on a reused connection that the upstream had
    already closed (before any byte of an answer arrived) is sent once more on a new one.
    """

    def __init__(self, url: str, ca_cert: Path | None, max_idle: int = 8) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None or parts.scheme not in ("http", "https"):
            raise ValueError(f"upstream {url!r} must be http(s)://host:port")
        self.host, self.port = parts.hostname, parts.port
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)
        self.max_idle = max_idle
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=_READ_SIZE), CONNECT_TIMEOUT)
        return _Connection(reader, writer)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
        """``(status, headers, body)`` of the upstream's answer to ``POST path``."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                while True:
                    conn = self._idle.pop() if self._idle else await self._connect()
                    try:
                        return await self._exchange(conn, path, body, headers)
                    except _StaleConnection:
                        conn.close()  # closed by the upstream while idle: try once more on a new one
                        if not conn.used:
                            raise UpstreamError("the upstream closed a new connection") from None
        except (OSError, TimeoutError, h11.ProtocolError) as exc:
            raise UpstreamError(str(exc) or type(exc).__name__) from exc

    async def _exchange(self, conn: _Connection, path: str, body: bytes,
                        headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
        http, writer = conn.http, conn.writer
        head = [("host", f"{self.host}:{self.port}"), ("content-length", str(len(body))), *headers.items()]
        answered = False
        try:
            writer.write(http.send(h11.Request(method="POST", target=path, headers=head)))
            for piece in http.send_with_data_passthrough(h11.Data(data=body)):  # no copy of the body
                writer.write(piece)
            writer.write(http.send(h11.EndOfMessage()))
            await writer.drain()
            status, out_headers, parts = 0, [], []
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    data = await conn.reader.read(_READ_SIZE)
                    if not data and not answered:
                        raise _StaleConnection
                    http.receive_data(data)
                elif isinstance(event, h11.Response):
                    answered = True
                    status = event.status_code
                    out_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers]
                elif isinstance(event, h11.Data):
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise _StaleConnection if not answered else UpstreamError("the upstream closed mid-answer")
                # h11.InformationalResponse (1xx): keep reading
        except (ConnectionError, ssl.SSLError):
            conn.close()
            if answered:
                raise
            raise _StaleConnection from None
        except BaseException:
            conn.close()
            raise
        conn.used = True
        if http.our_state is h11.DONE and http.their_state is h11.DONE and len(self._idle) < self.max_idle:
            http.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.close()
        return status, out_headers, b"".join(parts)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class _StaleConnection(Exception):
    pass


class FleetFront:
    """Forward the Fleet API from ``host:port`` to the SuperLink at ``upstream``.

    Parameters
    ----------
    host, port
        Where sites connect.
    upstream
        ``https://127.0.0.1:<port>`` (or ``http://`` when insecure) of the SuperLink.
    certfile, keyfile, ca_cert
        The coordinator's certificate and key (served to sites) and the CA that signed the
        SuperLink's certificate (checked on the loopback hop); all ``None`` when insecure.
    record
        Called with ``(path, body)`` of every forwarded request.
    max_body
        Largest request body forwarded (bytes); larger ones are answered 413.
    """

    def __init__(self, host: str, port: int, upstream: str, certfile: Path | None = None,
                 keyfile: Path | None = None, ca_cert: Path | None = None,
                 record: Callable[[str, bytes], None] | None = None, max_body: int = MAX_BODY) -> None:
        self.host, self.port, self.upstream = host, port, upstream.rstrip("/")
        self.certfile, self.keyfile, self.ca_cert = certfile, keyfile, ca_cert
        self.record = record
        self.max_body = max_body
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self._upstream: UpstreamPool | None = None

    def _app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import PlainTextResponse, Response
        from starlette.routing import Route

        async def forward(request: Request) -> Response:
            upstream = self._upstream
            path = request.url.path
            if request.method != "POST" or not path.startswith(FLEET_PREFIX) or ".." in path:
                return PlainTextResponse("not found\n", status_code=404)
            body = await read_body(request)
            if body is None:
                return PlainTextResponse("request too large\n", status_code=413,
                                         headers={"connection": "close"})
            if self.record is not None:
                self.record(path, body)
            if upstream is None:
                return PlainTextResponse("coordinator not ready\n", status_code=503)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
            try:
                status, answer_headers, answer = await upstream.post(path, body, headers)
            except UpstreamError as exc:
                log.warning("fleet front: SuperLink unreachable: %s", exc)
                return PlainTextResponse("coordinator not ready\n", status_code=503)
            out_headers = {k: v for k, v in answer_headers if k.lower() not in _DROP_HEADERS}
            return Response(answer, status_code=status, headers=out_headers)

        async def read_body(request: Request) -> bytes | None:
            """The request's body, or ``None`` as soon as it is known to exceed ``max_body``."""
            declared = request.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
                return None  # refused before a byte of the body is read
            parts: list[bytes] = []
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    return None
                parts.append(chunk)
            return b"".join(parts)

        async def refuse(request: Request) -> Response:
            return PlainTextResponse("not found\n", status_code=404)

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
        return Starlette(routes=[Route(FLEET_PREFIX + "{rest:path}", forward, methods=methods),
                                 Route("/{rest:path}", refuse, methods=methods)])

    def start(self, timeout: float = 20.0) -> None:
        """Serve in a background thread; return once the port accepts connections."""
        import uvicorn

        config = uvicorn.Config(self._app(), host=self.host, port=self.port, log_level="warning",
                                access_log=False, lifespan="off",
                                ssl_certfile=str(self.certfile) if self.certfile else None,
                                ssl_keyfile=str(self.keyfile) if self.keyfile else None)
        server = uvicorn.Server(config)
        self._server = server
        pool = UpstreamPool(self.upstream, self.ca_cert)

        async def serve() -> None:
            self._upstream = pool
            try:
                await server.serve()
            finally:
                # the upstream connections close with the server, so the SuperLink can stop promptly
                self._upstream = None
                pool.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True, name="fleet-front")
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise FedSMError(f"could not listen on {self.host}:{self.port} for sites (is the port in use, or the "
                                 "address not one of this machine's?); change [federation] address")
            if server.started:
                return
            time.sleep(0.05)
        raise FedSMError(f"the fleet front did not listen on {self.host}:{self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True  # type: ignore[attr-defined]
        if self._thread is not None:
            self._thread.join(timeout=5)
