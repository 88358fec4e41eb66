"""A per-process secret on the loopback APIs: only the FedSM process that started a Flower child reaches its API.

Flower (1.41, 1.42) serves, on one loopback port per component, APIs that steer a run:

- the SuperLink's Control API (register or unregister a node, start, stop or list runs) and
  Runtime API (take the ServerApp task, send messages to sites, read their replies);
- each SuperNode's Runtime API (take the site's ClientApp task, read the global model,
  answer in the site's name).

Loopback keeps the network out, but not the other users and processes of the machine. Flower
itself protects only ``AcquireTask`` of the Runtime API (``--superexec-auth-secret-file``, an
HMAC, marked experimental) and offers Control API authentication only through its OIDC
plugin, which the open-source distribution does not ship ("OIDC account authentication is
unavailable in this Flower distribution"). So every FedSM process that starts a SuperLink or
SuperNode draws a fresh random secret (:func:`new_secret`), hands it to the child in its
environment (``FEDSM_LOCAL_SECRET``; a process's environment is readable only by its own user
and root, unlike its command line), and the child's loopback listener answers every HTTP
request without the secret in :data:`HEADER` with 401 before Flower sees it
(:class:`LocalSecretGuard`). The parent's own clients add the header
(:class:`LocalSecretInterceptor`).

The fleet listener on the sites' address is not affected: it has TLS and Flower's SuperNode
authentication, and serves the Fleet API alone (:mod:`.fleet_listener`).
"""

from __future__ import annotations

import hmac
import os
import secrets
from typing import Any

from engine.federation.flower.asgi import App, Receive, Scope, Send

#: Environment variable through which a Flower child receives its parent's secret.
ENV = "FEDSM_LOCAL_SECRET"
#: HTTP header that carries the secret on the loopback APIs.
HEADER = "x-fedsm-local-secret"
_HEADER_BYTES = HEADER.encode()


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def secret_from_environment() -> str | None:
    """The secret this process was given by its parent (``None``: none was given)."""
    value = os.environ.get(ENV, "")
    return value or None


class LocalSecretGuard:
    """ASGI wrapper: an HTTP request reaches ``app`` only if it carries ``secret`` in :data:`HEADER`.

    Anything else is answered 401 without reading its body (a websocket is closed). Lifespan
    events pass through, so the application starts and stops as before.
    """

    def __init__(self, app: App, secret: str) -> None:
        if not secret:
            raise ValueError("the local secret must not be empty")
        self.app = app
        self._secret = secret.encode()

    def allowed(self, scope: Scope) -> bool:
        """Whether the request's headers carry the secret (compared in constant time)."""
        for name, value in scope.get("headers", ()):
            if name == _HEADER_BYTES:
                return hmac.compare_digest(value, self._secret)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b"this API is reserved to the FedSM process that started it\n"
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def guard(app: Any, secret: str | None) -> Any:
    """``app`` behind :class:`LocalSecretGuard` when a secret is given, else ``app`` itself."""
    return app if not secret else LocalSecretGuard(app, secret)


class LocalSecretInterceptor:
    """Interceptor of Flower's protobuf-over-HTTP clients that adds the secret to every request."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the local secret must not be empty")
        self._secret = secret

    def intercept(self, context: Any, call_next: Any) -> Any:
        context.request.headers[HEADER] = self._secret
        return call_next(context)


def interceptors(secret: str | None) -> list[LocalSecretInterceptor]:
    """``[LocalSecretInterceptor(secret)]``, or ``[]`` without a secret."""
    return [LocalSecretInterceptor(secret)] if secret else []
