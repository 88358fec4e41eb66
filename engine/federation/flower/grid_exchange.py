"""Send one message per site over a Flower ``Grid`` and collect the replies: the coordinator's one wait.

The training rounds (:mod:`.server_app`), the dialogue methods' exchanges (:mod:`.dialogue`) and the
final evaluation (:mod:`.final_evaluation`) all go through :func:`exchange`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from engine.errors import CancelledError

if TYPE_CHECKING:
    from flwr.app import Message
    from flwr.serverapp import Grid

#: Message types: a training round, and a question a site answers without training (evaluation, exchanges).
TRAIN = "train"
QUERY = "query"

#: Seconds between checks, while waiting for answers, whether the sites' nodes are still connected.
NODE_CHECK_INTERVAL = 1.0


def exchange(grid: Grid, messages: Mapping[str, Message], timeout: float, poll_interval: float,
             cancel: Callable[[], bool] | None = None,
             on_reply: Callable[[str, Message], None] | None = None) -> tuple[dict[str, Message], dict[str, str]]:
    """Send ``{key: message}`` and collect replies until all answered or ``timeout`` passed.

    ``on_reply(key, reply)`` is called as each reply arrives, so replies are processed while
    slower sites are still training. A site whose node disconnects while the coordinator waits
    (its process stopped or died) is given up at once instead of at the timeout.

    Returns
    -------
    replies, missing
        Replies by key, and a reason for every key without a reply.
    """
    if not messages:
        return {}, {}
    keys = list(messages)
    ids = list(grid.push_messages([messages[k] for k in keys]))
    pending: dict[str, str] = {}
    missing: dict[str, str] = {}
    for key, msg_id in zip(keys, ids, strict=True):
        if msg_id:
            pending[msg_id] = key
        else:
            missing[key] = "the coordinator could not queue its message"
    replies: dict[str, Message] = {}
    node_of = {msg_id: messages[key].metadata.dst_node_id for msg_id, key in pending.items()}
    deadline = time.monotonic() + timeout
    next_node_check = time.monotonic() + NODE_CHECK_INTERVAL
    while pending:
        for reply in grid.pull_messages(list(pending)):
            key = pending.pop(reply.metadata.reply_to_message_id, None)
            if key is not None:
                replies[key] = reply
                if on_reply is not None:
                    on_reply(key, reply)
        # replies the grid gave up (refused by the SuperLink's limits, or stalled): left out with the reason
        failed = getattr(grid, "failed_replies", None)
        for msg_id in [m for m in pending if failed and m in failed]:
            missing[pending.pop(msg_id)] = failed.pop(msg_id)
        if not pending:
            break
        if cancel is not None and cancel():
            raise CancelledError("the coordinator was stopped while waiting for sites")
        if time.monotonic() >= deadline:
            break
        if time.monotonic() >= next_node_check:
            next_node_check = time.monotonic() + NODE_CHECK_INTERVAL
            online = {n.node_id for n in grid.get_nodes() if n.status == "online"}
            for msg_id in [m for m in pending if node_of[m] not in online]:
                missing[pending.pop(msg_id)] = "disconnected while the coordinator waited for its answer"
            if not pending:
                break
        time.sleep(poll_interval)
    for key in pending.values():
        missing[key] = f"no answer within {timeout:g} s"
    return replies, missing
