"""Prompt message transfers: Flower's object pulls without its 1-10 s back-off, several at a time.

Flower (1.41, 1.42) announces a message before all of its objects (the weight chunks) have arrived,
and a receiver that asks too early for an object backs off 1 s, 2 s, 4 s, ... up to 10 s.
With FedSM's ~50 MB payloads that back-off, not the transfer, dominated a round. Here the
same pulls retry after 20 ms, doubling up to 100 ms, and up to :data:`PULL_WORKERS` objects
are pulled at once (one request each), so one object's round trip overlaps the next one's:

- :func:`pull_objects_promptly`: the pull loop itself, cancellable, giving up only when a
  transfer stalls;
- :func:`pull_task_header` / :func:`pull_task_message`: the site's ClientApp process takes
  its task from the local SuperNode in two steps, so that the app is checked (from the task's
  header: run, FAB, message metadata) before a byte of the payload is pulled or decoded
  (Flower's ``run_clientapp.pull_task_input`` does both at once);
- :class:`PromptHttpGrid`: the coordinator's ``Grid``, whose ``pull_messages`` collects
  replies the same way.

(The SuperNode's own pulls from the coordinator are shortened by
:mod:`engine.federation.flower.launch`.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flwr.app import Message
from flwr.common.serde import context_from_proto, fab_from_proto, message_from_proto, run_from_proto
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectPullError,
    ObjectUnavailableError,
    inflate_object_from_contents,
)
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.grid import HttpGrid

from engine.errors import CancelledError
from engine.federation.flower.local_auth import interceptors
from engine.federation.flower.upload_limits import REPLY_TO

log = logging.getLogger(__name__)

#: Seconds before retrying an object that has not arrived yet, doubling up to the cap.
INITIAL_BACKOFF = 0.02
BACKOFF_CAP = 0.1
#: Objects pulled at the same time (Flower's SuperNode pulls two at a time).
PULL_WORKERS = 4


class StalledTransfer(Exception):
    """No object of a message arrived for ``stall_timeout`` seconds (the sender died or hangs)."""


class AbandonedTransfer(Exception):
    """The receiver learnt that the message will never be complete (e.g. the SuperLink refused part of it)."""


def pull_objects_promptly(object_ids: list[str], pull_object_fn: Callable[[str], bytes], *,
                          stall_timeout: float = 60.0, cancel: Callable[[], bool] | None = None,
                          workers: int = PULL_WORKERS,
                          abandon: Callable[[], str | None] | None = None) -> dict[str, bytes]:
    """Pull every object, ``workers`` at a time, retrying those not there yet after 20 ms (up to 100 ms).

    Objects are asked for in the order given (the order in which a sender pushes them and a
    relay pulls them), a window of ``workers`` at a time: while a window arrives whole the
    next follows at once; when part of it is not there yet, the pull waits before asking
    again, so a receiver that is ahead of its sender does not flood the sender with requests.

    Gives up (:class:`StalledTransfer`) only when nothing arrived for ``stall_timeout``
    seconds, so a big payload over a slow link is never cut off while it is still moving,
    and stops at once (:class:`CancelledError`) when ``cancel()`` says so, or
    (:class:`AbandonedTransfer`) when ``abandon()`` returns a reason. Any other error of
    ``pull_object_fn`` is raised as it is.
    """
    def attempt(object_id: str) -> bytes | None:
        try:
            return pull_object_fn(object_id)
        except ObjectUnavailableError:
            return None

    got: dict[str, bytes] = {}
    waiting = list(dict.fromkeys(object_ids))
    last_progress = time.monotonic()
    delay = INITIAL_BACKOFF
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pull") if workers > 1 else None
    try:
        while waiting:
            window = waiting[:max(workers, 1)]
            contents = list(pool.map(attempt, window) if pool is not None and len(window) > 1 else map(attempt, window))
            arrived = {o: c for o, c in zip(window, contents, strict=True) if c is not None}
            got.update(arrived)
            waiting = [o for o in waiting if o not in arrived]
            now = time.monotonic()
            if arrived:
                last_progress, delay = now, INITIAL_BACKOFF
                if len(arrived) == len(window):
                    continue
            if cancel is not None and cancel():
                raise CancelledError("stopped while receiving a message")
            reason = abandon() if abandon is not None else None
            if reason:
                raise AbandonedTransfer(reason)
            if now - last_progress > stall_timeout:
                raise StalledTransfer(f"{len(waiting)} of {len(object_ids)} parts of a message did not arrive "
                                      f"within {stall_timeout:g} s")
            time.sleep(delay)
            delay = min(2 * delay, BACKOFF_CAP)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return got


@dataclass
class TaskHeader:
    """What the SuperNode says about a ClientApp task before its payload is pulled."""

    context: Any
    run: Any
    fab: Any
    message: Any  # the message's metadata, no content
    tree: Any  # the message's object tree (object ids only)


def pull_task_header(client: Any) -> TaskHeader:
    """The run, app bundle (FAB), context and message metadata of ``client``'s task: no payload yet."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode handed out a task without a message")
    tree = pulled.message_object_trees[0]
    header = message_from_proto(pulled.messages_list[0])
    # a message's id is its object id, which its deflated form does not carry
    header.metadata.__dict__["_message_id"] = tree.object_id
    return TaskHeader(context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab), header,
                      tree)


