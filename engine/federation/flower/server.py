"""``fedsm server``: the coordinator, headless.

Starts a Flower SuperLink as a child process that serves its whole API on 127.0.0.1 (plain
HTTP: only this machine reaches it) and the Fleet API alone on the configured address (TLS
with the coordinator's certificate and SuperNode authentication, unless ``--insecure``;
:mod:`.fleet_listener`), registers every
configured site's enrolled public key, starts a run of the FedSM app bundle through the
Control API, and runs the ServerApp in this process (the SuperLink's ``process`` isolation:
no app code is loaded from the bundle, here or at the sites).

Work folder (``[federation] work_dir``)::

    checkpoint.safetensors   server state after the last completed round (--resume reads it)
    events.jsonl             progress events
    superlink.log            the SuperLink's output
    supermodel.safetensors   FedSM / FedSM-extra: the super model (after the last round)
    global.safetensors       FedAvg, FedProx, Scaffold: the global model
    server.safetensors       dialogue methods (BlackFed, FedIOD): the coordinator's state
    student.safetensors      FedIOD: the distilled student (single-model bundle; each site gets a copy)
    summary.json             rounds: who answered, who was left out and why, bytes, times
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from engine.bundle import BundleMetadata, SuperModelBundle, save_bundle
from engine.bundle.single import single_model_bundle
from engine.errors import ConfigError, FedSMError
from engine.federation.checkpoint import Checkpoint, load_latest_valid, round_files, save_weightset
from engine.federation.config import FederationConfig, is_loopback
from engine.federation.events import EventWriter
from engine.federation.flower.app_bundle import build_app_bundle
from engine.federation.flower.control import ControlClient
from engine.federation.flower.coordinator_grid import PromptHttpGrid
from engine.federation.flower.dialogue import DialogueRunner, dialogue_reply_limit
from engine.federation.flower.final_evaluation import bundle_val_dice
from engine.federation.flower.fleet_auth import write_keys
from engine.federation.flower.local_auth import ENV as SECRET_ENV
from engine.federation.flower.local_auth import new_secret
from engine.federation.flower.processes import ChildProcess, free_port, launcher_argv
from engine.federation.flower.runtime_api import (
    acquire_task,
    finish_task,
    runtime_client,
    start_heartbeat,
    take_task_input,
)
from engine.federation.flower.server_app import (
    FederationRunner,
    RegisteredSites,
    RoundSettings,
    SelfNamedSites,
    build_server_app,
)
from engine.federation.flower.upload_limits import RefusedReplies, reply_limit_for
from engine.federation.preflight import check_port_free, round_banner
from engine.federation.spec import MethodSpec, build_method
from engine.fl.exchange import ExchangeMethod
from engine.fl.registry import EXCHANGE_METHODS
from engine.fl.robust import RobustSettings
from engine.fl.routing_choice import CHOICE_PART, choice_summary
from engine.fl.style_gate import GATE_PART, bundle_site_routing, gate_metadata
from engine.inference.guard import site_validation_from_state
from engine.io.atomic import write_text_atomic
from engine.security.certs import check_server_certificate
from engine.security.enrollment import enrolled_keys
from engine.security.run_spec import RUN_CONFIG_KEY, make_envelope, new_run_id
from engine.tasks import get_task

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.safetensors"


def _prepare_resume(cfg: FederationConfig, resume: bool, app_hash: str, events: EventWriter
                    ) -> tuple[Checkpoint | None, str]:
    path = cfg.work_dir / CHECKPOINT

    if not resume:
        if path.exists():
            raise ConfigError(f"{path} holds an unfinished or finished run; continue it with 'fedsm server --config "
                              f"{cfg.path} --resume', or move the file away to start a new run")
        return None, uuid.uuid4().hex
    if not path.exists() and not round_files(path):
        raise ConfigError(f"--resume: no checkpoint at {path}; start without --resume")
    ckpt, problems = load_latest_valid(path)
    for problem in problems:  # a corrupt newer checkpoint: said loudly, then the one before it is used
        events.error(f"checkpoint skipped: {problem}")
    if problems:
        events.status(f"resuming from the checkpoint of round {ckpt.round}, the newest one that verifies")

    differ = MethodSpec.from_json(ckpt.spec_json).differences(cfg.spec)
    if differ:
        raise ConfigError(f"--resume: {cfg.path} differs from the checkpointed run in {', '.join(differ)}; restore "
                          "those settings to resume, or start a new run in another work_dir")
    if ckpt.app_hash != app_hash:
        events.status(f"the app changed since the checkpoint ({ckpt.app_hash} -> {app_hash}); sites must approve "
                      "the new hash")
    return ckpt, ckpt.session


def _security_inputs(cfg: FederationConfig, insecure: bool) -> dict[str, bytes]:
    """Check certificates and enrolments; return the sites' public keys (empty when insecure)."""
    if insecure:
        if not is_loopback(cfg.host):
            raise ConfigError(f"--insecure is for loopback demonstrations only, but [federation] address is "
                              f"{cfg.address}; use 127.0.0.1, or drop --insecure and set up certificates")
        return {}
    check_server_certificate(cfg.tls.ca_cert, cfg.tls.server_cert, cfg.tls.server_key, cfg.host)
    keys = enrolled_keys(cfg.enrolled_dir)
    missing = [s for s in cfg.sites if s not in keys]
    if missing:
        raise ConfigError(f"site(s) {', '.join(missing)} not enrolled; for each, run 'fedsm enroll --config "
                          f"{cfg.path} --site NAME --public-key NAME.pub.pem' with the key the site sent")
    return {s: keys[s] for s in cfg.sites}


