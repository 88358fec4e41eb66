"""The coordinator's ``Grid``: Flower's ``HttpGrid`` that pulls replies promptly and gives up cleanly.

Apart from :mod:`engine.federation.flower.transfer` (the pull loop both sides share) because
``flwr.superlink.grid`` brings the SuperLink's state and storage layers (SQLAlchemy, Alembic),
which a site process never needs: importing them cost every ``fedsm site`` ~0.7 s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from flwr.proto.runtime_pb2 import PullAppMessagesRequest
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError
from flwr.superlink.grid import HttpGrid

from engine.federation.flower.local_auth import interceptors
from engine.federation.flower.transfer import (
    AbandonedTransfer,
    NotAMessage,
    StalledTransfer,
    confirm_received,
    pull_message,
)
from engine.federation.flower.upload_limits import REPLY_TO

log = logging.getLogger(__name__)

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

            def confirm(msg_id: str = msg_id) -> None:
                confirm_received(client.ConfirmMessageReceived, self.node, run_id, msg_id)

            try:
                if abandon():  # refused before the coordinator asked: not one object is pulled
                    raise AbandonedTransfer(abandon())
                message = pull_message(client.PullObject, self.node, run_id, tree, stall_timeout=self.pull_timeout,
                                       cancel=self.cancel, abandon=abandon, on_pulled=confirm)
            except (ObjectPullError, StalledTransfer, AbandonedTransfer, NotAMessage) as exc:
                # the reply is gone for good; the round leaves the site out with the reason
                self.failed_replies[proto.metadata.reply_to_message_id] = (
                    f"the coordinator refused its reply: {exc}" if isinstance(exc, AbandonedTransfer)
                    else f"its reply did not arrive whole: {exc}")
                try:  # the SuperLink may drop what it holds of the reply
                    confirm()
                except Exception as confirm_error:  # best effort
                    log.debug("could not release reply %s: %s", msg_id, confirm_error)
                continue
            out.append(message)
        return out
