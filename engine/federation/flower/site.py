"""``fedsm site``: one site of a federation, headless.

The site process starts a Flower SuperNode as a child (TLS to the coordinator, the site's
private key for authentication, ``--isolation process``) and is itself the process that runs
the ClientApp: it takes each task from the SuperNode's Runtime API on the loopback interface,
checks the hash of the app bundle the task belongs to against ``approved_apps`` (refusing
anything else with an error reply), calls the installed engine's ClientApp, and pushes the
reply. No code from the network is imported or run, and the site's data stays loaded
between rounds.

If the SuperNode exits (coordinator restarted, network gone, node not yet released after a
crash), it is started again with growing pauses; ``disconnected`` and ``connected`` events
say so.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from engine.data.datalist import outside_paths_allowed
from engine.errors import CancelledError, ConfigError, FedSMError
from engine.federation.config import SiteConfig, check_site_files, is_loopback, parse_address
from engine.federation.events import EventWriter
from engine.federation.flower.launch import REFUSED_APP, REFUSED_SPEC
from engine.federation.flower.local_auth import ENV as SECRET_ENV
from engine.federation.flower.local_auth import new_secret
from engine.federation.flower.processes import ChildProcess, free_port, launcher_argv
from engine.federation.flower.run_confirmation import FOLDER, pending, record
from engine.federation.flower.runtime_api import (
    acquire_task,
    error_reply,
    finish_task,
    push_reply,
    runtime_client,
    start_heartbeat,
)
from engine.federation.flower.transfer import pull_task_header, pull_task_message, release_task_message
from engine.federation.preflight import CoordinatorWatch, check_port_free, check_site_certificates, check_site_datalist
from engine.io.masks import set_orientation_tolerance
from engine.security.approval import AppNotApproved, app_hash, check_app_approved
from engine.security.run_spec import (
    RUN_CONFIG_KEY,
    RunLedger,
    RunSpecRefused,
    SiteBounds,
    bounds_dict,
    describe,
    verify_envelope,
)
from engine.startup import collector_paused

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RESTART_PAUSES = (2.0, 4.0, 8.0, 15.0, 30.0)
#: Seconds a SuperNode that began to exit on its own may take before it is stopped. Flower's SuperNode
#: (1.41) exits by sending itself SIGINT when a request fails for good (e.g. 401 once a restarted
#: coordinator no longer knows the node); when two of its threads give up at once, the second SIGINT
#: interrupts the first one's exit and the process hangs with its threads alive (seen in the
#: killed-coordinator test: four minutes, until stopped). The site then stops it itself and reconnects.
EXIT_GRACE_S = 10.0
#: SuperNode log lines that mean it has begun to exit.
_EXITING = ("KeyboardInterrupt", "Exit Code:")
#: The line Flower's SuperNode logs when it has given up and finished (e.g. its retries against a
#: restarting coordinator ran out) ...
_TERMINATED = "SuperNode terminated gracefully"
#: ... after which it has nothing left to do, yet its process lingered 5.2 s before ending (measured in
#: the killed-coordinator test, flwr 1.42), and the site reconnects only once it has ended. So the
#: site stops it after this many seconds instead of :data:`EXIT_GRACE_S`.
GRACEFUL_EXIT_S = 1.0


def site_bounds(cfg: SiteConfig) -> Any:
    """The site's ``[bounds]``.

    Without ``allowed_methods`` every method is within bounds (``None``); split learning is still
    answered only with ``[site] share_activations = true`` (the consent, checked per exchange in
    :func:`engine.federation.flower.dialogue.answer_exchange`; docs/federation.md §10). An
    operator's own ``allowed_methods`` list is taken as written.
    """
    return SiteBounds.from_dict(cfg.bounds)


#: File in the site's work folder that ties each accepted run id to its Flower run (engine.security.run_spec).
LEDGER_FILE = "accepted-runs.json"


def run_ledger(cfg: SiteConfig) -> RunLedger:
    """The site's record of the runs it accepted (shared by its SuperNode and its task executor)."""
    return RunLedger(cfg.work_dir / LEDGER_FILE)


