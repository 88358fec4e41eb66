"""Run a Flower SuperLink or SuperNode as a child of a FedSM process.

Usage (by :mod:`engine.federation.flower.processes`, not by hand)::

    python -m engine.federation.flower.launch superlink --parent-pid PID \
        --fleet-address HOST:PORT [--record-dir DIR] -- <flower-superlink args>
    python -m engine.federation.flower.launch supernode --parent-pid PID --poll-interval S \
        --site NAME --approved-apps sha256:...,sha256:... -- <args>

What the plain ``flower-superlink`` / ``flower-supernode`` commands do not do:

- **Parent watchdog.** The child stops (SIGINT, so a SuperNode deactivates itself at the
  coordinator; forced exit after 10 s) as soon as its parent is gone, even if the parent was
  killed with SIGKILL. No Flower process outlives the FedSM process that started it.
- **Prompt polling (SuperNode).** Flower's SuperNode (1.41, 1.42) sleeps 3 s between checks for new
  messages and 0.5 s while waiting for a reply, with no setting for either; that alone adds up
  to 3.5 s to every round. And it backs off 1 s, 2 s, ... 10 s when it asks for a weight chunk
  that the coordinator has not finished uploading. The launcher caps the message loop's sleeps
  at ``--poll-interval`` seconds and gives its object pulls the short back-off of
  :mod:`engine.federation.flower.transfer` (two module attributes of the SuperNode's message
  loop, ``time`` and ``pull_objects``, are replaced; nothing else).
- **App approval before the payload (SuperNode).** Flower's SuperNode fetches a new run's app
  bundle (FAB) and then pulls the message's weight chunks from the coordinator, whatever the
  app. With ``--approved-apps`` the launcher checks the FAB's SHA-256 against the site's
  ``approved_apps`` first: a message of any other app is answered with an error at once, its
  payload is never pulled, no task is created for the site's ClientApp, and one line
  ``FEDSM-REFUSED-APP <reason>`` on the output tells the site process (which reports it as an
  ``error`` event). The site's ClientApp executor checks the same hash again before it pulls a
  task's payload from the SuperNode.
- **Fleet API alone on the sites' address (SuperLink).** With ``--fleet-address`` the
  SuperLink serves its whole API on 127.0.0.1 (its ``--host``/``--port``, plain HTTP)
  and only ``POST /v1/fleet/*`` on the federation's address, with TLS
  (:mod:`engine.federation.flower.fleet_listener`).

Both components also get the allocator and garbage-collector settings of
:mod:`engine.federation.flower.memory`; their HTTP APIs read each request body whole before Flower's middleware sees it
(:mod:`engine.federation.flower.request_body`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import signal
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

import engine.federation.flower  # noqa: F401  (sets Flower's environment first)
from engine.errors import FedSMError
from engine.federation.flower.fleet_auth import HeaderAuth
from engine.federation.flower.fleet_listener import serve
from engine.federation.flower.local_auth import secret_from_environment
from engine.federation.flower.memory import freeze_startup_objects, keep_freed_memory
from engine.federation.flower.request_body import wrap_supernode_runtime_api
from engine.federation.flower.run_confirmation import DECLINED, ask
from engine.security.approval import AppNotApproved, app_hash, check_app_approved
from engine.security.run_spec import RUN_CONFIG_KEY, RunLedger, SiteBounds, verify_envelope
from engine.startup import collector_paused

_GRACE_S = 10.0
#: Start of the output line by which the SuperNode tells the site process that it refused an app.
REFUSED_APP = "FEDSM-REFUSED-APP"
#: The same for a run whose signed settings it refused (engine.security.run_spec).
REFUSED_SPEC = "FEDSM-REFUSED-SPEC"


def _watch_parent(parent_pid: int) -> None:
    # A killed parent re-parents this process at once (even while the parent is a zombie),
    # so a changed getppid() is a reliable "parent gone" signal.
    while True:
        time.sleep(0.2)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(_GRACE_S)
            os._exit(1)


def start_parent_watchdog(parent_pid: int) -> None:
    """Interrupt this process (SIGINT, then exit after a grace period) once ``parent_pid`` is gone.

    SIGINT is given Python's default handler first: a process started from a background job of a
    non-interactive shell (``cmd &``, as CI runners and nohup scripts do) inherits SIGINT *ignored*,
    and the watchdog's interrupt (and the parent's polite stop) would otherwise be lost until the
    grace period ends. Flower installs its own handlers later; this covers the time before.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watchdog").start()