def _check_ports(cfg: FederationConfig) -> None:
    """One clear line when the Fleet address or the fixed SuperLink port is taken (see engine.federation.preflight)."""
    check_port_free(cfg.host, cfg.port, "the coordinator's address", f"{cfg.path} [federation] address")
    if cfg.superlink_port:
        check_port_free("127.0.0.1", cfg.superlink_port, "the SuperLink's loopback port",
                        f"{cfg.path} [federation] superlink_port")


def _superlink_args(cfg: FederationConfig, port: int, insecure: bool) -> list[str]:
    args = ["--host", "127.0.0.1", "--port", str(port), "--isolation", "process",
            "--disable-runtime-dependency-installation"]
    if insecure:
        return [*args, "--insecure"]
    return [*args, "--ssl-ca-certfile", str(cfg.tls.ca_cert), "--ssl-certfile", str(cfg.tls.server_cert),
            "--ssl-keyfile", str(cfg.tls.server_key), "--enable-supernode-auth"]


def _acquire_server_task(address: str, timeout: float = 60.0, local_secret: str | None = None) -> str:
    """The ServerApp task's token from the SuperLink's loopback listener (plain HTTP)."""
    client = runtime_client(address, "serverapp", local_secret)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            token = acquire_task(client, "serverapp")
            if token is not None:
                return token
            time.sleep(0.1)
    finally:
        client.close()
    raise FedSMError(f"the SuperLink did not hand out the run's ServerApp task within {timeout:g} s")