def run_policy(cfg: SiteConfig, insecure: bool, confirm: bool = False) -> dict[str, Any]:
    """What a run's signed settings are checked against: the federation CA (none when insecure), [bounds],
    the ledger of accepted runs, and with ``confirm`` the folder where the SuperNode asks for the operator's
    answer before it pulls a new run's payload (:mod:`engine.federation.flower.run_confirmation`)."""
    policy = {"ca_cert": None if insecure or cfg.ca_cert is None else str(cfg.ca_cert),
              "bounds": bounds_dict(site_bounds(cfg)), "ledger": str(run_ledger(cfg).path)}
    if confirm:
        policy["confirm_dir"] = str(confirmation_folder(cfg))
    return policy


def confirmation_folder(cfg: SiteConfig) -> Path:
    """Where the site's SuperNode and its process exchange the operator's answer to each new run."""
    return cfg.work_dir / FOLDER


def check_run_settings(cfg: SiteConfig, insecure: bool, run_config: Any, fab: bytes,
                       flower_run: int | None = None) -> dict[str, Any]:
    """The run's verified settings (:func:`engine.security.run_spec.verify_envelope`) from its run config.

    ``flower_run``: the Flower run the task belongs to; its run id is checked against (and, the
    first time, recorded in) the site's ledger, so the expiry is checked once per run.
    """
    return verify_envelope((run_config or {}).get(RUN_CONFIG_KEY),
                           ca_cert=None if insecure or cfg.ca_cert is None else cfg.ca_cert,
                           app_hash=app_hash(fab), bounds=site_bounds(cfg), flower_run=flower_run,
                           ledger=run_ledger(cfg))