class _CappedTime:
    """``time`` with ``sleep`` capped at ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self._cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self._cap))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


#: The Flower versions FedSM is tested with (pyproject.toml pins the same range).
TESTED_FLOWER = "flwr>=1.41,<1.43"


def require_names(module: Any, *names: str) -> None:
    """Refuse to start when ``module`` lacks a name FedSM replaces (a Flower it was not tested with).

    Each replacement below is Flower-internal; assigning to a name Flower no longer has would
    add an attribute nobody reads and lose the property silently (approval before pull, prompt
    polling, the fleet-only listener), so a missing name stops the launch with one clear line.
    """
    missing = [name for name in names if getattr(module, name, None) is None]
    if missing:
        raise SystemExit(f"this Flower (flwr {version('flwr')}) has no {', '.join(missing)} in "
                         f"{getattr(module, '__name__', module)}, which FedSM replaces; FedSM is tested with "
                         f"{TESTED_FLOWER} (pip install '{TESTED_FLOWER}')")


def _prompt_supernode(cap: float) -> None:
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import start_client_internal

    from engine.federation.flower.transfer import BACKOFF_CAP, INITIAL_BACKOFF

    module: ModuleType = start_client_internal
    require_names(module, "time", "pull_objects")
    module.time = _CappedTime(cap)  # type: ignore[attr-defined]
    # the SuperNode's pulls of a message's objects from the coordinator: same prompt back-off
    module.pull_objects = functools.partial(  # type: ignore[attr-defined]
        inflatable_utils.pull_objects, initial_backoff=INITIAL_BACKOFF, backoff_cap=BACKOFF_CAP,
        max_tries_per_object=None)


def guard_apps(module: Any, approved: list[str], site: str, report: Any = None,
               policy: dict[str, Any] | None = None) -> None:
    """Make ``module._pull_and_store_message`` (Flower's SuperNode loop) refuse unapproved apps before pulling.

    The wrapper takes the next message's header from the coordinator, and for a run the
    SuperNode does not know yet fetches the run and its FAB and checks the FAB's hash
    (:func:`engine.security.approval.check_app_approved`). Refused: an error reply is queued
    for the coordinator (Flower's own path for a FAB that fails verification) and nothing else
    happens. Approved: Flower's function continues with the same message, run and FAB.

    With ``policy`` (``{"ca_cert": path or None, "bounds": SiteBounds as a dict, "ledger": path}``)
    the run's signed settings are checked the same way, before any payload is pulled
    (:func:`engine.security.run_spec.verify_envelope`): signature, bounds, and, the first time
    the site sees the run, its expiry; the run id is then recorded with this Flower run in the
    site's ledger. A refusal prints ``FEDSM-REFUSED-SPEC <reason>``.
    """
    from flwr.supercore.run import RunNotRunningException

    from engine.federation.flower.runtime_api import error_reply

    require_names(module, "_pull_and_store_message", "_insert_message")
    original = module._pull_and_store_message
    say = report or (lambda text: print(text, flush=True))

    def guarded(*, state: Any, object_store: Any, receive: Any, get_run: Any, get_fab: Any, **rest: Any) -> Any:
        try:
            received = receive()
            if received is None:
                return None
            message, _tree = received
            run_id = message.metadata.run_id
            if state.get_run(run_id) is None:
                run_info = get_run(run_id)
                fab = get_fab(run_info.fab_hash, run_id)
                try:
                    check_app_approved(fab.content, approved, site)
                except AppNotApproved as exc:
                    say(f"{REFUSED_APP} {exc}")
                    reply = error_reply(message, "app_not_approved", str(exc))
                    module._insert_message(reply, state, object_store)
                    return run_id
                refusal, settings = _refuse_spec(policy, run_info, fab.content, run_id)
                if refusal is None and settings is not None and policy and policy.get("confirm_dir"):
                    # the operator's answer before a byte of the payload (engine.federation.flower.run_confirmation)
                    refusal = _operator_refusal(Path(policy["confirm_dir"]), run_id, settings, site,
                                                float(policy.get("confirm_timeout", CONFIRM_WAIT_S)))
                if refusal is not None:
                    say(f"{REFUSED_SPEC} {refusal}")
                    reply = error_reply(message, "refused", refusal)
                    module._insert_message(reply, state, object_store)
                    return run_id
                fetched_run, fetched_fab = run_info, fab
                get_run = lambda rid, _get=get_run: fetched_run if rid == run_id else _get(rid)  # noqa: E731
                get_fab = (lambda fab_hash, rid, _get=get_fab:  # noqa: E731
                           fetched_fab if rid == run_id else _get(fab_hash, rid))
        except RunNotRunningException:
            return None  # as Flower's loop: a message of a run that ended is ignored
        return original(state=state, object_store=object_store, receive=lambda: received, get_run=get_run,
                        get_fab=get_fab, **rest)

    module._pull_and_store_message = guarded


#: How long the SuperNode waits for the operator's answer to a new run before it answers the message
#: "not yet" (the question stays; the run's next message waits again).
CONFIRM_WAIT_S = 600.0


def _refuse_spec(policy: dict[str, Any] | None, run_info: Any, fab: bytes, flower_run: int | None = None
                 ) -> tuple[str | None, dict[str, Any] | None]:
    """Why the run's signed settings are refused under ``policy`` (``None``: accepted or no policy), and the
    verified settings when accepted."""
    if policy is None:
        return None, None

    try:
        settings = verify_envelope((getattr(run_info, "override_config", None) or {}).get(RUN_CONFIG_KEY),
                                   ca_cert=Path(policy["ca_cert"]) if policy.get("ca_cert") else None,
                                   app_hash=app_hash(fab), bounds=SiteBounds.from_dict(policy.get("bounds")),
                                   flower_run=flower_run,
                                   ledger=RunLedger(Path(policy["ledger"])) if policy.get("ledger") else None)
    except FedSMError as exc:  # RunSpecRefused, or unusable bounds: refused either way, never a crash
        return str(exc), None
    return None, settings


def _operator_refusal(folder: Path, flower_run: int, settings: dict[str, Any], site: str,
                      timeout: float) -> str | None:
    """``None`` when the site's operator accepted ``flower_run``; else why its message is refused unpulled."""
    answer = ask(folder, flower_run, settings, timeout)
    if answer:
        return None
    if answer is None:
        return f"the operator of site {site} has not answered yet whether to join this run"
    return f"{DECLINED}: the operator of site {site} declined this run's settings"


def _serve_fleet_separately(module: Any, fleet_address: str, record_dir: str | None,
                            max_reply_bytes: int | None = None, fleet_keys: str | None = None) -> None:
    """Make the SuperLink serve its API on its own port and the Fleet API alone on ``fleet_address``.

    Replaces ``_run_superlink_http_api`` of Flower's SuperLink command (which runs the one
    FastAPI application with uvicorn) by :func:`engine.federation.flower.fleet_listener.serve`.
    """
    from flwr.supercore.http_logging import get_uvicorn_log_config
    from flwr.superlink.main import create_app

    require_names(module, "_run_superlink_http_api", "SuperLinkLifespan", "console_handler")
    host, _, port = fleet_address.rpartition(":")

    def run_http_api(lifespan_config: Any) -> None:
        app = create_app(lifespan_config, module.SuperLinkLifespan)
        freeze_startup_objects()  # again, with the application built
        serve(app, local=(lifespan_config.host, lifespan_config.port), public=(host.strip("[]"), int(port)),
              ssl_certfile=lifespan_config.ssl_certfile, ssl_keyfile=lifespan_config.ssl_keyfile,
              log_config=get_uvicorn_log_config(module.console_handler.level),
              record_dir=None if record_dir is None else Path(record_dir), local_secret=secret_from_environment(),
              max_reply_bytes=max_reply_bytes,
              auth=None if fleet_keys is None else HeaderAuth.from_file(Path(fleet_keys)))

    module._run_superlink_http_api = run_http_api


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="engine.federation.flower.launch")
    parser.add_argument("component", choices=["superlink", "supernode"])
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--poll-interval", type=float, default=None)
    parser.add_argument("--site", default="this site")
    parser.add_argument("--approved-apps", default=None,
                        help="comma-separated app hashes the SuperNode may serve (default: no check)")
    parser.add_argument("--fleet-address", default=None,
                        help="SuperLink: HOST:PORT on which to serve the Fleet API alone (sites' address)")
    parser.add_argument("--record-dir", default=None, help="SuperLink: write every fleet request body there")
    parser.add_argument("--fleet-keys", default=None,
                        help="SuperLink: PEM file of the enrolled sites' keys; others get 401 before any body")
    parser.add_argument("--max-reply-bytes", type=int, default=None,
                        help="SuperLink: largest reply a site may upload (engine.federation.flower.upload_limits)")
    parser.add_argument("--run-policy", default=None,
                        help="SuperNode: JSON {ca_cert, bounds, ledger} against which each run's signed settings are "
                             "checked")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    flower_args = argv[split + 1:]

    keep_freed_memory()
    start_parent_watchdog(args.parent_pid)
    with collector_paused():  # importing Flower builds ~500k long-lived objects (engine.startup)
        if args.component == "superlink":
            # the command's module (the package re-exports its entry function under the same name)
            command = importlib.import_module("flwr.superlink.cli.flower_superlink")
            if args.fleet_address is not None:
                _serve_fleet_separately(command, args.fleet_address, args.record_dir, args.max_reply_bytes,
                                        args.fleet_keys)
            entry = command.flower_superlink
            sys.argv = ["flower-superlink", *flower_args]
        else:
            command = importlib.import_module("flwr.supernode.cli.flower_supernode")
            if args.poll_interval is not None:
                _prompt_supernode(args.poll_interval)
            if args.approved_apps is not None:
                from flwr.supernode import start_client_internal

                guard_apps(start_client_internal, [a for a in args.approved_apps.split(",") if a], args.site,
                           policy=None if args.run_policy is None else json.loads(args.run_policy))
            wrap_supernode_runtime_api()
            entry = command.flower_supernode
            sys.argv = ["flower-supernode", *flower_args]
    freeze_startup_objects()
    entry()


if __name__ == "__main__":
    main()
