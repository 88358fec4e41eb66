"""Bounds on what sites can make the SuperLink hold: bytes being received, and bytes per reply.

Flower (1.41, 1.42) bounds neither: its HTTP Fleet API reads any request body whole before it checks
the SuperNode's signature, and it stores every object a node pushes for a message, however
many and however large, until the ServerApp pulls them. The fleet listener
(:class:`.fleet_listener.FleetOnly`) therefore applies, before a request reaches Flower:

- **a per-request limit** (``max_body``, 8 MiB: Flower splits arrays into chunks of 5 MiB, its
  largest legitimate request), 413 above it, decided from ``Content-Length`` before the
  body is read;
- **an in-flight budget** (:class:`InflightBudget`, 64 MiB, of which one enrolled site may
  hold 24 MiB): the declared lengths of the bodies being received *or handled by Flower* at
  once (only enrolled sites' bodies are read at all: the fleet listener refuses an unsigned
  request from its headers). A body's bytes count until Flower has answered
  it, since Flower parses and copies a body after it was received, and the federation
  processes keep their allocator's high-water mark (:mod:`.memory`): counting only the
  receipt let an enrolled site's 192 junk bodies of 7.9 MB take the SuperLink from 135 to
  692 MiB (now 198 MiB, with bodies above 64 KiB handed to Flower one at a time by the fleet
  listener: ``benchmarks/enrolled_junk.py``). A request that would exceed it is answered 503
  at once (Flower's clients retry 503 with back-off);
- **a per-reply limit** (:class:`ReplyBytes`): a site first pushes a reply's object tree
  (``push-messages``), then its objects (``push-object``). A tree of more than
  ``max_reply_objects`` objects is refused whole (413, nothing stored); then the bytes of the
  objects pushed for one tree are counted, and an object that would take the reply beyond
  ``max_reply_bytes`` is refused (413), so an oversized reply is never complete: the
  coordinator never pulls it and leaves the site out of the round when its wait for the
  missing objects ends. The coordinator sets the limit from the method's largest legitimate
  reply (:func:`reply_limit_for`).
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any

#: Largest request body a site may send: one 5 MiB array chunk plus its framing.
MAX_BODY = 8 * 1024 * 1024
#: Bytes of request bodies being received or handled at once, across all connections.
MAX_INFLIGHT = 64 * 1024 * 1024
#: ... and from one enrolled site (its uploads: a few 5 MiB chunks at a time).
MAX_INFLIGHT_PER_SITE = 24 * 1024 * 1024
#: Most objects one reply's tree may hold.
MAX_REPLY_OBJECTS = 4096
#: Trees remembered for counting (the oldest are forgotten first).
_REMEMBERED_TREES = 256
#: Output line of the SuperLink's launcher for a refused reply: ``FEDSM-REFUSED-REPLY <message id> <reason>``;
#: the coordinator then gives that reply up at once, with the reason (:class:`RefusedReplies`).
REFUSED_REPLY = "FEDSM-REFUSED-REPLY"
#: Prefix of a refused reply's key when it is known by the id of the message it answers (refused whole).
REPLY_TO = "to:"


class InflightBudget:
    """Bytes of request bodies being received or handled now; :meth:`take` refuses what would exceed a limit.

    Parameters
    ----------
    limit
        All requests together.
    per_sender
        One sender's requests together (``None``: no per-sender limit). A sender with nothing
        in flight always gets one request through (within ``limit``), so a body larger than
        ``per_sender`` is not refused for ever.
    """

    def __init__(self, limit: int = MAX_INFLIGHT, per_sender: int | None = None) -> None:
        self.limit = limit
        self.per_sender = per_sender
        self.used = 0
        self._by_sender: dict[bytes, int] = {}

    def take(self, length: int, sender: bytes | None = None) -> bool:
        """Reserve ``length`` bytes (for ``sender``); ``False`` (nothing reserved) if that would exceed a limit."""
        if self.used + length > self.limit:
            return False
        if sender is not None and self.per_sender is not None:
            mine = self._by_sender.get(sender, 0)
            if mine and mine + length > self.per_sender:
                return False
            self._by_sender[sender] = mine + length
        self.used += length
        return True

    def give(self, length: int, sender: bytes | None = None) -> None:
        self.used = max(self.used - length, 0)
        if sender is not None and sender in self._by_sender:
            left = self._by_sender[sender] - length
            if left > 0:
                self._by_sender[sender] = left
            else:
                del self._by_sender[sender]


class ReplyBytes:
    """Counts the bytes pushed for each reply's object tree; refuses trees and objects beyond the limits.

    Parameters
    ----------
    max_reply_bytes
        Largest total of the objects of one reply (``None``: only ``max_reply_objects`` applies).
    max_reply_objects
        Most objects one reply's tree may hold.
    """

    def __init__(self, max_reply_bytes: int | None = None, max_reply_objects: int = MAX_REPLY_OBJECTS) -> None:
        self.max_reply_bytes = max_reply_bytes
        self.max_reply_objects = max_reply_objects
        self._owner: dict[str, str] = {}
        self._bytes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._members: dict[str, list[str]] = {}
        #: called once per refused reply with (its message id, the reason)
        self.on_refused: Any = None
        self._refused: set[str] = set()

    def messages_pushed(self, body: bytes) -> str | None:
        """Register the trees of a ``push-messages`` body; a reason to refuse it, or ``None``."""
        from flwr.proto.fleet_pb2 import PushMessagesRequest

        from engine.federation.flower.object_tree import object_ids

        try:
            request = PushMessagesRequest.FromString(body)
        except Exception:  # Flower answers a malformed body itself
            return None
        trees = []
        for k, tree in enumerate(request.message_object_trees):
            ids = object_ids(tree)
            if len(ids) > self.max_reply_objects:
                reason = f"a reply of {len(ids)} objects exceeds the limit of {self.max_reply_objects}"
                if self.on_refused is not None and k < len(request.messages_list):
                    # never announced, so known to the coordinator only by the message it answers
                    self.on_refused(REPLY_TO + request.messages_list[k].metadata.reply_to_message_id, reason)
                return reason
            trees.append((tree.object_id, ids))
        for root, ids in trees:
            self._remember(root, ids)
        return None

    def object_pushed(self, body: bytes) -> str | None:
        """Count a ``push-object`` body against its reply; a reason to refuse it, or ``None``."""
        if self.max_reply_bytes is None:
            return None
        from flwr.proto.message_pb2 import PushObjectRequest

        try:
            object_id = PushObjectRequest.FromString(body).object_id
        except Exception:  # Flower answers a malformed body itself
            return None
        root = self._owner.get(object_id)
        if root is None:
            return None  # not part of a registered reply: Flower refuses objects it does not expect
        total = self._bytes.get(root, 0) + len(body)
        if total > self.max_reply_bytes:
            reason = (f"the reply exceeds the coordinator's limit of {self.max_reply_bytes} bytes "
                      f"({_mib(self.max_reply_bytes)})")
            if root not in self._refused:
                self._refused.add(root)
                if self.on_refused is not None:
                    self.on_refused(root, reason)
            return reason
        self._bytes[root] = total
        return None

    def _remember(self, root: str, ids: list[str]) -> None:
        if root in self._bytes:
            return
        self._bytes[root] = 0
        self._members[root] = ids
        for object_id in ids:
            self._owner[object_id] = root
        while len(self._bytes) > _REMEMBERED_TREES:
            old, _ = self._bytes.popitem(last=False)
            self._refused.discard(old)
            for object_id in self._members.pop(old, []):
                if self._owner.get(object_id) == old:
                    del self._owner[object_id]


#: Smallest per-reply limit the coordinator sets (methods whose replies are not model-shaped have room).
MIN_REPLY_LIMIT = 128 * 1024 * 1024


def reply_limit_for(method: Any, state: Any, sites: list[str] | tuple[str, ...]) -> int | None:
    """The largest legitimate reply of ``method`` in bytes, doubled, plus 16 MiB (at least 128 MiB).

    ``None`` (no per-reply limit; the per-request, in-flight and authentication checks still
    apply) for a dialogue method (:class:`engine.fl.exchange.ExchangeMethod`), whose replies
    are activations whose size depends on batch, image size and perturbations, not on a model.
    """
    from engine.fl.weights import payload_bytes

    if not callable(getattr(method, "expected_update_shapes", None)):
        return None
    largest = 0
    for site in sites:
        parts = method.expected_update_shapes(state, site)
        largest = max(largest, sum(payload_bytes(w) for w in parts.values()))
    return max(int(2 * largest + 16 * 1024 * 1024), MIN_REPLY_LIMIT)


class RefusedReplies:
    """Replies the SuperLink refused (from its :data:`REFUSED_REPLY` lines), for the coordinator's grid.

    Filled from the SuperLink's output thread, read by the round loop: the coordinator stops
    waiting for a refused reply's missing objects at once and leaves its site out with the reason.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: collections.OrderedDict[str, str] = collections.OrderedDict()

    def on_line(self, line: str) -> bool:
        """Record a :data:`REFUSED_REPLY` line; ``True`` if ``line`` was one."""
        start = line.find(REFUSED_REPLY)
        if start < 0:
            return False
        parts = line[start + len(REFUSED_REPLY):].strip().split(" ", 1)
        if len(parts) == 2:
            self.add(parts[0], parts[1])
        return True

    def add(self, message_id: str, reason: str) -> None:
        with self._lock:
            self._reasons[message_id] = reason
            while len(self._reasons) > _REMEMBERED_TREES:
                self._reasons.popitem(last=False)

    def reason(self, message_id: str) -> str | None:
        """Why the reply ``message_id`` was refused, or ``None``."""
        with self._lock:
            return self._reasons.get(message_id)


def _mib(n: int) -> str:
    return f"{math.ceil(n / 2**20)} MiB"