class SuperNodeSupervisor:
    """Keep the site's SuperNode running and report its connection as events."""

    def __init__(self, cfg: SiteConfig, insecure: bool, runtime_port: int, events: EventWriter,
                 log_path: Path) -> None:
        self.cfg = cfg
        self.insecure = insecure
        self.runtime_port = runtime_port
        self.events = events
        self.log_path = log_path
        self.child: ChildProcess | None = None
        self._stop = threading.Event()
        self._connected = False
        self._last_error = ""
        #: monotonic time the current SuperNode began to exit on its own (``None``: it has not)
        self._exiting_since: float | None = None
        self._terminated = False  # it logged _TERMINATED: only its process is left to end
        self._thread: threading.Thread | None = None
        self._sent = threading.Condition()
        self.sent_count = 0
        #: the SuperNode's Runtime API answers only requests with this secret (local_auth)
        self.local_secret = new_secret()
        #: the operator answers each new run before the SuperNode pulls its payload (``--confirm-runs``)
        self.confirm_runs = False

    def argv(self) -> list[str]:
        args = ["--superlink", self.cfg.coordinator, "--isolation", "process", "--host", "127.0.0.1",
                "--port", str(self.runtime_port), "--node-config", f'site-name="{self.cfg.name}"']
        if self.insecure:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str(self.cfg.ca_cert), "--auth-supernode-private-key",
                     str(self.cfg.private_key)]
        return launcher_argv("supernode", args, poll_interval=self.cfg.poll_interval,
                             approved_apps=list(self.cfg.approved_apps), site=self.cfg.name,
                             run_policy=json.dumps(run_policy(self.cfg, self.insecure, self.confirm_runs)))

    def _on_line(self, line: str) -> None:
        text = _ANSI.sub("", line)
        if self._exiting_since is None and any(marker in text for marker in (*_EXITING, _TERMINATED)):
            self._exiting_since = time.monotonic()
        if _TERMINATED in text:
            self._terminated = True
        if text.startswith(REFUSED_APP):
            # the SuperNode refused a message of an app this site never approved (its payload was not pulled)
            self.events.error(text[len(REFUSED_APP):].strip())
        elif text.startswith(REFUSED_SPEC):
            # ... or of a run whose signed settings are unsigned, tampered with or beyond [bounds]
            self.events.error(text[len(REFUSED_SPEC):].strip())
        elif "Sent successfully" in text:
            with self._sent:
                self.sent_count += 1
                self._sent.notify_all()
        elif "SuperNode ID:" in text or "Connection successful after" in text:
            self._set_connected(True)
        elif "Connection attempt failed" in text:
            self._set_connected(False, "lost the connection to the coordinator; retrying")
        elif "Failed to activate SuperNode" in text and not self.insecure:
            self._last_error = (f"the coordinator refused this site's key: site {self.cfg.name} is not enrolled there "
                                "with the public key of [security] private_key; send NAME.pub.pem to the "
                                "coordinator for 'fedsm enroll' and compare the fingerprints")
        elif "ERROR" in text or "[code:" in text or "Failed" in text:
            self._last_error = text.split(":", 1)[-1].strip() or text

    def _set_connected(self, up: bool, reason: str = "") -> None:
        if up and not self._connected:
            self.events.emit("connected", coordinator=self.cfg.coordinator)
        elif not up and self._connected:
            self.events.emit("disconnected", reason=reason, reconnecting=not self._stop.is_set())
        self._connected = up

    def start(self) -> None:
        self._start_child()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="supernode-supervisor")
        self._thread.start()

    def _start_child(self) -> None:
        self._exiting_since = None
        self._terminated = False
        self.child = ChildProcess("SuperNode", self.argv(), self.log_path, on_line=self._on_line,
                                  env={"FLWR_HOME": str(self.cfg.work_dir / "flower-home"),
                                       SECRET_ENV: self.local_secret})
        self.child.start()

    def wait_forwarded(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until the SuperNode has forwarded more than ``count`` replies to the coordinator."""
        with self._sent:
            return self._sent.wait_for(lambda: self.sent_count > count, timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the SuperNode's Runtime API listens (not yet connected to the coordinator)."""
        assert self.child is not None
        self.child.wait_for_port("127.0.0.1", self.runtime_port, timeout)

    def _watch(self) -> None:
        failures = 0
        while not self._stop.is_set():
            child = self.child
            if child is not None and not child.running():
                if self._stop.is_set():
                    break
                reason = self._last_error or f"the SuperNode exited with status {child.returncode()}"
                if self._connected:
                    self._set_connected(False, reason)
                else:
                    self.events.emit("disconnected", reason=reason, reconnecting=True)
                pause = _RESTART_PAUSES[min(failures, len(_RESTART_PAUSES) - 1)]
                failures += 1
                self.events.status(f"reconnecting to {self.cfg.coordinator} in {pause:g} s")
                if self._stop.wait(pause):
                    break
                self._last_error = ""
                self._start_child()
            elif child is not None and self._exiting_since is not None \
                    and time.monotonic() - self._exiting_since > (GRACEFUL_EXIT_S if self._terminated
                                                                  else EXIT_GRACE_S):
                log.log(logging.INFO if self._terminated else logging.WARNING,
                        "the SuperNode began to exit %.1f s ago and is still running: stopping it",
                        time.monotonic() - self._exiting_since)
                child.stop(timeout=2.0)  # the loop above then reconnects with a new one
            elif self._connected:
                failures = 0
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.child is not None:
            self.child.stop()
        if self._connected:
            self._connected = False
            self.events.emit("disconnected", reason="the site stopped", reconnecting=False)


class TaskExecutor:
    """Run ClientApp tasks that the SuperNode queued: approval first, then the installed engine."""

    def __init__(self, cfg: SiteConfig, runtime_address: str, client_app: Any, worker: Any,
                 events: EventWriter, local_secret: str | None = None) -> None:
        self.cfg = cfg
        self.local_secret = local_secret
        #: no certificates: the run spec is not signed (its settings are still checked against [bounds])
        self.insecure = False
        #: ``confirm(settings) -> bool``: the operator accepts each new run before the site trains for it
        #: (``fedsm site --confirm-runs``; engine.security.run_review); ``None``: runs within [bounds] are accepted
        self.confirm: Callable[[dict[str, Any]], bool] | None = None
        self._announced: dict[str, bool] = {}
        self.address = runtime_address
        self.app = client_app
        self.worker = worker
        self.events = events

    def _client(self, token: str | None = None) -> Any:
        return runtime_client(self.address, "clientapp", self.local_secret, token)

    def _announce(self, settings: dict[str, Any]) -> bool:
        """Emit the run's settings once per run (``run_settings``: what the operator reviews); whether to train.

        With :attr:`confirm`, the event says so (``confirm: true``) and the operator's answer,
        asked once per run, decides.
        """
        key = settings["session"] + settings["spec_json"]
        if key not in self._announced:
            shown = describe(settings)
            self.events.emit("run_settings", settings=shown, bounds=bounds_dict(site_bounds(self.cfg)),
                             confirm=self.confirm is not None)
            accepted = True if self.confirm is None else bool(self.confirm(shown))
            self._announced[key] = accepted
            if self.confirm is not None:
                self.events.status(f"the operator {'accepted' if accepted else 'declined'} the run's settings")
        return self._announced[key]

    def answer_pending_runs(self) -> None:
        """Ask the operator about each new run the SuperNode is holding back, and give it the answer.

        The SuperNode asks before it pulls any of the run's payload (:func:`.launch.guard_apps`); the
        answer is recorded for the run, so the task's own check later reads the same answer without
        asking again.
        """
        if self.confirm is None:
            return
        folder = confirmation_folder(self.cfg)
        for flower_run, settings in pending(folder):
            record(folder, flower_run, self._announce(settings))

    def acquire(self, client: Any) -> str | None:
        """A task token if the SuperNode has a ClientApp task waiting."""
        try:
            return acquire_task(client, "clientapp")
        except httpx.TransportError:
            return None  # SuperNode (re)starting

    def run_task(self, token: str) -> None:
        """Take the task's header, check the app, only then pull the payload and answer; report the task's end.

        An app that is not approved is answered with an error from the task's header alone:
        its payload is never pulled from the SuperNode, let alone decoded.
        """
        from engine.federation.flower.client_app import shareable_reason  # torch: only once a task runs

        client = self._client(token)
        heartbeat = start_heartbeat(client)
        context = None
        completed, details = False, "ClientApp task failed"
        try:
            task = pull_task_header(client)
            context, message = task.context, task.message
            self.worker.after_reply = None
            try:
                check_app_approved(task.fab.content, self.cfg.approved_apps, self.cfg.name)
            except AppNotApproved as exc:
                release_task_message(client, task)
                self.events.error(str(exc))
                reply = error_reply(message, "app_not_approved", shareable_reason(exc, self.cfg.name))
            else:
                try:
                    # the run's signed settings, checked against [bounds] before the payload is pulled
                    settings = check_run_settings(self.cfg, self.insecure, context.run_config, task.fab.content,
                                                  int(context.run_id))
                    if not self._announce(settings):
                        raise RunSpecRefused(f"the operator of site {self.cfg.name} declined this run's settings")
                    self.worker.signed_spec = settings["spec_json"]
                    self.worker.signed_run = (settings["session"], settings["run_id"])
                except (RunSpecRefused, ConfigError) as exc:
                    release_task_message(client, task)
                    self.events.error(str(exc))
                    push_reply(client, error_reply(message, "refused", str(exc)), context)
                    completed, details = True, ""
                    return
                try:
                    message = pull_task_message(client, task, cancel=self.worker.cancel)
                    reply = self.app(message=message, context=context)
                except CancelledError:
                    raise
                except Exception as exc:  # any failure becomes an error reply, never a crash of the site
                    log.exception("task failed")
                    self.events.error(f"{type(exc).__name__}: {exc}")
                    reply = error_reply(message, "failed", shareable_reason(exc, self.cfg.name))
            push_reply(client, reply, context)
            completed, details = True, ""
        finally:
            finish_task(client, heartbeat, completed, details, context)
        if self.worker.after_reply is not None:
            later, self.worker.after_reply = self.worker.after_reply, None
            later.emit()


def check_insecure_allowed(cfg: SiteConfig, insecure: bool) -> None:
    """Refuse ``--insecure`` unless the coordinator is on this machine's loopback interface.

    Without TLS and site keys anyone on the path could read the weights, pose as the
    coordinator or as this site; that is acceptable for a demonstration on one machine only.
    """
    host, _ = parse_address(cfg.coordinator, str(cfg.path))
    if insecure and not is_loopback(host):
        raise ConfigError(f"--insecure is for loopback demonstrations only, but [site] coordinator in {cfg.path} is "
                          f"{cfg.coordinator}; drop --insecure and set [security] ca_cert and private_key (see "
                          "docs/federation.md), or use a coordinator on 127.0.0.1")


#: A ``--once`` site exits when its coordinator, once seen, refuses connections this long.
ONCE_GRACE_S = 30.0


def _preflight(cfg: SiteConfig, insecure: bool) -> None:
    """Datalist, certificates and the fixed runtime port checked before joining (engine.federation.preflight)."""
    with outside_paths_allowed(cfg.allow_outside):
        check_site_datalist(cfg.datalist, cfg.task, str(cfg.path))
    if not insecure:
        check_site_certificates(cfg.ca_cert, cfg.private_key, str(cfg.path))
    if cfg.runtime_port:
        check_port_free("127.0.0.1", cfg.runtime_port, "the site's loopback runtime port",
                        f"{cfg.path} [site] runtime_port")


def run_site(cfg: SiteConfig, *, insecure: bool = False, events: EventWriter, once: bool = False,
             validate: bool = True, stop: Callable[[], bool] | None = None,
             confirm: Callable[[dict[str, Any]], bool] | None = None) -> int:
    """Join the federation and serve rounds until stopped (or, with ``once``, until the run finishes).

    ``confirm(settings)``: asked once per new run, after its signed settings were verified and
    before any payload is pulled; ``False`` refuses the run (``fedsm site --confirm-runs``).
    Returns the process exit status (0 = stopped normally or run finished).
    """
    # one log line per HTTP request (hundreds per round) would drown the log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_insecure_allowed(cfg, insecure)
    check_site_files(cfg, secure=not insecure)

    set_orientation_tolerance(cfg.tolerate_orientation)  # process-wide: the ClientApp runs in this process
    _preflight(cfg, insecure)
    if not cfg.approved_apps:
        events.status("approved_apps in site.toml is empty: this site will refuse every app; add the hash the "
                      "coordinator announces (fedsm certs app-hash shows this installation's)")
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    # the ClientApp (torch, MONAI) loads only once the checks above passed: a refused start is quick
    with collector_paused():
        from engine.federation.flower.client_app import SiteWorker, build_client_app

    stopping = stop or (lambda: False)
    worker = SiteWorker(cfg, events, cancel=stopping, validate=validate)
    port = cfg.runtime_port or free_port()
    supervisor = SuperNodeSupervisor(cfg, insecure, port, events, cfg.work_dir / "supernode.log")
    supervisor.confirm_runs = confirm is not None
    executor = TaskExecutor(cfg, f"127.0.0.1:{port}", build_client_app(worker), worker, events,
                            local_secret=supervisor.local_secret)
    executor.insecure = insecure
    executor.confirm = confirm
    events.status(f"site {cfg.name} connecting to {cfg.coordinator}" + (" (INSECURE: no TLS, no site key)"
                                                                         if insecure else ""))
    watch = CoordinatorWatch(cfg.coordinator, str(cfg.path), grace=ONCE_GRACE_S) if once else None
    supervisor.start()
    try:
        supervisor.wait_ready()
        client = executor._client()
        try:
            while not stopping():
                executor.answer_pending_runs()  # new runs wait for the operator before any payload is pulled
                token = executor.acquire(client)
                if token is None:
                    if watch is not None and watch.gone():
                        events.status(f"the coordinator at {cfg.coordinator} has stopped accepting connections for "
                                      f"{watch.grace:g} s; its run is over or gone, so this --once site exits")
                        break
                    time.sleep(cfg.poll_interval)
                    continue
                forwarded = supervisor.sent_count
                try:
                    executor.run_task(token)
                except (CancelledError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # a broken task (e.g. SuperNode restarting) must not end the site
                    log.exception("task failed")
                    events.error(f"a task could not be completed: {type(exc).__name__}: {exc}")
                if once and worker.finished:
                    # the SuperNode still has to pass the last answer on before it is stopped
                    supervisor.wait_forwarded(forwarded)
                    break
        finally:
            client.close()
    except CancelledError:
        pass
    except FedSMError as exc:
        events.error(str(exc))
        raise
    finally:
        supervisor.stop()
    return 0
