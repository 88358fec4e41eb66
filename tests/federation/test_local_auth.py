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

import httpx
import pytest

from engine.federation.flower import local_auth
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
def test_a_local_process_without_the_secret_gets_nothing(tmp_path):
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

    link_port, fleet_port, node_port = free_port(), free_port(), free_port()
    link_secret, node_secret = local_auth.new_secret(), local_auth.new_secret()
    superlink = ChildProcess(
        "SuperLink", launcher_argv("superlink", ["--host", "127.0.0.1", "--port", str(link_port), "--isolation",
                                                 "process", "--insecure"], fleet_address=f"127.0.0.1:{fleet_port}"),
        tmp_path / "superlink.log", env={"FLWR_HOME": str(tmp_path / "link-home"), local_auth.ENV: link_secret})
    supernode = ChildProcess(
        "SuperNode", launcher_argv("supernode", ["--superlink", f"127.0.0.1:{fleet_port}", "--isolation", "process",
                                                 "--host", "127.0.0.1", "--port", str(node_port), "--insecure"],
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
        owner = _control(link, link_secret)
        owner_node = _runtime(node, "flwr-clientapp", node_secret)
        clients += [owner, owner_node]
        registered = [n.public_key for n in owner.ListNodes(ListNodesRequest()).nodes_info]
        assert all(b"".join(str(k).encode().split()) != b"".join(key.split()) for k in registered)  # no rogue key
        assert len(owner.ListRuns(ListRunsRequest()).run_dict) == 0  # no run was started
        assert owner.RegisterNode(RegisterNodeRequest(public_key=key, name="site1")).node_id
        assert not owner_node.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])).token
    finally:
        for client in clients:
            client.close()
        supernode.stop()
        superlink.stop()
