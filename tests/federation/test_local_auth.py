"""The loopback APIs of the SuperLink and of a SuperNode answer only the FedSM process that started them.

A real SuperLink and a real SuperNode (127.0.0.1, started through the FedSM launcher with a
secret, as ``fedsm server`` and ``fedsm site`` start them) are probed by a local process that
does not hold the secret: listing nodes and runs, registering a key, unregistering a node,
starting or stopping a run, taking the ServerApp task or the site's ClientApp task all get
401 and change nothing. The same calls with the secret work.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx
import pytest
from fed_fixtures import pki  # noqa: F401

from engine.federation.flower import local_auth
from engine.federation.flower.fleet_auth import write_keys
from engine.federation.flower.processes import ChildProcess, free_port, launcher_argv


def _call_asgi(app, headers):
    """Status of one HTTP request through an ASGI app, and whether the inner app saw it."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/control/list-runs", "headers": headers},
                    receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_guard_lets_only_the_secret_through():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    secret = local_auth.new_secret()
    app = local_auth.guard(inner, secret)
    assert _call_asgi(app, []) == 401
    assert _call_asgi(app, [(b"x-fedsm-local-secret", b"wrong")]) == 401
    assert _call_asgi(app, [(b"x-fedsm-local-secret", secret[:-1].encode())]) == 401
    assert seen == []
    assert _call_asgi(app, [(b"x-fedsm-local-secret", secret.encode())]) == 200
    assert seen == ["/v1/control/list-runs"]
    assert local_auth.guard(inner, None) is inner  # no secret: nothing changes
    assert local_auth.new_secret() != secret


def _control(address, secret=None):
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    return ControlHttpClient.from_server_address(
        address, True, None, interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI"),
                                           *local_auth.interceptors(secret)])


def _runtime(address, component, secret=None):
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name=component), *local_auth.interceptors(secret)])


def _refused(call) -> None:
    with pytest.raises(httpx.HTTPStatusError, match="401"):
        call()


