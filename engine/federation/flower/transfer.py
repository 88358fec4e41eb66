"""Prompt message transfers: Flower's object pulls without its 1-10 s back-off.

Flower 1.41 announces a message before all of its objects (the weight chunks) have arrived,
and a receiver that asks too early for an object backs off 1 s, 2 s, 4 s, ... up to 10 s.
With FedSM's ~50 MB payloads that back-off, not the transfer, dominated a round. Here the
same pulls retry after 20 ms, doubling up to 200 ms:

- :func:`pull_task_input`: the site's ClientApp process takes its task's message from the
  local SuperNode (Flower's ``run_clientapp.pull_task_input`` with a short back-off);
- :class:`PromptHttpGrid`: the coordinator's ``Grid``, whose ``pull_messages`` collects
  replies the same way.

(The SuperNode's own pulls from the coordinator are shortened by
:mod:`engine.federation.flower.launch`.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.superlink.grid import HttpGrid

#: Back-off (seconds) between tries for an object that has not arrived yet; no limit on tries,
#: only on the total time (slow links need many tries for the last chunk of a big payload).
PULL_BACKOFF = {"initial_backoff": 0.02, "backoff_cap": 0.2, "max_tries_per_object": None}


def pull_task_input(client: Any, max_time: float = 3600.0) -> tuple[Any, Any, Any, Any]:
    """``(message, context, run, fab)`` of the task ``client``'s token was issued for."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
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
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, max_time=max_time, **PULL_BACKOFF)
    # a message's id is its object id, which its deflated form does not carry
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


class PromptHttpGrid(HttpGrid):
    """Flower's ``HttpGrid`` whose ``pull_messages`` retries missing objects promptly.

    ``pull_timeout`` bounds the wait for the objects of one reply (a site that dies while
    uploading must not hold the round beyond its timeout).
    """

    pull_timeout: float = 600.0

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
        from flwr.supercore.inflatable.inflatable_utils import (
            ObjectPullError,
            inflate_object_from_contents,
            pull_objects,
        )

        run_id = self.run.run_id
        client = self._runtime_client
        res = client.PullMessages(PullAppMessagesRequest(message_ids=list(message_ids)))
        out = []
        for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
            msg_id = proto.metadata.message_id
            try:
                contents = pull_objects([t.object_id for t in iterate_object_tree(tree)],
                                        make_pull_object_fn_protobuf(client.PullObject, self.node, run_id),
                                        max_time=self.pull_timeout, **PULL_BACKOFF)
            except ObjectPullError:
                # the reply is gone for good; the round treats the site as not answering
                continue
            client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=self.node, run_id=run_id,
                                                                        message_object_id=msg_id))
            message = inflate_object_from_contents(msg_id, contents)
            if isinstance(message, Message):
                message.metadata.__dict__["_message_id"] = msg_id
                out.append(message)
        return out
