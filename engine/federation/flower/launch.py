"""Run a Flower SuperLink or SuperNode as a child of a FedSM process.

Usage (by :mod:`engine.federation.flower.processes`, not by hand)::

    python -m engine.federation.flower.launch superlink --parent-pid PID -- <flower-superlink args>
    python -m engine.federation.flower.launch supernode --parent-pid PID --poll-interval S \
        --site NAME --approved-apps sha256:...,sha256:... -- <args>

Three things the plain ``flower-superlink`` / ``flower-supernode`` commands do not do:

- **Parent watchdog.** The child stops (SIGINT, so a SuperNode deactivates itself at the
  coordinator; forced exit after 10 s) as soon as its parent is gone, even if the parent was
  killed with SIGKILL. No Flower process outlives the FedSM process that started it.
- **Prompt polling (SuperNode).** Flower 1.41's SuperNode sleeps 3 s between checks for new
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
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from types import ModuleType
from typing import Any

import engine.federation.flower  # noqa: F401  (sets Flower's environment first)

_GRACE_S = 10.0
#: Start of the output line by which the SuperNode tells the site process that it refused an app.
REFUSED_APP = "FEDSM-REFUSED-APP"


def _watch_parent(parent_pid: int) -> None:
    # A killed parent re-parents this process at once (even while the parent is a zombie),
    # so a changed getppid() is a reliable "parent gone" signal.
    while True:
        time.sleep(0.2)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(_GRACE_S)
            os._exit(1)


class _CappedTime:
    """``time`` with ``sleep`` capped at ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self._cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self._cap))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _prompt_supernode(cap: float) -> None:
    import functools

    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import start_client_internal

    from engine.federation.flower.transfer import BACKOFF_CAP, INITIAL_BACKOFF

    module: ModuleType = start_client_internal
    module.time = _CappedTime(cap)  # type: ignore[attr-defined]
    # the SuperNode's pulls of a message's objects from the coordinator: same prompt back-off
    module.pull_objects = functools.partial(  # type: ignore[attr-defined]
        inflatable_utils.pull_objects, initial_backoff=INITIAL_BACKOFF, backoff_cap=BACKOFF_CAP,
        max_tries_per_object=None)


def guard_apps(module: Any, approved: list[str], site: str, report: Any = None) -> None:
    """Make ``module._pull_and_store_message`` (Flower's SuperNode loop) refuse unapproved apps before pulling.

    The wrapper takes the next message's header from the coordinator, and for a run the
    SuperNode does not know yet fetches the run and its FAB and checks the FAB's hash
    (:func:`engine.security.approval.check_app_approved`). Refused: an error reply is queued
    for the coordinator (Flower's own path for a FAB that fails verification) and nothing else
    happens. Approved: Flower's function continues with the same message, run and FAB.
    """
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode
    from flwr.supercore.run import RunNotRunningException

    from engine.security.approval import AppNotApproved, check_app_approved

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
                    reply = Message(Error(ErrorCode.INVALID_FAB, str(exc)), reply_to=message)
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="engine.federation.flower.launch")
    parser.add_argument("component", choices=["superlink", "supernode"])
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--poll-interval", type=float, default=None)
    parser.add_argument("--site", default="this site")
    parser.add_argument("--approved-apps", default=None,
                        help="comma-separated app hashes the SuperNode may serve (default: no check)")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    flower_args = argv[split + 1:]

    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True, name="parent-watchdog").start()
    if args.component == "superlink":
        from flwr.superlink.cli import flower_superlink as entry

        sys.argv = ["flower-superlink", *flower_args]
    else:
        from flwr.supernode.cli import flower_supernode as entry

        if args.poll_interval is not None:
            _prompt_supernode(args.poll_interval)
        if args.approved_apps is not None:
            from flwr.supernode import start_client_internal

            guard_apps(start_client_internal, [a for a in args.approved_apps.split(",") if a], args.site)
        sys.argv = ["flower-supernode", *flower_args]
    entry()


if __name__ == "__main__":
    main()
