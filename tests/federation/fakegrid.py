"""A Flower ``Grid`` without a network, for testing the ServerApp and the ClientApp together.

Every message is deflated to Flower's wire objects and inflated again (what really crosses the
network), handed to the site's real ClientApp (:func:`build_client_app` over a
:class:`SiteWorker` with real data), and its reply is kept for ``pull_messages``. Sites can be
silenced (they never answer) and replies tampered with, like Flower's own fake clients.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from flwr.app import Context, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

from engine.federation.config import SiteConfig
from engine.federation.events import EventWriter
from engine.federation.flower.client_app import SiteWorker, build_client_app


def over_the_wire(message: Message) -> Message:
    """``message`` after serialisation and deserialisation, as the receiver sees it."""
    message.metadata.__dict__["_message_id"] = message.object_id
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    copy = inflate_object_from_contents(message.object_id, contents)
    copy.metadata.__dict__["_message_id"] = message.object_id
    return copy


def site_config(name: str, datalist: Path, work_dir: Path, approved: tuple[str, ...] = ()) -> SiteConfig:
    return SiteConfig(path=work_dir / "site.toml", name=name, coordinator="127.0.0.1:1", datalist=datalist,
                      task="fundus", work_dir=work_dir, ca_cert=None, private_key=None, approved_apps=approved,
                      device="cpu")


class FakeGrid:
    """Sites by node id; ``silent`` nodes never answer, ``tamper(node, reply)`` may alter replies."""

    def __init__(self, workers: dict[int, SiteWorker], silent: set[int] | None = None,
                 tamper: Callable[[int, Message], Message] | None = None) -> None:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        self.workers = workers
        self.apps = {node: build_client_app(w) for node, w in workers.items()}
        self.silent = set(silent or ())
        self.offline: set[int] = set()
        self.dies_on_receipt: set[int] = set()  # nodes that go offline as soon as a message reaches them
        self.tamper = tamper
        self.replies: dict[str, Message] = {}
        self.sent: list[Message] = []

    def get_nodes(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(node_id=n, status="offline" if n in self.offline else "online")
                for n in reversed(list(self.apps))]  # not in site order: sites are found by name

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            received = over_the_wire(message)
            msg_id = received.metadata.message_id or uuid.uuid4().hex
            ids.append(msg_id)
            node = message.metadata.dst_node_id
            if node in self.dies_on_receipt:
                self.offline.add(node)
            if node in self.silent or node in self.offline:
                continue
            worker = self.workers[node]
            reply = self.apps[node](message=received, context=Context(1, node, {}, RecordDict(), {}))
            if worker.after_reply is not None:
                worker.after_reply.emit()
                worker.after_reply = None
            if self.tamper is not None:
                reply = self.tamper(node, reply)
            self.sent.append(reply)
            self.replies[msg_id] = over_the_wire(reply)
        return ids

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def workers_for(datalists: list[Path], root: Path, events: list[dict] | None = None,
                approved: tuple[str, ...] = ()) -> dict[int, SiteWorker]:
    """One worker per site; node ids deliberately not in site order."""
    out = {}
    for k, datalist in enumerate(datalists):
        name = f"site{k + 1}"
        writer = EventWriter("site", name, listener=events.append if events is not None else None)
        out[(k * 7 + 5) % 11 + 100] = SiteWorker(site_config(name, datalist, root / name, approved), writer,
                                                 validate=False)
    return out
