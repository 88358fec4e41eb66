"""Loopback federations for end-to-end tests: configs, certificates, processes, events.

Every process a test starts is registered with :class:`Processes` and stopped by its PID in
the test's teardown (SIGTERM, then SIGKILL); Flower children stop with their parent (their
launcher watches it). Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warm_start import WarmStarter, cold_start_forced

from engine.federation.events import read_events
from engine.federation.flower.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


class Processes:
    """Child processes of a test, stopped by PID at the end.

    Python processes start from the worker's warm starter (:mod:`warm_start`: torch and MONAI already
    imported) unless ``cold`` or ``FEDSM_TESTS_COLD_START=1``.
    """

    def __init__(self, python_path: tuple[Path, ...] = (), cold: bool = False) -> None:
        """``python_path``: folders the children import from besides the checkout (e.g. an installed plugin)."""
        self.procs: list[Any] = []
        self.python_path = os.pathsep.join(str(p) for p in (ROOT, *python_path))
        self.cold = cold or cold_start_forced()

    def start(self, argv: list[str], log: Path, stdin: bytes | None = None, cold: bool = False) -> Any:
        """Start ``argv`` with its output in ``log``; ``stdin``: what its standard input holds (then its end);
        ``cold``: as a fresh interpreter.

        Returns a :class:`subprocess.Popen` or, started warm, a :class:`warm_start.WarmProcess` (the same
        ``pid``, ``poll``, ``wait`` and ``returncode``).
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": self.python_path}
        if not (self.cold or cold):
            warm = warm_starter().start(argv, log, ROOT, env, stdin)
            if warm is not None:
                self.procs.append(warm)
                return warm
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE)
        if stdin is not None:
            assert proc.stdin is not None
            proc.stdin.write(stdin)
            proc.stdin.close()
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL, as a crash would."""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


_STARTER: WarmStarter | None = None


def warm_starter() -> WarmStarter:
    """This pytest worker's warm starter (started on first use, stopped when the worker exits)."""
    global _STARTER
    if _STARTER is None:
        _STARTER = WarmStarter()
        atexit.register(_STARTER.close)
    return _STARTER