def write_results(cfg: FederationConfig, method: Any, state: dict[str, Any], history: list[dict[str, Any]],
                  session: str, app_hash: str,
                  site_dice: dict[str, dict[str, dict[str, float]]] | None = None,
                  final_models: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write the trained models and ``summary.json``; return the summary.

    ``site_dice`` (``{site: {split: {model: Dice}}}``, the sites' final evaluation) fills the bundle's
    ``val_dice`` and ``extra["site_dice"]``. ``final_models`` (dialogue methods): per site, whether
    the end-of-run message with its final models was delivered, its bytes and parts (``summary.json``).
    """
    spec = cfg.spec
    files: dict[str, str] = {}
    if spec.method in ("fedsm", "fedsm-extra"):
        task = get_task(spec.task)
        gate = gate_metadata(state.get(GATE_PART, {}), list(spec.site_names)) if spec.method == "fedsm" else {}
        meta = BundleMetadata(
            task=task.name, label_names=list(task.label_names), in_channels=task.in_channels,
            image_size=spec.image_size, selector_size=spec.selector_size, selector_head=spec.selector_head,
            selector_width=spec.selector_width,
            normalisation=task.normalisation, site_names=list(spec.site_names), method=spec.method,
            routing="argmax" if spec.method == "fedsm-extra" else "gamma", lam=float(spec.lam or 0.0),
            personalization=spec.personalization,
            gamma=float(method.routing_gamma(state)) if spec.method == "fedsm" else spec.fixed_gamma,
            rounds=method.total_rounds,
            val_dice=bundle_val_dice(spec.method, list(spec.site_names), site_dice),
            site_validation=site_validation_from_state(state, spec.site_names) if spec.method == "fedsm" else {},
            routing_guard=bool(spec.routing_guard) and spec.method == "fedsm",
            style_gate=gate, site_routing=bundle_site_routing(spec.site_routing, gate, state.get(CHOICE_PART)),
            extra={"seed": spec.seed, "session": session, "app_hash": app_hash, "trained_by": "fedsm server",
                   "site_dice": site_dice or {}, "fundus_crop": spec.fundus_crop,
                   **({"gamma_choice": {k: float(v[0]) for k, v in state["selector_gamma"].items()}}
                      if "selector_gamma" in state else {}),
                   **({"routing_choice": choice_summary(state[CHOICE_PART])} if CHOICE_PART in state else {})})
        bundle = SuperModelBundle(meta, state["global"], {s: state[f"personal/{s}"] for s in spec.site_names},
                                  state["selector"])
        save_bundle(cfg.work_dir / "supermodel.safetensors", bundle)
        files["supermodel"] = "supermodel.safetensors"
    elif spec.method in EXCHANGE_METHODS:
        # a dialogue method: the coordinator's own networks (BlackFed's server nets; sites keep their client
        # nets and assemble their bundles from the final message, dialogue.receive_final)
        save_weightset(cfg.work_dir / "server.safetensors", state,
                       {"format": "fedsm-server-state", "method": spec.method, "session": session})
        files["server"] = "server.safetensors"
        make_bundle = getattr(method, "bundle", None)
        if make_bundle is not None:  # FedIOD: the distilled student, a single-model bundle fedsm infer opens

            save_bundle(cfg.work_dir / "student.safetensors",
                        make_bundle(state, {"seed": spec.seed, "session": session, "app_hash": app_hash,
                                            "trained_by": "fedsm server"}))
            files["student"] = "student.safetensors"
    elif "global" in state:
        # a single-model bundle, so fedsm infer / evaluate and the desktop app open it like a super model

        bundle = single_model_bundle(spec.task, spec.method, state["global"], list(spec.site_names),
                                     spec.image_size, rounds=method.total_rounds,
                                     val_dice=bundle_val_dice(spec.method, list(spec.site_names), site_dice),
                                     extra={"seed": spec.seed, "session": session, "app_hash": app_hash,
                                            "trained_by": "fedsm server", "site_dice": site_dice or {},
                                            "fundus_crop": spec.fundus_crop})
        save_bundle(cfg.work_dir / "global.safetensors", bundle)
        files["global"] = "global.safetensors"
    summary = {"method": spec.method, "spec": json.loads(spec.to_json()), "session": session, "app_hash": app_hash,
               "rounds": history, "files": files, "site_dice": site_dice or {}}
    if final_models is not None:
        summary["final_models"] = final_models
    write_text_atomic(cfg.work_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def lost_superlink(exc: Exception, superlink: Any, cfg: Any, waited: float) -> FedSMError:
    """The coordinator's one-line error when its own SuperLink stopped answering mid-run."""
    if not superlink.running():
        cause = f"its SuperLink process ended (see {cfg.work_dir / 'superlink.log'})"
    else:
        cause = (f"its SuperLink did not answer for {waited:.0f} s ({type(exc).__name__}); the machine may be "
                 "overloaded")
    return FedSMError(f"the coordinator lost contact with its own SuperLink: {cause}. Completed rounds are saved in "
                      f"{cfg.work_dir / CHECKPOINT}; run the same 'fedsm server' command with --resume to continue")


def run_server(cfg: FederationConfig, *, events: EventWriter, insecure: bool = False, resume: bool = False,
               stop: Callable[[], bool] | None = None,
               record_fleet: Path | None = None) -> dict[str, Any]:
    """Run the coordinator until the last round is done; return the run's summary.

    Parameters
    ----------
    insecure
        No TLS and no site authentication; refused unless the address is loopback.
    resume
        Continue from ``checkpoint.safetensors`` in the work folder.
    stop
        Returns ``True`` when the coordinator should stop (checked while waiting).
    record_fleet
        Folder where every request sites send is written (tests, audits; see
        :func:`engine.federation.flower.fleet_listener.read_recorded`).
    """
    # one log line per HTTP request (hundreds per round) would drown the log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    keys = _security_inputs(cfg, insecure)
    _check_ports(cfg)
    app = build_app_bundle()
    checkpoint, session = _prepare_resume(cfg, resume, app.hash, events)
    method = build_method(cfg.spec)
    events.status(f"coordinator for {len(cfg.sites)} sites, {cfg.spec.method}, {round_banner(method)}; "
                  f"app {app.hash}")
    port = cfg.superlink_port or free_port(avoid={cfg.port})  # the Fleet port is not bound yet
    address = f"127.0.0.1:{port}"
    secret = new_secret()  # the SuperLink's loopback API answers only this process (local_auth)
    fleet_keys = write_keys(cfg.work_dir / "flower-home" / "fleet-keys.pem", keys.values())
    max_reply_mb = RobustSettings.from_dict(cfg.robust).max_reply_mb
    if max_reply_mb:
        max_reply = int(max_reply_mb * 2**20)
    elif isinstance(method, ExchangeMethod):
        max_reply = dialogue_reply_limit(method)
    else:
        max_reply = reply_limit_for(method, method.initial_state(), cfg.sites)
    refused_replies = RefusedReplies()  # what the SuperLink's per-reply limit refused (upload_limits)
    superlink = ChildProcess(
        "SuperLink", launcher_argv("superlink", _superlink_args(cfg, port, insecure), fleet_address=cfg.address,
                                   record_dir=None if record_fleet is None else str(record_fleet),
                                   max_reply_bytes=max_reply, fleet_keys=None if insecure else str(fleet_keys)),
        cfg.work_dir / "superlink.log", env={"FLWR_HOME": str(cfg.work_dir / "flower-home"), SECRET_ENV: secret},
        on_line=refused_replies.on_line)
    heartbeat = runtime = control = grid = None
    completed, details = False, "the coordinator stopped before the run ended"
    try:
        superlink.start()
        superlink.wait_for_port("127.0.0.1", port, timeout=120)
        superlink.wait_for_port({"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(cfg.host, cfg.host),
                                cfg.port, timeout=60)
        events.status(f"sites connect to {cfg.address}" + (" (INSECURE: no TLS, no site authentication)"
                                                           if insecure else ""))
        # the SuperLink's loopback listener is plain HTTP (fleet_listener): only this machine reaches it,
        # and only requests with this process's secret get through (local_auth)
        control = ControlClient(address, secret)
        directory = (SelfNamedSites(cfg.sites, cfg.poll_interval) if insecure
                     else RegisteredSites(control.register_sites(keys)))
        stale = control.stop_unfinished_runs()
        if stale:
            events.status(f"stopped {len(stale)} run(s) left by an earlier coordinator")
        # the run's settings, signed with the coordinator's key: sites check them before pulling any payload;
        # a fresh run id each start (resumes too), carried by every message and valid for one Flower run
        run_id = new_run_id()
        envelope = make_envelope(cfg.spec.to_json(), app.hash, session,
                                 None if insecure else cfg.tls.server_key, None if insecure else cfg.tls.server_cert,
                                 run_id=run_id, lifetime_s=cfg.spec_lifetime)
        control.start_run(app.content, {RUN_CONFIG_KEY: envelope})
        token = _acquire_server_task(address, local_secret=secret)
        runtime = runtime_client(address, "serverapp", secret, token)
        heartbeat = start_heartbeat(runtime)
        task_input = take_task_input(runtime)
        grid = PromptHttpGrid(address, True, None, token=token)
        grid.local_secret = secret
        grid.pull_timeout = min(cfg.round_timeout, 60.0)
        grid.cancel = stop
        grid.refused = refused_replies
        grid.superlink_alive = superlink.running
        grid.set_run(task_input.run)
        settings = RoundSettings(cfg.min_sites, cfg.round_timeout, cfg.start_timeout, cfg.round_attempts,
                                 cfg.poll_interval, cfg.rejoin_wait)
        runner_class = FederationRunner
        if isinstance(method, ExchangeMethod):
            runner_class = DialogueRunner
        runner = runner_class(method, cfg.spec, settings, directory, events, cfg.work_dir / CHECKPOINT, session,
                              app.hash, cancel=stop, address=cfg.address)
        runner.keep_checkpoints = cfg.keep_checkpoints
        runner.run_id = run_id
        runner.set_robust(cfg.robust)
        result: dict[str, Any] = {}
        try:
            build_server_app(runner, checkpoint, result)(grid, task_input.context)
        except httpx.TransportError as exc:
            raise lost_superlink(exc, superlink, cfg, grid.give_up_after) from None
        summary = write_results(cfg, method, result["state"], runner.history, session, app.hash,
                                result.get("site_dice"), getattr(runner, "final_delivery", None))
        completed, details = True, ""
        return summary
    finally:
        if grid is not None:
            grid.close()
        if runtime is not None:  # the SuperLink may already be gone: best effort
            finish_task(runtime, heartbeat, completed, details)
        if control is not None:
            control.close()
        superlink.stop()