@pytest.mark.slow
def test_a_local_process_without_the_secret_gets_nothing(tmp_path, pki):  # noqa: F811
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.common.serde import fab_to_proto
    from flwr.proto.control_pb2 import (
        ListNodesRequest,
        ListRunsRequest,
        RegisterNodeRequest,
        StartRunRequest,
        StopRunRequest,
        UnregisterNodeRequest,
    )
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.fab import Fab

    link_port = free_port()
    fleet_port = free_port(avoid={link_port})
    node_port = free_port(avoid={link_port, fleet_port})
    link_secret, node_secret = local_auth.new_secret(), local_auth.new_secret()
    site_key = (pki / "site1.pub.pem").read_bytes()
    tls = ["--ssl-ca-certfile", str(pki / "ca.pem"), "--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile",
           str(pki / "server.key"), "--enable-supernode-auth"]
    superlink = ChildProcess(
        "SuperLink", launcher_argv("superlink", ["--host", "127.0.0.1", "--port", str(link_port), "--isolation",
                                                 "process", *tls], fleet_address=f"127.0.0.1:{fleet_port}",
                                   fleet_keys=str(write_keys(tmp_path / "fleet-keys.pem", [site_key]))),
        tmp_path / "superlink.log", env={"FLWR_HOME": str(tmp_path / "link-home"), local_auth.ENV: link_secret})
    supernode = ChildProcess(
        "SuperNode", launcher_argv("supernode", ["--superlink", f"127.0.0.1:{fleet_port}", "--isolation", "process",
                                                 "--host", "127.0.0.1", "--port", str(node_port),
                                                 "--root-certificates", str(pki / "ca.pem"),
                                                 "--auth-supernode-private-key", str(pki / "site1.key")],
                                   poll_interval=0.2, approved_apps=[], site="site1"),
        tmp_path / "supernode.log", env={"FLWR_HOME": str(tmp_path / "node-home"), local_auth.ENV: node_secret})
    link, node = f"127.0.0.1:{link_port}", f"127.0.0.1:{node_port}"
    key = ec.generate_private_key(ec.SECP384R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    fab = b"not an app"
    clients = []
    try:
        superlink.start()
        superlink.wait_for_port("127.0.0.1", link_port, timeout=120)
        owner = _control(link, link_secret)
        clients.append(owner)
        assert owner.RegisterNode(RegisterNodeRequest(public_key=site_key, name="site1")).node_id  # enrolment
        supernode.start()
        supernode.wait_for_port("127.0.0.1", node_port, timeout=120)

        # Execute: a local process without the secret
        stranger = _control(link)
        stranger_rt = _runtime(link, "flwr-serverapp")
        stranger_node = _runtime(node, "flwr-clientapp")
        wrong = _control(link, "not-the-secret")
        clients += [stranger, stranger_rt, stranger_node, wrong]
        _refused(lambda: stranger.ListNodes(ListNodesRequest()))
        _refused(lambda: stranger.ListRuns(ListRunsRequest()))
        _refused(lambda: wrong.ListRuns(ListRunsRequest()))
        _refused(lambda: stranger.RegisterNode(RegisterNodeRequest(public_key=key, name="rogue")))
        _refused(lambda: stranger.UnregisterNode(UnregisterNodeRequest(node_id=1)))
        _refused(lambda: stranger.StartRun(StartRunRequest(
            fab=fab_to_proto(Fab(hashlib.sha256(fab).hexdigest(), fab, {})))))
        _refused(lambda: stranger.StopRun(StopRunRequest(run_id=1)))
        _refused(lambda: stranger_rt.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.SERVER_APP])))
        _refused(lambda: stranger_node.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])))
        for path in ("/docs", "/openapi.json", "/health"):
            assert httpx.get(f"http://{link}{path}").status_code == 401, path
            assert httpx.get(f"http://{node}{path}").status_code == 401, path

        # Assert: nothing changed, and the owner (with the secret) is served
        owner_node = _runtime(node, "flwr-clientapp", node_secret)
        clients.append(owner_node)
        registered = [n.public_key for n in owner.ListNodes(ListNodesRequest()).nodes_info]
        assert len(registered) == 1  # site1's key alone: the rogue key was not registered
        assert all(b"".join(str(k).encode().split()) != b"".join(key.split()) for k in registered)
        assert len(owner.ListRuns(ListRunsRequest()).run_dict) == 0  # no run was started
        assert not owner_node.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])).token

        # Anonymous uploads on the sites' address cannot grow the SuperLink's memory
        check_anonymous_uploads_are_bounded(superlink.pid, fleet_port, pki / "ca.pem")
        # ... nor can many small anonymous requests
        check_small_anonymous_requests(superlink.pid, fleet_port, pki / "ca.pem")
    finally:
        for client in clients:
            client.close()
        supernode.stop()
        superlink.stop()


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def check_anonymous_uploads_are_bounded(pid: int, fleet_port: int, ca: Path) -> None:
    """16 connections at once upload 60 MB each, then 48 upload 7.9 MB each, without any credential (TLS)."""
    import concurrent.futures
    import os
    import ssl

    if not os.path.exists(f"/proc/{pid}/status"):
        pytest.skip("needs /proc to read the SuperLink's memory")
    before = _rss_mib(pid)
    url = f"https://127.0.0.1:{fleet_port}/v1/fleet/push-object"
    context = ssl.create_default_context(cafile=str(ca))

    payloads = {60 * 10**6: b"\0" * (60 * 10**6), 7_900_000: b"\0" * 7_900_000}  # shared by the threads

    def upload(size: int) -> int:
        try:
            return httpx.post(url, content=payloads[size], timeout=60, verify=context,
                              headers={"content-type": "application/protobuf"}).status_code
        except httpx.TransportError:  # refused before the body was sent: the server closed the connection
            return 413

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        large = list(pool.map(upload, [60 * 10**6] * 16))
        peak_large = _rss_mib(pid)
        small = list(pool.map(upload, [7_900_000] * 16))
        after = _rss_mib(pid)
        small += list(pool.map(upload, [7_900_000] * 32))  # more of the same does not take more
    again = _rss_mib(pid)
    print(f"SuperLink RSS MiB: before {before:.0f}, after 16x60MB {peak_large:.0f}, after 16x7.9MB {after:.0f}, "
          f"after 32 more {again:.0f}; codes {sorted(set(small))}")
    assert large == [413] * 16  # above the 8 MiB per-request limit: refused from the declared length
    assert small == [401] * 48  # not signed by an enrolled site: refused from the headers
    assert max(peak_large, after, again) - before < 50, (before, peak_large, after, again)  # issue 16: +950 MB


def check_small_anonymous_requests(pid: int, fleet_port: int, ca: Path) -> None:
    """1,000 small anonymous requests leave the SuperLink's memory flat (red-team, issue 30): within 10 MiB, i.e.
    less than 10 KiB kept per request (3,000 within 30 MiB until 2026-11-29; the same sensitivity, a third of the time;
    measured: 151 -> 152 MiB over 3,000). The slow connections' attack runs beside a real federation:
    tests/federation/test_loopback_secure.py."""
    import concurrent.futures
    import ssl

    context = ssl.create_default_context(cafile=str(ca))
    url = f"https://127.0.0.1:{fleet_port}/v1/fleet/push-object"
    headers = {"content-type": "application/protobuf"}

    def small(count: int) -> list[int]:
        with httpx.Client(verify=context, timeout=30) as client:
            return [client.post(url, content=b"\0" * 60_000, headers=headers).status_code for _ in range(count)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(small, [25] * 8))  # warm-up: TLS sessions, the server's first allocations
        before = _rss_mib(pid)
        codes = [c for part in pool.map(small, [125] * 8) for c in part]
    after = _rss_mib(pid)
    print(f"SuperLink RSS MiB around 1,000 small anonymous requests: {before:.0f} -> {after:.0f}")
    assert codes == [401] * 1000  # refused from the headers: not a byte of any body was read
    assert abs(after - before) <= 10, (before, after)