def fedsm(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli.main", *args]


def wait_for(path: Path, predicate: Callable[[dict[str, Any]], bool], timeout: float,
             alive: list[Any] = (), poll: float = 0.2) -> dict[str, Any]:
    """The first event in ``path`` that satisfies ``predicate``; fail after ``timeout`` or as soon as one of
    ``alive`` (processes, or a :class:`CoordinatorThread`) has ended without it.

    ``poll``: seconds between looks (short where a test must act while something is under way).
    """
    def matching() -> dict[str, Any] | None:
        if path.exists():
            for event in read_events(path):
                if predicate(event):
                    return event
        return None

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = matching()
        if event is not None:
            return event
        for proc in alive:
            if proc.poll() is not None:
                event = matching()  # written just before it ended
                if event is not None:
                    return event
                raise AssertionError(f"{proc.args} exited with {proc.returncode} while waiting for an event in {path}")
        time.sleep(poll)
    raise AssertionError(f"no matching event in {path} within {timeout} s; last events: "
                         f"{[e['event'] for e in read_events(path)][-10:] if path.exists() else 'none'}")


class LoopbackFederation:
    """Files of a federation under ``root``: federation.toml, one site.toml per site, keys, enrolments."""

    def __init__(self, root: Path, pki: Path, datalists: list[Path], sites: list[str], training: dict[str, Any],
                 federation: dict[str, Any] | None = None, approved: dict[str, str] | None = None) -> None:
        from engine.federation.flower.app_bundle import build_app_bundle
        from engine.security.enrollment import enroll_site

        self.root = root
        self.port = free_port(avoid={int((federation or {}).get("superlink_port", 0))})
        self.sites = sites
        root.mkdir(parents=True, exist_ok=True)
        fed = {"sites": sites, "address": f"127.0.0.1:{self.port}", "work_dir": "coord", "min_sites": len(sites),
               "round_timeout": 240, "start_timeout": 240, "poll_interval": 0.2, **(federation or {})}
        self.config = root / "federation.toml"
        self.config.write_text(_toml({"federation": fed, "training": training,
                                      "tls": {"ca_cert": str(pki / "ca.pem"), "server_cert": str(pki / "server.pem"),
                                              "server_key": str(pki / "server.key")}}))
        self.work = root / "coord"
        app = build_app_bundle().hash
        for k, site in enumerate(sites):
            enroll_site(self.work / "enrolled", site, pki / f"{site}.pub.pem")
            self.site_config(site).write_text(_toml({
                "site": {"name": site, "coordinator": f"127.0.0.1:{self.port}", "task": "fundus",
                         "datalist": str(datalists[k % len(datalists)]), "work_dir": f"work-{site}", "device": "cpu",
                         "threads": 1, "poll_interval": 0.2},
                "security": {"ca_cert": str(pki / "ca.pem"), "private_key": str(pki / f"{site}.key"),
                             "approved_apps": [(approved or {}).get(site, app)]}}))

    def site_config(self, site: str) -> Path:
        return self.root / f"{site}.toml"

    def site_events(self, site: str) -> Path:
        return self.root / f"work-{site}" / "events.jsonl"

    @property
    def server_events(self) -> Path:
        return self.work / "events.jsonl"

    def start_site(self, procs: Processes, site: str, *extra: str, stdin: bytes | None = None, cold: bool = False
                   ) -> Any:
        return procs.start(fedsm("site", "--config", str(self.site_config(site)), "--json", *extra),
                           self.root / f"{site}.out", stdin=stdin, cold=cold)

    def start_server(self, procs: Processes, resume: bool = False) -> Any:
        return procs.start(fedsm("server", "--config", str(self.config), *(["--resume"] if resume else [])),
                           self.root / "server.out")


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes (not zombies) whose command line contains ``text`` (Linux /proc)."""
    import pytest

    proc = Path("/proc")
    if not (proc / "self" / "cmdline").exists():
        pytest.skip("needs /proc to look for left-over processes")
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if text in argv and state != "Z":
            found.append(int(entry.name))
    return found


def max_abs_difference(a_path: Path, b_path: Path, global_only: bool = False) -> float:
    """Largest absolute difference between the global, selector and personalized weights of two super models.

    ``global_only``: compare the global models alone (single-model bundles: FedAvg, FedProx, Scaffold).
    """
    from engine.bundle import load_bundle

    a, b = load_bundle(a_path), load_bundle(b_path)
    assert a.metadata.site_names == b.metadata.site_names
    pairs = [(a.global_weights, b.global_weights)]
    if not global_only:
        pairs.append((a.selector_weights, b.selector_weights))
        pairs += [(a.personal_weights[s], b.personal_weights[s]) for s in a.metadata.site_names]
    worst = 0.0
    for x, y in pairs:
        assert set(x) == set(y)
        for key in x:
            worst = max(worst, float((x[key].double() - y[key].double()).abs().max()))
    return worst


def _toml(doc: dict[str, dict[str, Any]]) -> str:
    lines = []
    for table, values in doc.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


class CoordinatorThread:
    """``fedsm server``'s ``run_server`` for a :class:`LoopbackFederation`, in a thread of the test.

    The test can then read the run's summary (``outcome["summary"]``) or the exception it ended
    with (``outcome["error"]``); ``record_fleet`` keeps what the sites sent, as on the wire.
    """

    def __init__(self, fed: LoopbackFederation, record_fleet: Path | None = None) -> None:
        import threading

        from engine.federation.config import load_federation_config

        self.cfg = load_federation_config(fed.config)
        self.fed = fed
        self.record_fleet = record_fleet
        self.outcome: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="coordinator")

    def _serve(self) -> None:
        from engine.federation.events import EventWriter
        from engine.federation.flower.server import run_server

        try:
            with EventWriter("server", path=self.fed.server_events) as events:
                self.outcome["summary"] = run_server(self.cfg, events=events, stop=self._stop.is_set,
                                                     record_fleet=self.record_fleet)
        except BaseException as exc:  # reported by the test thread
            self.outcome["error"] = exc

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # as a process for wait_for: a coordinator that ended (e.g. its SuperLink could not start) ends the wait
    args = "the coordinator (run_server in a thread)"

    def poll(self) -> int | None:
        return None if self._thread.is_alive() or not self._thread.ident else 0

    @property
    def returncode(self) -> str:
        return f"outcome {self.outcome!r}"

    def stop(self, timeout: float = 60) -> None:
        """Ask the coordinator to stop and wait for it."""
        self._stop.set()
        self._thread.join(timeout=timeout)


def recorded_messages(requests: list[tuple[str, bytes]]) -> list[Any]:
    """Every message the sites sent, rebuilt from the recorded fleet requests (``flwr.app.Message``).

    ``requests`` are :func:`engine.federation.flower.fleet_listener.read_recorded`'s (path, body)
    pairs. Each message is inflated from the objects the sites pushed, exactly as on the wire.
    """
    from flwr.app import Message
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    objects: dict[str, bytes] = {}
    trees = []
    for path, body in requests:
        if path.endswith("/push-object"):
            req = PushObjectRequest.FromString(body)
            objects[req.object_id] = req.object_content
        elif path.endswith("/push-messages"):
            trees += list(PushMessagesRequest.FromString(body).message_object_trees)
    messages = []
    for tree in trees:
        message = inflate_object_from_contents(
            tree.object_id, {t.object_id: objects[t.object_id] for t in iterate_object_tree(tree)},
            keep_object_contents=True)
        assert isinstance(message, Message)
        messages.append(message)
    return messages


def dialogue_replies(requests: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """Every dialogue reply the sites sent, rebuilt from the recorded fleet requests, as its tensors.

    A message carrying anything but the dialogue's reply part fails the assertion here.
    """
    from engine.federation.flower import records
    from engine.federation.flower.dialogue import REPLY_PART

    replies = []
    for message in recorded_messages(requests):
        content = message.content
        assert set(content.array_records) <= {records.WEIGHTS_PREFIX + REPLY_PART}
        for key in content.array_records:
            replies.append(records.unpack(content.array_records[key],
                                          content.config_records[records.LAYOUT][REPLY_PART], "reply"))
    return replies
