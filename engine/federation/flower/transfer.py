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
- the coordinator's ``Grid`` collects replies the same way
  (:class:`engine.federation.flower.coordinator_grid.PromptHttpGrid`, kept apart so that a site
  process never imports the SuperLink's grid and its storage layers).

(The SuperNode's own pulls from the coordinator are shortened by
:mod:`engine.federation.flower.launch`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from flwr.app import Message
from flwr.common.serde import message_from_proto
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import PullAppMessagesRequest
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import (
    ObjectUnavailableError,
    inflate_object_from_contents,
)

from engine.errors import CancelledError
from engine.federation.flower.object_tree import object_ids
from engine.federation.flower.runtime_api import take_task_input

#: Seconds before retrying an object that has not arrived yet, doubling up to the cap.
INITIAL_BACKOFF = 0.02
BACKOFF_CAP = 0.1
#: Objects pulled at the same time (Flower's SuperNode pulls two at a time).
PULL_WORKERS = 4


class StalledTransfer(Exception):
    """No object of a message arrived for ``stall_timeout`` seconds (the sender died or hangs)."""


class NotAMessage(TypeError):
    """A message's objects arrived whole but do not decode to a Flower message (a malformed sender)."""


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
    task = take_task_input(client)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode handed out a task without a message")
    tree = pulled.message_object_trees[0]
    header = message_from_proto(pulled.messages_list[0])
    # a message's id is its object id, which its deflated form does not carry
    header.metadata.__dict__["_message_id"] = tree.object_id
    return TaskHeader(task.context, task.run, task.fab, header, tree)


def pull_message(pull_object: Callable[..., Any], node: Any, run_id: int, tree: Any, *, stall_timeout: float = 60.0,
                 cancel: Callable[[], bool] | None = None, abandon: Callable[[], str | None] | None = None,
                 on_pulled: Callable[[], None] | None = None) -> Message:
    """Pull every object of the message whose object tree is ``tree`` and inflate it.

    ``pull_object`` is a Runtime API client's ``PullObject`` call, ``node`` the caller's Flower
    node (a ``Node`` message); ``on_pulled`` runs once every object is here, before decoding
    (to release the sender's copy). Raises :class:`StalledTransfer`, :class:`AbandonedTransfer`
    or :class:`engine.errors.CancelledError` as :func:`pull_objects_promptly` does, and
    :class:`NotAMessage` when the objects decode to something else.
    """
    contents = pull_objects_promptly(object_ids(tree),
                                     make_pull_object_fn_protobuf(pull_object, node, run_id),
                                     stall_timeout=stall_timeout, cancel=cancel, abandon=abandon)
    if on_pulled is not None:
        on_pulled()
    message = inflate_object_from_contents(tree.object_id, contents)
    if not isinstance(message, Message):
        raise NotAMessage(f"the message's root object is a {type(message).__name__}, not a message")
    # a message's id is its object id, which its deflated form does not carry
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message


def confirm_received(confirm: Callable[..., Any], node: Any, run_id: int, message_id: str) -> None:
    """Tell the sender's side the message was taken (``confirm``: a client's ``ConfirmMessageReceived``)."""
    make_confirm_message_received_fn_protobuf(confirm, node, run_id)(message_id)


def pull_task_message(client: Any, task: TaskHeader, stall_timeout: float = 60.0,
                      cancel: Callable[[], bool] | None = None) -> Any:
    """Pull and inflate the task's message (its payload) from the SuperNode, then release the SuperNode's copy."""
    node = Node(node_id=task.context.node_id)
    return pull_message(client.PullObject, node, task.context.run_id, task.tree, stall_timeout=stall_timeout,
                        cancel=cancel, on_pulled=lambda: release_task_message(client, task))


def release_task_message(client: Any, task: TaskHeader) -> None:
    """Tell the SuperNode the task's message was taken, so it drops its copy (pulled or not)."""
    confirm_received(client.ConfirmMessageReceived, Node(node_id=task.context.node_id), task.context.run_id,
                     task.tree.object_id)
