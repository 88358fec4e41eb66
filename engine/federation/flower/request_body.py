"""Hand a Flower API application each request body in one piece.

uvicorn passes a request body to the application as it arrives from the socket: a 5 MB
weight chunk comes as ~20–30 ``http.request`` messages. Flower's APIs (1.41, 1.42: SuperLink, and
the SuperNode's Runtime API the site's ClientApp talks to) sit behind Starlette's
``BaseHTTPMiddleware``, which passes every one of those messages through its own task group
and memory streams before Flower joins them into one ``bytes`` anyway. :class:`WholeBody`
reads the body first (one join, or none for a body that came in one piece) and gives the
application a single message, which it reads the same way.

Memory is unchanged: Flower buffers the whole body before parsing it in any case. On the
sites' side :class:`.fleet_listener.FleetOnly` bounds a body before reading it (with
:func:`read_body`); the loopback listeners serve only this machine's own processes.
"""

from __future__ import annotations

from typing import Any

from engine.federation.flower.asgi import App, Message, Receive, Scope, Send
from engine.federation.flower.local_auth import guard, secret_from_environment


class WholeBody:
    """ASGI wrapper: read an HTTP request's body completely, then call ``app`` with it as one message.

    If the client disconnects before its body is complete, the application is not called
    (nobody is left to answer). Everything else (lifespan, websockets) passes through.
    """

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is not None:
            await self.app(scope, replaying(body, receive), send)


async def read_body(receive: Receive) -> bytes | None:
    """The whole body of an HTTP request, or ``None`` when the client disconnected before its end."""
    pieces: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            return None
        pieces.append(message.get("body", b""))
        if not message.get("more_body", False):
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` as one message, then whatever ``receive`` gives (the disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def wrap_supernode_runtime_api() -> None:
    """Make the SuperNode's Runtime API (what the site's ClientApp calls) read bodies whole.

    Flower's SuperNode command builds that application with ``flwr.supernode.main.create_app``,
    imported when the API starts; the module attribute is replaced by one that wraps the result.
    """
    import flwr.supernode.main as supernode_main

    build = supernode_main.create_app
    if getattr(build, "wraps_whole_body", False):
        return

    def create_app(*args: Any, **kwargs: Any) -> Any:
        # only the site process that started this SuperNode reaches its Runtime API (local_auth)
        return guard(WholeBody(build(*args, **kwargs)), secret_from_environment())

    create_app.wraps_whole_body = True  # type: ignore[attr-defined]
    supernode_main.create_app = create_app
