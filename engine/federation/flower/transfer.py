"""Prompt message transfers: Flower's object pulls without its 1-10 s back-off.

Flower 1.41 announces a message before all of its objects (the weight chunks) have arrived,
and a receiver that asks too early for an object backs off 1 s, 2 s, 4 s, ... up to 10 s.
With FedSM's ~50 MB payloads that back-off, not the transfer, dominated a round. Here the
same pulls retry after 20 ms, doubling up to 200 ms:

- :func:`pull_objects_promptly`: the pull loop itself, cancellable, giving up only when a
  transfer stalls;
- :func:`pull_task_input`: the site's ClientApp process takes its task's message from the
  local SuperNode (as Flower's ``run_clientapp.pull_task_input`` does, with the prompt pull);
- :class:`PromptHttpGrid`: the coordinator's ``Grid``, whose ``pull_messages`` collects
  replies the same way.

(The SuperNode's own pulls from the coordinator are shortened by
:mod:`engine.federation.flower.launch`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.superlink.grid import HttpGrid

from engine.errors import CancelledError

#: Seconds before retrying an object that has not arrived yet, doubling up to the cap.
INITIAL_BACKOFF = 0.02
BACKOFF_CAP = 0.2


class StalledTransfer(Exception):
    """No object of a message arrived for ``stall_timeout`` seconds (the sender died or hangs)."""


def pull_objects_promptly(object_ids: list[str], pull_object_fn: Callable[[str], bytes], *,
                          stall_timeout: float = 60.0, cancel: Callable[[], bool] | None = None) -> dict[str, bytes]:
    """Pull every object, retrying those not there yet after 20 ms (doubling up to 200 ms).

    Gives up (:class:`StalledTransfer`) only when nothing arrived for ``stall_timeout``
    seconds, so a big payload over a slow link is never cut off while it is still moving,
    and stops at once (:class:`CancelledError`) when ``cancel()`` says so.
    """
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    got: dict[str, bytes] = {}
    waiting = list(dict.fromkeys(object_ids))
    last_progress = time.monotonic()
    delay = INITIAL_BACKOFF
    while waiting:
        before = len(waiting)
        for object_id in list(waiting):
            try:
                got[object_id] = pull_object_fn(object_id)
                waiting.remove(object_id)
            except ObjectUnavailableError:
                continue
        now = time.monotonic()
        if len(waiting) < before:
            last_progress, delay = now, INITIAL_BACKOFF
            continue
        if cancel is not None and cancel():
            raise CancelledError("stopped while receiving a message")
        if now - last_progress > stall_timeout:
            raise StalledTransfer(f"{len(waiting)} of {len(object_ids)} parts of a message did not arrive within "
                                  f"{stall_timeout:g} s")
        time.sleep(delay)
        delay = min(2 * delay, BACKOFF_CAP)
    return got


def pull_task_input(client: Any, stall_timeout: float = 60.0,
                    cancel: Callable[[], bool] | None = None) -> tuple[Any, Any, Any, Any]:
    """``(message, context, run, fab)`` of the task ``client``'s token was issued for."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode handed out a task without a message")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    contents = pull_objects_promptly([t.object_id for t in iterate_object_tree(tree)],
                                     make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
                                     stall_timeout=stall_timeout, cancel=cancel)
    make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id)(tree.object_id)
    message = inflate_object_from_contents(tree.object_id, contents)
    if not isinstance(message, Message):
        raise TypeError(f"the task's input is a {type(message).__name__}, not a message")
    # a message's id is its object id, which its deflated form does not carry
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


class PromptHttpGrid(HttpGrid):
    """Flower's ``HttpGrid`` whose ``pull_messages`` retries missing objects promptly.

    A reply whose upload stalls for ``pull_timeout`` seconds (its site died while sending)
    is dropped; ``cancel`` stops a pull at once.
    """

    pull_timeout: float = 60.0
    cancel: Callable[[], bool] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Flower retries a failed request forever; a coordinator whose SuperLink died must
        # give up (and exit) instead of hanging in a retry loop
        self._retry_invoker.max_time = 60.0

    def close(self) -> None:
        self._retry_invoker.max_tries = 1
        super().close()

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        from flwr.app import Message
        from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
        from flwr.proto.runtime_pb2 import PullAppMessagesRequest
        from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
        from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
        from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, inflate_object_from_contents

        run_id = self.run.run_id
        client = self._runtime_client
        res = client.PullMessages(PullAppMessagesRequest(message_ids=list(message_ids)))
        out = []
        for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
            msg_id = proto.metadata.message_id
            try:
                contents = pull_objects_promptly([t.object_id for t in iterate_object_tree(tree)],
                                                 make_pull_object_fn_protobuf(client.PullObject, self.node, run_id),
                                                 stall_timeout=self.pull_timeout, cancel=self.cancel)
            except (ObjectPullError, StalledTransfer):
                # the reply is gone for good; the round treats the site as not answering
                continue
            client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=self.node, run_id=run_id,
                                                                        message_object_id=msg_id))
            message = inflate_object_from_contents(msg_id, contents)
            if isinstance(message, Message):
                message.metadata.__dict__["_message_id"] = msg_id
                out.append(message)
        return out
