"""Bounds on uploads at the fleet listener: bytes in flight, objects and bytes per reply.

``FleetOnly`` runs in a uvicorn server in a thread with an echo application in place of the
SuperLink's (as in test_fleet_listener.py); requests are real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from fed_fixtures import pki  # noqa: F401
from test_fleet_listener import EchoApp

from engine.federation.flower.fleet_listener import FleetOnly
from engine.federation.flower.processes import free_port
from engine.federation.flower.upload_limits import MIN_REPLY_LIMIT, ReplyBytes, reply_limit_for


@pytest.fixture
def limited():
    import uvicorn

    app = EchoApp()
    port = free_port()
    front = FleetOnly(app, max_body=1000, max_inflight=1500, max_reply_bytes=2500)
    server = uvicorn.Server(uvicorn.Config(front, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test listener did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", port, app, front
    server.should_exit = True
    thread.join(timeout=10)


def _tree(root: str, children: list[str]):
    from flwr.proto.message_pb2 import ObjectTree

    return ObjectTree(object_id=root, children=[ObjectTree(object_id=c) for c in children])


def _push_messages(trees) -> bytes:
    from flwr.proto.fleet_pb2 import PushMessagesRequest

    return PushMessagesRequest(message_object_trees=trees).SerializeToString()


def _push_object(object_id: str, size: int) -> bytes:
    from flwr.proto.message_pb2 import PushObjectRequest

    return PushObjectRequest(object_id=object_id, object_content=b"w" * size).SerializeToString()


def test_bytes_in_flight_are_bounded_and_the_excess_is_told_to_retry(limited):
    url, port, app, front = limited
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        # an upload that declares 900 bytes and sends only part of them holds 900 of the 1500 bytes
        slow.sendall(b"POST /v1/fleet/push-object HTTP/1.1\r\nhost: x\r\ncontent-length: 900\r\n\r\n" + b"a" * 10)
        # the listener has reserved them (waited for, not slept on: a loaded machine may take a while)
        deadline = time.monotonic() + 60
        while front.inflight.used < 900:
            assert time.monotonic() < deadline, "the listener never started receiving the slow upload"
            time.sleep(0.01)
        busy = httpx.post(f"{url}/v1/fleet/pull-messages", content=b"b" * 700, timeout=10)
        assert busy.status_code == 503  # Flower's clients retry 503 with back-off
        assert httpx.post(f"{url}/v1/fleet/pull-messages", content=b"c" * 500, timeout=10).status_code == 200
        slow.sendall(b"a" * 890)
        assert slow.recv(4096).startswith(b"HTTP/1.1 200")
    # once the slow upload is in, the budget is free again
    assert httpx.post(f"{url}/v1/fleet/pull-messages", content=b"b" * 700, timeout=10).status_code == 200
    assert [len(body) for _, _, body in app.seen] == [500, 900, 700]


def test_a_reply_beyond_its_byte_limit_is_refused_object_by_object(limited):
    url, _, app, _ = limited
    tree = _tree("r" * 64, ["a" * 64, "b" * 64, "c" * 64, "d" * 64])
    assert httpx.post(f"{url}/v1/fleet/push-messages", content=_push_messages([tree])).status_code == 200
    for oid in ("a", "b", "c"):  # 3 x ~810 bytes fit in 2500
        assert httpx.post(f"{url}/v1/fleet/push-object", content=_push_object(oid * 64, 740)).status_code == 200
    refused = httpx.post(f"{url}/v1/fleet/push-object", content=_push_object("d" * 64, 740))
    assert refused.status_code == 413 and b"exceeds the coordinator's limit of 2500 bytes" in refused.content
    assert len(app.seen) == 4  # the refused object never reached the SuperLink
    # objects of no registered reply are left to Flower (which refuses objects it does not expect)
    assert httpx.post(f"{url}/v1/fleet/push-object", content=_push_object("e" * 64, 740)).status_code == 200


def test_a_tree_with_too_many_objects_is_refused_whole():
    counter = ReplyBytes(max_reply_bytes=10**9, max_reply_objects=3)
    assert counter.messages_pushed(_push_messages([_tree("r", ["a", "b"])])) is None
    reason = counter.messages_pushed(_push_messages([_tree("s", ["a", "b", "c"])]))
    assert reason is not None and "4 objects exceeds the limit of 3" in reason


def test_the_coordinators_reply_limit_follows_the_method():
    from engine.federation.spec import MethodSpec, build_method

    spec = MethodSpec(method="fedsm", task="fundus", site_names=("s1", "s2"), rounds=1, image_size=32)
    method = build_method(spec, "cpu")
    from engine.fl.weights import payload_bytes

    state = method.initial_state()
    limit = reply_limit_for(method, state, spec.site_names)
    # every part a FedSM site sends (with the default rule, APFL: the global U-Net, the width-16 VGG-11
    # selector and, with the reference-trained selector, its optimizer state; float32 here), doubled, plus
    # 16 MiB, and never below the floor
    largest = sum(payload_bytes(w) for w in method.expected_update_shapes(state, "s1").values())
    assert largest > 12 * 10**6 and limit == max(2 * largest + 16 * 2**20, MIN_REPLY_LIMIT)
    paper = build_method(MethodSpec(method="fedsm", task="fundus", site_names=("s1", "s2"), rounds=1, image_size=32,
                                    selector_width=64), "cpu")
    paper_largest = sum(payload_bytes(w) for w in paper.expected_update_shapes(paper.initial_state(), "s1").values())
    assert paper_largest > 40 * 10**6
    assert reply_limit_for(paper, paper.initial_state(), spec.site_names) == 2 * paper_largest + 16 * 2**20
    assert limit < 600 * 10**6  # the 600 MB upload of issue 16 is refused
    # a dialogue method's replies are activations, not models: no per-reply limit is derived
    blackfed = build_method(MethodSpec(method="blackfed-v1", task="fundus", site_names=("s1", "s2"), rounds=1,
                                       image_size=32), "cpu")
    assert reply_limit_for(blackfed, blackfed.initial_state(), ("s1", "s2")) is None


def test_header_auth_accepts_only_enrolled_signed_requests(pki):  # noqa: F811
    import base64
    import datetime as dt

    from flwr.supercore.primitives.asymmetric import sign_message

    from engine.federation.flower.fleet_auth import HeaderAuth, write_keys
    from engine.security.certs import load_site_private_key

    auth = HeaderAuth.from_file(write_keys(pki / "fleet-keys-test.pem", [(pki / "site1.pub.pem").read_bytes()]))

    def scope(site, when=None, tamper=False):
        key = load_site_private_key(pki / f"{site}.key")
        stamp = (when or dt.datetime.now(dt.UTC)).isoformat()
        signature = sign_message(key, stamp.encode())
        if tamper:
            stamp = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).isoformat()
        return {"headers": [(b"flwr-public-key", base64.b64encode((pki / f"{site}.pub.pem").read_bytes())),
                            (b"flwr-signature", base64.b64encode(signature)), (b"flwr-timestamp", stamp.encode())]}

    assert auth.allowed(scope("site1"))
    assert not auth.allowed(scope("site2"))  # a valid signature by a key that is not enrolled
    assert not auth.allowed(scope("site1", tamper=True))  # the signature does not cover this timestamp
    assert not auth.allowed(scope("site1", when=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)))  # replayed
    assert not auth.allowed({"headers": []})


def test_the_header_check_speaks_the_installed_flowers_protocol():
    # FedSM writes Flower's wire constants out (engine.federation.flower.fleet_auth); they must be Flower's
    from flwr.common.constant import SYSTEM_TIME_TOLERANCE, TIMESTAMP_HEADER, TIMESTAMP_TOLERANCE
    from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER

    from engine.federation.flower import fleet_auth

    assert (fleet_auth.PUBLIC_KEY_HEADER, fleet_auth.SIGNATURE_HEADER, fleet_auth.TIMESTAMP_HEADER) == (
        FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER, TIMESTAMP_HEADER)
    assert (fleet_auth.TIMESTAMP_TOLERANCE_S, fleet_auth.CLOCK_SKEW_S) == (TIMESTAMP_TOLERANCE, SYSTEM_TIME_TOLERANCE)


def test_one_site_holds_at_most_its_share_of_the_budget_until_flower_has_answered():
    from engine.federation.flower.upload_limits import InflightBudget

    budget = InflightBudget(limit=100, per_sender=40)
    assert budget.take(30, b"site1") and not budget.take(30, b"site1")  # site1's share is full
    assert budget.take(30, b"site2") and budget.take(30)  # the others still get through
    assert not budget.take(30, b"site3")  # the whole budget is full
    budget.give(30, b"site1")
    budget.give(30)
    assert budget.take(50, b"site1")  # with nothing in flight, one request beyond its share (within the budget)
    assert not budget.take(1, b"site1")
    budget.give(50, b"site1")
    assert budget.used == 30 and budget.take(40, b"site1")


def test_a_refused_reply_is_reported_once_and_given_up_by_the_coordinator():
    from engine.federation.flower.upload_limits import REFUSED_REPLY, RefusedReplies

    counter = ReplyBytes(max_reply_bytes=1500)
    lines: list[str] = []
    counter.on_refused = lambda root, reason: lines.append(f"{REFUSED_REPLY} {root} {reason}")
    counter.messages_pushed(_push_messages([_tree("r" * 64, ["a" * 64, "b" * 64])]))
    assert counter.object_pushed(_push_object("a" * 64, 740)) is None
    for _ in range(2):  # every later object of the reply is refused too, reported once
        assert "exceeds the coordinator's limit of 1500 bytes" in counter.object_pushed(_push_object("b" * 64, 740))
    assert len(lines) == 1
    refused = RefusedReplies()
    assert not refused.on_line("INFO: something else") and refused.reason("r" * 64) is None
    assert refused.on_line("12:00:00.000 " + lines[0])  # as the SuperLink's log line reaches the coordinator
    assert "exceeds the coordinator's limit of 1500 bytes" in refused.reason("r" * 64)


def test_a_pull_is_abandoned_at_once_with_the_reason():
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from engine.federation.flower.transfer import AbandonedTransfer, pull_objects_promptly

    calls = []

    def pull(object_id):
        calls.append(object_id)
        if object_id == "b":
            raise ObjectUnavailableError(object_id)
        return b"x"

    reasons = iter([None, None, "the reply exceeds the limit"])
    started = time.monotonic()
    with pytest.raises(AbandonedTransfer, match="exceeds the limit"):
        pull_objects_promptly(["a", "b"], pull, stall_timeout=60, workers=1, abandon=lambda: next(reasons))
    assert time.monotonic() - started < 5 and calls.count("b") == 3


def test_large_bodies_reach_flower_one_at_a_time():
    """Several uploads are received at once, but handed to Flower one by one (heap fragmentation, issue 16)."""
    import asyncio
    import concurrent.futures

    import uvicorn

    class SlowApp(EchoApp):
        inside = peak = 0

        async def __call__(self, scope, receive, send):
            SlowApp.inside += 1
            SlowApp.peak = max(SlowApp.peak, SlowApp.inside)
            await asyncio.sleep(0.2)
            SlowApp.inside -= 1
            await super().__call__(scope, receive, send)

    app = SlowApp()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(FleetOnly(app, max_body=2**20), host="127.0.0.1", port=port,
                                           lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}/v1/fleet/push-object"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            large = list(pool.map(lambda k: httpx.post(url, content=b"x" * 200_000, timeout=30).status_code, range(3)))
        assert large == [200] * 3 and SlowApp.peak == 1
        SlowApp.peak = 0
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # small requests (polls) are not held up
            small = list(pool.map(lambda k: httpx.post(url, content=b"x" * 100, timeout=30).status_code, range(3)))
        assert small == [200] * 3 and SlowApp.peak > 1
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_reply_refused_whole_is_given_up_by_the_message_it_answers():
    """A reply of too many objects is never announced: the coordinator learns of it by the id of its request."""
    from flwr.proto.message_pb2 import Message, Metadata
    from flwr.proto.runtime_pb2 import PullAppMessagesResponse
    from flwr.supercore.run import Run

    from engine.federation.flower.coordinator_grid import PromptHttpGrid
    from engine.federation.flower.upload_limits import REFUSED_REPLY, RefusedReplies

    counter = ReplyBytes(max_reply_bytes=10**9, max_reply_objects=1)
    lines: list[str] = []
    counter.on_refused = lambda key, reason: lines.append(f"{REFUSED_REPLY} {key} {reason}")
    from flwr.proto.fleet_pb2 import PushMessagesRequest

    body = PushMessagesRequest(messages_list=[Message(metadata=Metadata(reply_to_message_id="req-7"))],
                               message_object_trees=[_tree("r", ["a", "b"])]).SerializeToString()
    assert "exceeds the limit of 1" in counter.messages_pushed(body)
    refused = RefusedReplies()
    assert refused.on_line(lines[0])

    class Grid(PromptHttpGrid):
        _runtime_client = type("Client", (), {"PullMessages": lambda self, req: PullAppMessagesResponse()})()

    grid = Grid("127.0.0.1:1", True, None, token="t")
    grid.set_run(Run.create_empty(1))
    grid.refused = refused
    assert list(grid.pull_messages(["req-7", "req-8"])) == []
    assert grid.failed_replies == {"req-7": "the coordinator refused its reply: a reply of 3 objects exceeds the "
                                             "limit of 1"}
