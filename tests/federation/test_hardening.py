"""Hardening of the network transport, without a federation run.

- ``--insecure`` only for a loopback coordinator, at the server and at the site;
- Flower's settings for every process FedSM starts, and nothing else of Flower's inherited;
- no run-time installation of app dependencies (checked with Flower's own argument parsers);
- the SuperLink's fleet listener refuses oversized bodies before reading them (test_fleet_listener);
- an app a site never approved is refused before its payload is pulled, both by the site's
  SuperNode (from the coordinator) and by the site's ClientApp executor (from its SuperNode).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.errors import ConfigError
from engine.federation import config as fedconfig
from engine.federation.events import EventWriter, read_events
from engine.federation.flower import FLOWER_ENV
from engine.federation.flower.processes import ChildProcess
from engine.security.approval import app_hash

ROOT = Path(__file__).resolve().parents[2]
REMOTE = "10.1.2.3:9092"


def write_site_toml(folder: Path, coordinator: str) -> Path:
    (folder / "datalist.json").write_text('{"training": []}')
    path = folder / "site.toml"
    path.write_text(f'[site]\nname = "site1"\ncoordinator = "{coordinator}"\ndatalist = "datalist.json"\n'
                    f'task = "fundus"\nwork_dir = "work"\n[security]\napproved_apps = []\n')
    return path


# --- 1. --insecure only on loopback -------------------------------------------------


def test_site_refuses_insecure_mode_for_a_remote_coordinator(tmp_path):
    from engine.federation.flower.site import check_insecure_allowed, run_site

    cfg = fedconfig.load_site_config(write_site_toml(tmp_path, REMOTE), check_files=False)
    with EventWriter("site", "site1", tmp_path / "events.jsonl") as events, \
            pytest.raises(ConfigError) as err:
        run_site(cfg, insecure=True, events=events)
    message = str(err.value)
    assert "--insecure is for loopback demonstrations only" in message and REMOTE in message
    assert "drop --insecure" in message and "ca_cert" in message  # what to do instead
    assert not (tmp_path / "work" / "supernode.log").exists()  # refused before anything started
    for coordinator in ("127.0.0.1:9092", "localhost:9092", "[::1]:9092"):
        ok = fedconfig.load_site_config(write_site_toml(tmp_path, coordinator), check_files=False)
        check_insecure_allowed(ok, insecure=True)
    check_insecure_allowed(cfg, insecure=False)  # a remote coordinator with TLS is the normal case


def test_fedsm_site_command_refuses_insecure_mode_for_a_remote_coordinator(tmp_path):
    path = write_site_toml(tmp_path, REMOTE)
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "site", "--config", str(path), "--insecure"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--insecure is for loopback demonstrations only" in proc.stderr


def test_server_refuses_insecure_mode_for_a_remote_address(tmp_path):
    from engine.federation.flower.server import run_server

    path = tmp_path / "federation.toml"
    path.write_text(f'[federation]\nsites = ["site1", "site2"]\naddress = "{REMOTE}"\nwork_dir = "coord"\n'
                    '[training]\ntask = "fundus"\nmethod = "fedavg"\nrounds = 1\nimage_size = 32\n')
    cfg = fedconfig.load_federation_config(path)
    with EventWriter("server", path=tmp_path / "events.jsonl") as events, pytest.raises(ConfigError) as err:
        run_server(cfg, events=events, insecure=True)
    assert "--insecure is for loopback demonstrations only" in str(err.value) and REMOTE in str(err.value)
    assert not (tmp_path / "coord" / "superlink.log").exists()  # no SuperLink was started


# --- 3./4. Flower's environment and dependency installation --------------------------


def test_flower_settings_are_set_for_this_process_and_every_child(tmp_path, monkeypatch):
    from engine.federation.flower.processes import child_environment

    assert FLOWER_ENV == {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                          "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    import os

    for key, value in FLOWER_ENV.items():
        assert os.environ[key] == value  # set on import, before Flower reads them in this process
    # variables a user (or an attacker with a foot in the environment) might have set
    monkeypatch.setenv("FLWR_INTERNAL_GRPC_CONTROL_API", "1")  # would open a gRPC Control API
    monkeypatch.setenv("FLWR_INTERNAL_GRPC_FLEET_API", "1")  # would open a gRPC Fleet API beside the front
    monkeypatch.setenv("FLWR_DATABASE", str(tmp_path / "elsewhere.db"))
    monkeypatch.setenv("FLWR_SUPERGRID_ADDRESS", "evil.example.org")
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "1")
    monkeypatch.setenv("flwr_tracing_enabled", "1")
    monkeypatch.setenv("FLWR_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("FEDSM_UNRELATED", "kept")
    code = "import json, os; print(json.dumps(dict(os.environ)), flush=True)"
    lines: list[str] = []
    child = ChildProcess("env", [sys.executable, "-c", code], tmp_path / "env.log", on_line=lines.append,
                         env={"FLWR_HOME": str(tmp_path / "home")})
    child.start()
    assert child.proc is not None and child.proc.wait(timeout=60) == 0
    child.stop()
    seen = json.loads(lines[0])
    flower = {k: v for k, v in seen.items() if k.upper().startswith("FLWR_")}
    assert flower == {**FLOWER_ENV, "FLWR_HOME": str(tmp_path / "home"), "FLWR_LOG_LEVEL": "DEBUG"}
    assert seen["FEDSM_UNRELATED"] == "kept"
    assert child_environment(base={"FLWR_INTERNAL_GRPC_FLEET_API": "1", "PATH": "/bin"}) == {"PATH": "/bin",
                                                                                          **FLOWER_ENV}


def test_superlink_and_supernode_never_install_app_dependencies(tmp_path, monkeypatch):
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    from engine.federation.flower.server import _superlink_args
    from engine.federation.flower.site import SuperNodeSupervisor

    # even if the environment variable were lost, the SuperLink's flag alone turns installation off
    monkeypatch.delenv("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", raising=False)
    fed = tmp_path / "federation.toml"
    fed.write_text('[federation]\nsites = ["site1"]\n[training]\ntask = "fundus"\nmethod = "fedavg"\n')
    cfg = fedconfig.load_federation_config(fed)
    for insecure in (False, True):
        args = _superlink_args(cfg, 9999, insecure)
        assert "--disable-runtime-dependency-installation" in args
        assert "--allow-runtime-dependency-installation" not in args
        assert _parse_args_run_superlink().parse_args(args).runtime_dependency_install is False
    # Flower's SuperNode (1.41, 1.42) has no "disable" flag: installation is off unless "--allow-..." is given
    site = fedconfig.load_site_config(write_site_toml(tmp_path, "127.0.0.1:9092"), check_files=False)
    for insecure in (False, True):
        argv = SuperNodeSupervisor(site, insecure, 9998, None, tmp_path / "sn.log").argv()  # type: ignore[arg-type]
        flower_args = argv[argv.index("--") + 1:]
        assert argv[1:3] == ["-m", "engine.federation.flower.launch"]
        assert "--allow-runtime-dependency-installation" not in flower_args
        assert _parse_args_run_supernode().parse_args(flower_args).runtime_dependency_install is False
        assert "--approved-apps" in argv  # the SuperNode checks apps before pulling (below)


# --- 6. approval before the payload ----------------------------------------------------

APPROVED_FAB = b"the FedSM app"
OTHER_FAB = b"somebody else's app"


def _header_message():
    from flwr.app import Message, Metadata, RecordDict

    return Message(metadata=Metadata(run_id=7, message_id="ab" * 32, src_node_id=1, dst_node_id=5,
                                     reply_to_message_id="", group_id="2", created_at=time.time(), ttl=600,
                                     message_type="train"), content=RecordDict())


def _fake_supernode_module(calls: list[str]) -> SimpleNamespace:
    def pull_and_store(*, state, object_store, receive, get_run, get_fab, pull_object, **rest):
        message, _tree = receive()
        run = get_run(message.metadata.run_id)
        get_fab(run.fab_hash, message.metadata.run_id)
        pull_object(message.metadata.run_id, "chunk")  # Flower pulls the payload here
        return message.metadata.run_id

    def insert(reply, state, store):
        calls.append(f"reply:{reply.error.code}:{reply.error.reason}")

    return SimpleNamespace(_pull_and_store_message=pull_and_store, _insert_message=insert)


def _run_guarded(fab: bytes) -> tuple[list[str], list[str]]:
    from flwr.supercore.fab import Fab

    from engine.federation.flower.launch import guard_apps

    calls: list[str] = []
    said: list[str] = []
    module = _fake_supernode_module(calls)
    guard_apps(module, [app_hash(APPROVED_FAB)], "site1", report=said.append)
    message = _header_message()
    result = module._pull_and_store_message(
        state=SimpleNamespace(get_run=lambda run_id: None), object_store=None,
        receive=lambda: (message, "tree"),
        get_run=lambda run_id: calls.append("get_run") or SimpleNamespace(fab_hash="h"),
        get_fab=lambda fab_hash, run_id: calls.append("get_fab") or Fab("h", fab, {}),
        pull_object=lambda run_id, object_id: calls.append("pull_object"), node_config={},
        confirm_message_received=None, trusted_entities=None)
    assert result == 7
    return calls, said


def test_supernode_refuses_an_unapproved_app_before_pulling_its_payload():
    from flwr.common.constant import ErrorCode

    calls, said = _run_guarded(OTHER_FAB)
    assert "pull_object" not in calls  # not one byte of the weights was fetched
    assert calls[:2] == ["get_run", "get_fab"] and len(calls) == 3
    assert calls[2].startswith(f"reply:{ErrorCode.INVALID_FAB}:site site1 refused app {app_hash(OTHER_FAB)}")
    assert said and said[0].startswith("FEDSM-REFUSED-APP site site1 refused app")
    # an approved app goes on to Flower's own code, with the run and FAB fetched only once
    calls, said = _run_guarded(APPROVED_FAB)
    assert calls == ["get_run", "get_fab", "pull_object"] and said == []


class _FakeRuntime:
    """The site's SuperNode Runtime API, as the ClientApp executor sees it."""

    def __init__(self, fab: bytes) -> None:
        from flwr.app import Context, RecordDict
        from flwr.common.serde import context_to_proto, fab_to_proto, message_to_proto, run_to_proto
        from flwr.proto.message_pb2 import ObjectTree
        from flwr.proto.runtime_pb2 import PullAppMessagesResponse, PullTaskInputResponse
        from flwr.supercore.fab import Fab
        from flwr.supercore.run import Run

        self.calls: list[str] = []
        self.pushed: list = []
        run = Run.create_empty(7)
        self.task = PullTaskInputResponse(
            task_id=3, run=run_to_proto(run), fab=fab_to_proto(Fab(app_hash(fab)[7:], fab, {})),
            context=context_to_proto(Context(run_id=7, node_id=5, node_config={}, state=RecordDict(),
                                             run_config={})))
        self.messages = PullAppMessagesResponse(messages_list=[message_to_proto(_header_message())],
                                                message_object_trees=[ObjectTree(object_id="ab" * 32)])

    def PullTaskInput(self, req):  # Flower's method names
        self.calls.append("PullTaskInput")
        return self.task

    def PullMessages(self, req):
        self.calls.append("PullMessages")
        return self.messages

    def PullObject(self, req):
        self.calls.append("PullObject")
        raise AssertionError("the payload of an unapproved app was pulled")

    def ConfirmMessageReceived(self, req):
        from flwr.proto.message_pb2 import ConfirmMessageReceivedResponse

        self.calls.append("ConfirmMessageReceived")
        return ConfirmMessageReceivedResponse()

    def PushMessages(self, req):
        from flwr.proto.runtime_pb2 import PushAppMessagesResponse

        self.calls.append("PushMessages")
        self.pushed += list(req.messages_list)
        return PushAppMessagesResponse(objects_to_push=[], session_id="s")

    def PushObject(self, req):
        self.calls.append("PushObject")

    def PushTaskOutput(self, req):
        self.calls.append(f"PushTaskOutput:{req.sub_status}")

    def SendTaskHeartbeat(self, req):
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse

        return SendTaskHeartbeatResponse(success=True)

    def close(self) -> None:
        self.calls.append("close")


