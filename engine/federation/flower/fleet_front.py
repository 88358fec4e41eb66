"""The coordinator's front door: the only port sites reach, serving Flower's Fleet API only.

Flower 1.41's SuperLink serves its Fleet API (what SuperNodes call), its Control API (start
runs with any app bundle, register nodes) and its Runtime API (what a ServerApp calls) on one
HTTP port. Exposing that port would let anyone who reaches it push an app to every site. So
the SuperLink listens on 127.0.0.1 only, and this front listens on the address sites use and
forwards ``POST /v1/fleet/*`` to it, nothing else: every other path is answered 404 without
touching the SuperLink. It terminates TLS with the coordinator's certificate and passes the
SuperNode authentication headers (signed by each site's key) through unchanged, so the
SuperLink still checks every request's signature against the enrolled keys.

An optional ``record`` callback sees every forwarded request body (used by tests to inspect
exactly what sites send).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from engine.errors import FedSMError

log = logging.getLogger(__name__)

FLEET_PREFIX = "/v1/fleet/"
#: Largest request body forwarded: an object chunk is 5 MB in Flower 1.41, plus framing.
MAX_BODY = 64 * 1024 * 1024
_DROP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                 "proxy-connection", "te", "trailer", "content-encoding"}


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
    """

    def __init__(self, host: str, port: int, upstream: str, certfile: Path | None = None,
                 keyfile: Path | None = None, ca_cert: Path | None = None,
                 record: Callable[[str, bytes], None] | None = None) -> None:
        self.host, self.port, self.upstream = host, port, upstream.rstrip("/")
        self.certfile, self.keyfile, self.ca_cert = certfile, keyfile, ca_cert
        self.record = record
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None

    def _app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import PlainTextResponse, Response
        from starlette.routing import Route

        async def forward(request: Request) -> Response:
            client = self._client
            path = request.url.path
            if request.method != "POST" or not path.startswith(FLEET_PREFIX) or ".." in path:
                return PlainTextResponse("not found\n", status_code=404)
            body = await request.body()
            if len(body) > MAX_BODY:
                return PlainTextResponse("request too large\n", status_code=413)
            if self.record is not None:
                self.record(path, body)
            if client is None:
                return PlainTextResponse("coordinator not ready\n", status_code=503)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
            try:
                upstream = await client.post(self.upstream + path, content=body, headers=headers)
            except httpx.TransportError as exc:
                log.warning("fleet front: SuperLink unreachable: %s", exc)
                return PlainTextResponse("coordinator not ready\n", status_code=503)
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
            return Response(upstream.content, status_code=upstream.status_code, headers=out_headers)

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
        verify: bool | str = str(self.ca_cert) if self.ca_cert else False

        async def serve() -> None:
            # the upstream connections close with the server, so the SuperLink can stop promptly
            async with httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(120.0, connect=10.0)) as client:
                self._client = client
                await server.serve()
            self._client = None

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