def pull_task_message(client: Any, task: TaskHeader, stall_timeout: float = 60.0,
                      cancel: Callable[[], bool] | None = None) -> Any:
    """Pull and inflate the task's message (its payload) from the SuperNode."""
    node = Node(node_id=task.context.node_id)
    tree = task.tree
    contents = pull_objects_promptly([t.object_id for t in iterate_object_tree(tree)],
                                     make_pull_object_fn_protobuf(client.PullObject, node, task.context.run_id),
                                     stall_timeout=stall_timeout, cancel=cancel)
    release_task_message(client, task)
    message = inflate_object_from_contents(tree.object_id, contents)
    if not isinstance(message, Message):
        raise TypeError(f"the task's input is a {type(message).__name__}, not a message")
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message


def release_task_message(client: Any, task: TaskHeader) -> None:
    """Tell the SuperNode the task's message was taken, so it drops its copy (pulled or not)."""
    make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, Node(node_id=task.context.node_id),
                                              task.context.run_id)(task.tree.object_id)


#: Default seconds a coordinator retries a request its SuperLink (still running) does not answer.
GIVE_UP_AFTER_S = 300.0


class PromptHttpGrid(HttpGrid):
    """Flower's ``HttpGrid`` whose ``pull_messages`` retries missing objects promptly.

    A reply whose upload stalls for ``pull_timeout`` seconds (its site died while sending)
    is dropped, and so is, at once, a reply the SuperLink refused (``refused``:
    :class:`.upload_limits.RefusedReplies`); either way the reason is kept in
    ``failed_replies`` under the id of the message it answers (read by the round loop,
    :func:`.grid_exchange.exchange`). ``cancel`` stops a pull at once.
    """

    pull_timeout: float = 60.0
    cancel: Callable[[], bool] | None = None
    #: replies the SuperLink refused (``None``: no such reports)
    refused: Any = None
    #: the SuperLink's loopback secret (:mod:`.local_auth`), added to every request
    local_secret: str | None = None

    #: ``False`` once the SuperLink process has died (set by the coordinator): retries stop at once
    superlink_alive: Callable[[], bool] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: {id of the message replied to: why its reply was given up}
        self.failed_replies: dict[str, str] = {}
        # Flower retries a failed request forever; a coordinator whose SuperLink died must give up
        # (and exit) instead of hanging in a retry loop. A SuperLink that is alive but slow (a
        # loaded machine: each request has Flower's fixed 30-s timeout) gets up to give_up_after.
        self.give_up_after = GIVE_UP_AFTER_S
        invoker = self._retry_invoker
        flower_giveup = invoker.should_giveup

        def should_giveup(exc: Exception) -> bool:
            if self.superlink_alive is not None and not self.superlink_alive():
                return True
            return bool(flower_giveup(exc)) if flower_giveup is not None else False

        invoker.should_giveup = should_giveup

    @property
    def give_up_after(self) -> float:
        """Seconds the grid keeps retrying a request its (living) SuperLink does not answer."""
        return float(self._retry_invoker.max_time)

    @give_up_after.setter
    def give_up_after(self, seconds: float) -> None:
        self._retry_invoker.max_time = float(seconds)

    def _connect(self) -> None:
        super()._connect()
        if self.local_secret and self._client is not None:
            # HttpGrid builds its client with a fixed list of interceptors; add the secret's
            self._client._interceptors = (*self._client._interceptors, *interceptors(self.local_secret))

    def close(self) -> None:
        self._retry_invoker.max_tries = 1
        super().close()

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        run_id = self.run.run_id
        client = self._runtime_client
        message_ids = list(message_ids)
        res = client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
        out = []
        refused = self.refused
        if refused is not None:  # replies refused whole (too many objects) are never announced
            returned = {proto.metadata.reply_to_message_id for proto in res.messages_list}
            for asked in message_ids:
                why = refused.reason(REPLY_TO + asked) if asked not in returned else None
                if why:
                    self.failed_replies[asked] = f"the coordinator refused its reply: {why}"
        for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
            msg_id = proto.metadata.message_id

            def abandon(root: str = tree.object_id) -> str | None:
                return refused.reason(root) if refused is not None else None

            try:
                if abandon():  # refused before the coordinator asked: not one object is pulled
                    raise AbandonedTransfer(abandon())
                contents = pull_objects_promptly([t.object_id for t in iterate_object_tree(tree)],
                                                 make_pull_object_fn_protobuf(client.PullObject, self.node, run_id),
                                                 stall_timeout=self.pull_timeout, cancel=self.cancel,
                                                 abandon=abandon)
            except (ObjectPullError, StalledTransfer, AbandonedTransfer) as exc:
                # the reply is gone for good; the round leaves the site out with the reason
                self.failed_replies[proto.metadata.reply_to_message_id] = (
                    f"the coordinator refused its reply: {exc}" if isinstance(exc, AbandonedTransfer)
                    else f"its reply did not arrive whole: {exc}")
                try:  # the SuperLink may drop what it holds of the reply
                    client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(
                        node=self.node, run_id=run_id, message_object_id=msg_id))
                except Exception as confirm_error:  # best effort
                    log.debug("could not release reply %s: %s", msg_id, confirm_error)
                continue
            client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=self.node, run_id=run_id,
                                                                        message_object_id=msg_id))
            message = inflate_object_from_contents(msg_id, contents)
            if isinstance(message, Message):
                message.metadata.__dict__["_message_id"] = msg_id
                out.append(message)
        return out