def test_client_app_executor_checks_the_app_before_pulling_the_payload(tmp_path):
    from engine.federation.flower.site import TaskExecutor

    cfg = fedconfig.load_site_config(write_site_toml(tmp_path, "127.0.0.1:9092"), check_files=False)
    cfg = fedconfig.SiteConfig(**{**cfg.__dict__, "approved_apps": (app_hash(APPROVED_FAB),)})
    runtime = _FakeRuntime(OTHER_FAB)
    app_calls: list[object] = []
    with EventWriter("site", "site1", tmp_path / "events.jsonl") as events:
        executor = TaskExecutor(cfg, "127.0.0.1:1", lambda **kw: app_calls.append(kw),
                                SimpleNamespace(cancel=None, after_reply=None), events)
        executor._client = lambda token=None: runtime  # type: ignore[method-assign]
        executor.run_task("token")
    assert "PullObject" not in runtime.calls and app_calls == []
    assert runtime.calls[:3] == ["PullTaskInput", "PullMessages", "ConfirmMessageReceived"]
    assert "PushMessages" in runtime.calls and runtime.calls[-2:] == ["PushTaskOutput:completed", "close"]
    [reply] = runtime.pushed
    assert reply.HasField("error") and "site1 refused app" in reply.error.reason
    assert reply.metadata.reply_to_message_id == "ab" * 32
    errors = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "error"]
    assert errors and f"refused app {app_hash(OTHER_FAB)}" in errors[0]["message"]


