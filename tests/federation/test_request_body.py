"""Flower's HTTP APIs get each request body in one piece."""

from __future__ import annotations

import asyncio

from engine.federation.flower.request_body import WholeBody, wrap_supernode_runtime_api


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[dict]]] = []

    async def __call__(self, scope, receive, send) -> None:
        messages = []
        if scope["type"] == "http":
            while True:
                message = await receive()
                messages.append(message)
                if not message.get("more_body", False):
                    break
        self.calls.append((scope["type"], messages))


def _run(app, scope, incoming):
    queue = list(incoming)

    async def receive():
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        pass

    asyncio.run(app(scope, receive, send))


def test_a_body_in_pieces_reaches_the_application_as_one_message():
    inner = Recorder()
    pieces = [{"type": "http.request", "body": b"ab", "more_body": True},
              {"type": "http.request", "body": b"", "more_body": True},
              {"type": "http.request", "body": b"cd", "more_body": False}]
    _run(WholeBody(inner), {"type": "http"}, pieces)
    assert inner.calls == [("http", [{"type": "http.request", "body": b"abcd", "more_body": False}])]


def test_a_body_in_one_piece_is_passed_on_without_a_copy():
    inner = Recorder()
    body = b"x" * 1_000_000
    _run(WholeBody(inner), {"type": "http"}, [{"type": "http.request", "body": body}])
    assert inner.calls[0][1][0]["body"] is body


def test_a_client_gone_before_its_body_is_complete_reaches_nothing():
    inner = Recorder()
    _run(WholeBody(inner), {"type": "http"},
         [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}])
    assert inner.calls == []


def test_lifespan_passes_through():
    inner = Recorder()
    _run(WholeBody(inner), {"type": "lifespan"}, [])
    assert inner.calls == [("lifespan", [])]


def test_the_supernode_runtime_api_is_built_wrapped(monkeypatch):
    import flwr.supernode.main as supernode_main

    built = Recorder()
    monkeypatch.setattr(supernode_main, "create_app", lambda **kwargs: built)
    wrap_supernode_runtime_api()
    wrap_supernode_runtime_api()  # idempotent: wrapped once
    app = supernode_main.create_app(state_factory=None, superexec_auth_secret=None)
    assert isinstance(app, WholeBody) and app.app is built


def test_flowers_supernode_builds_its_runtime_api_with_the_wrapped_name():
    """The SuperNode command imports ``create_app`` from ``flwr.supernode.main`` when its API starts."""
    import importlib
    import inspect

    # the package exports a function of the module's name; the module itself is wanted
    flower_supernode = importlib.import_module("flwr.supernode.cli.flower_supernode")
    source = inspect.getsource(flower_supernode._start_supernode_http_api)
    assert "flwr.supernode.main" in source and "create_app(" in source
