"""Run a Flower SuperLink or SuperNode as a child of a FedSM process.

Usage (by :mod:`engine.federation.flower.processes`, not by hand)::

    python -m engine.federation.flower.launch superlink --parent-pid PID -- <flower-superlink args>
    python -m engine.federation.flower.launch supernode --parent-pid PID --poll-interval S -- <args>

Two things the plain ``flower-superlink`` / ``flower-supernode`` commands do not do:

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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="engine.federation.flower.launch")
    parser.add_argument("component", choices=["superlink", "supernode"])
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--poll-interval", type=float, default=None)
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
        sys.argv = ["flower-supernode", *flower_args]
    entry()


if __name__ == "__main__":
    main()