def _supervising(script: str, tmp_path, monkeypatch, coordinator_port: int, runtime_port: int):
    """A site's SuperNode supervisor whose "SuperNode" is ``python -c script``, and the events it emits."""
    from engine.federation.flower import site as site_module

    monkeypatch.setattr(site_module.SuperNodeSupervisor, "argv", lambda self: [sys.executable, "-c", script])
    site = fedconfig.load_site_config(write_site_toml(tmp_path, f"127.0.0.1:{coordinator_port}"), check_files=False)
    events: list[dict] = []
    writer = EventWriter("site", site.name, listener=events.append)
    return site_module.SuperNodeSupervisor(site, False, runtime_port, writer, tmp_path / "sn.log"), events


def test_a_supernode_stuck_in_its_own_exit_is_stopped_and_replaced(tmp_path, monkeypatch):
    # Flower's SuperNode exits by sending itself SIGINT; when two of its threads give up at once the second
    # signal interrupts the first one's exit and it hangs (seen after a coordinator restart). Prepare: a
    # stand-in SuperNode that prints that traceback's last line, then hangs, deaf to SIGINT as the real one
    from engine.federation.flower import site as site_module

    monkeypatch.setattr(site_module, "EXIT_GRACE_S", 1.0)
    stuck = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
             "print('KeyboardInterrupt', flush=True); time.sleep(600)")
    supervisor, events = _supervising(stuck, tmp_path, monkeypatch, 9092, 9998)
    try:
        # Execute
        supervisor.start()
        first = supervisor.child
        deadline = time.monotonic() + 30
        while supervisor.child is first and time.monotonic() < deadline:
            time.sleep(0.1)
        # Assert: the stuck one was stopped (by PID, escalating past the SIGINT it ignores) and a new one started
        assert supervisor.child is not first, "the stuck SuperNode was never replaced"
        assert first is not None and not first.running()
        assert any(e["event"] == "disconnected" and e.get("reconnecting") for e in events)
    finally:
        supervisor.stop()


def test_a_supernode_that_finished_gracefully_is_replaced_within_seconds(tmp_path, monkeypatch):
    # After a coordinator restart Flower's SuperNode gives up, logs that it terminated gracefully, and its
    # process lingers (5 s measured) before the site can reconnect. Prepare: a stand-in that logs that line and
    # lingers; the ten-second grace for a stuck exit stays as it is
    from engine.federation.flower import site as site_module

    assert site_module.EXIT_GRACE_S >= 10 and site_module.GRACEFUL_EXIT_S <= 1
    lingering = "import time; print('INFO :      SuperNode terminated gracefully.', flush=True); time.sleep(600)"
    supervisor, events = _supervising(lingering, tmp_path, monkeypatch, 9093, 9997)
    try:
        # Execute
        started = time.monotonic()
        supervisor.start()
        first = supervisor.child
        while supervisor.child is first and time.monotonic() - started < 30:
            time.sleep(0.1)
        replaced_after = time.monotonic() - started
        # Assert: stopped after the short grace (+ the 2 s restart pause), not after EXIT_GRACE_S
        assert supervisor.child is not first and first is not None and not first.running()
        assert replaced_after < site_module.EXIT_GRACE_S, replaced_after
        assert any(e["event"] == "disconnected" and e.get("reconnecting") for e in events)
    finally:
        supervisor.stop()
