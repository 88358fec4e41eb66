"""Per-byte costs of Flower 1.41's message handling, removed in the FedSM processes.

:func:`apply` installs the array, chunk and HTTP changes in every federation process
(``fedsm server``, ``fedsm site`` and their Flower children);
:mod:`engine.federation.flower.launch` installs the SuperNode's store in the SuperNode and
the upload handler in the SuperLink. Each replaces Flower behaviour with one that produces
the same bytes and the same objects, only with fewer copies or fewer hashes. The tests in
``tests/federation/test_tuning.py`` compare them with Flower's own.

- **Array inflation** (:func:`inflate_array`). Flower rebuilds a received ``Array`` by
  appending its 5 MB chunks to a ``bytearray`` one after the other and copying the result
  into ``bytes``: the buffer is reallocated and copied at almost every chunk, ~4 copies of a
  38 MB selector plus the final one. Here the chunks are joined once, into the final bytes.
- **Chunk encoding** (:func:`deflate_array_chunk`). Flower writes a chunk's header and 5 MB
  of data into a ``bytearray`` and copies that into ``bytes``, and it does so twice per
  chunk sent (once for the object id, once to send). Here header and data are joined once.
- **Chunk ids** (:func:`array_chunk_object_id`). A chunk's object id is the SHA-256 of its
  encoding, and Flower recomputes it on every access: a site hashes every chunk of its
  answer twice (once to name the message, once more for its object tree). The id is kept
  with the data it was computed from and reused while the chunk holds that same data.
- **The SuperNode's re-hashing** (:func:`store_without_rehash`). Every object store hashes
  each object it is given and compares the result with its id. The SuperNode's store is
  given objects by two parties only: the SuperLink, over TLS to a certificate of the
  federation's CA, and the site's own ClientApp, on the site's loopback. Both channels
  already guarantee that the bytes are the ones sent, and the sender names the ids, so
  the hash proves nothing there; it cost each SuperNode ~100 MB of SHA-256 per FedSM
  round. The store still checks each object's structure (Flower's
  ``validate_object_content``). The SuperLink's store keeps Flower's check: it is where
  the sites' uploads enter.
- **An upload's content read once** (:func:`fleet_push_reads_content_once`). The SuperLink's
  handler of a site's ``PushObject`` reads the request's ``object_content`` twice, once to
  store it and once for its length, and every read of a protobuf ``bytes`` field copies it
  (5 MB per chunk). The handler is given the request with the content read once.
- **HTTP reads** (:func:`read_responses_in_large_pieces`). httpcore reads a response 64 KB at
  a time; every weight chunk a SuperNode or the coordinator pulls is a 5 MB response, so
  80 socket reads and parser steps each. 1 MB reads do the same work in 5.
"""

from __future__ import annotations

import json
from typing import Any, cast

#: httpcore's read size for Flower's HTTP clients (httpcore's default: 64 KB).
READ_SIZE = 1 << 20
#: Flower's own ``Array.inflate`` (the classmethod object), kept by :func:`apply` for comparison.
flower_array_inflate: Any = None
#: Flower's own ``ArrayChunk.deflate``, kept by :func:`apply` for comparison.
flower_chunk_deflate: Any = None
#: Flower's own ``ArrayChunk.object_id`` property, kept by :func:`apply` for comparison.
flower_chunk_object_id: Any = None


def inflate_array(cls: Any, object_content: bytes, children: dict[str, Any] | None = None) -> Any:
    """``Array.inflate`` of Flower 1.41 with the chunks joined once (see the module's docstring).

    The checks are Flower's: the chunk ids listed in the body must be exactly the children
    passed in (``ValueError`` otherwise).
    """
    from flwr.supercore.inflatable.inflatable_object import (
        get_object_body,
        get_object_children_ids_from_object_content,
    )

    children = children or {}
    body = get_object_body(object_content, cls)
    children_ids = get_object_children_ids_from_object_content(object_content)
    metadata = json.loads(body.decode("utf-8"))
    chunk_ids = [children_ids[i] for i in metadata["arraychunk_ids"]]
    if set(chunk_ids) != set(children):
        raise ValueError(f"Unexpected set of `children`. Expected {set(chunk_ids)} but got {set(children)}.")
    array = cls(dtype=metadata["dtype"], shape=tuple(metadata["shape"]), stype=metadata["stype"], data=b"")
    array.data = b"".join([children[chunk_id].data for chunk_id in chunk_ids])
    return array


def deflate_array_chunk(self: Any) -> bytes:
    """``ArrayChunk.deflate`` of Flower 1.41 with one copy of the data (see the module's docstring).

    The same bytes as Flower's ``add_header_to_object_body``: ``<type> <children> <length>``
    (separated by Flower's value divider), Flower's head-body divider, the data.
    """
    from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER

    body = self.data
    head = f"%s{HEAD_VALUE_DIVIDER}%s{HEAD_VALUE_DIVIDER}%d" % (
        type(self).__qualname__, ",".join((self.children or {}).keys()), len(body))
    return b"".join([head.encode("utf-8"), HEAD_BODY_DIVIDER, body])


def _array_chunk_object_id(self: Any) -> str:
    """``ArrayChunk.object_id`` computed once per chunk data (see the module's docstring).

    The id is cached with the very data object it was computed from: a chunk whose ``data``
    is replaced gets a new id. Chunk data are immutable (``bytes``, or views of the array's
    ``bytes``), so the same object always has the same id. ``_object_id`` is set as
    Flower's own property does.
    """
    from flwr.supercore.inflatable import inflatable_object

    cached = self.__dict__.get("_fedsm_object_id")
    if cached is not None and cached[0] is self.data:
        return cast(str, cached[1])
    object_id = inflatable_object.get_object_id(self.deflate())
    self.__dict__["_fedsm_object_id"] = (self.data, object_id)
    self.__dict__["_object_id"] = object_id
    return object_id


#: The property installed on ``ArrayChunk`` by :func:`apply`.
array_chunk_object_id = property(_array_chunk_object_id)


def store_without_rehash(supernode_command: Any) -> None:
    """Give the SuperNode of ``supernode_command`` a store that does not re-hash objects.

    ``supernode_command`` is Flower's ``flwr.supernode.cli.flower_supernode`` module, whose
    entry point builds its store with the module's ``ObjectStoreFactory``; that name is
    replaced by a factory of :class:`SiteObjectStore` (see the module's docstring).
    """
    from flwr.supercore.object_store import ObjectStoreFactory

    if not isinstance(getattr(supernode_command, "ObjectStoreFactory", None), type):
        raise SystemExit("this Flower version's SuperNode command builds no ObjectStoreFactory; FedSM needs "
                         "flwr 1.41 (pip install 'flwr==1.41.*')")

    class SiteStoreFactory(ObjectStoreFactory):
        def store(self) -> Any:
            if self.store_instance is not None:
                return self.store_instance
            with self._store_lock:
                if self.store_instance is None:
                    self.store_instance = site_object_store()
                return self.store_instance

    supernode_command.ObjectStoreFactory = SiteStoreFactory


def site_object_store() -> Any:
    """Flower's in-memory object store checking each object's structure but not its hash."""
    from flwr.supercore.inflatable.inflatable_utils import validate_object_content
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore

    class SiteObjectStore(InMemoryObjectStore):
        def __init__(self) -> None:
            super().__init__(verify=False)

        def put(self, object_id: str, object_content: bytes) -> None:
            validate_object_content(content=object_content)
            super().put(object_id, object_content)

    return SiteObjectStore()


class _ContentReadOnce:
    """A ``PushObjectRequest`` whose ``object_content`` was read (copied out) once."""

    def __init__(self, request: Any) -> None:
        self._request = request
        self.object_content = request.object_content

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def fleet_push_reads_content_once() -> None:
    """Hand the SuperLink's fleet ``push_object`` handler requests whose content is read once (idempotent)."""
    from flwr.superlink.servicer.fleet import fleet_handlers

    original = fleet_handlers.push_object
    if getattr(original, "_fedsm_reads_once", False):
        return

    def push_object(request: Any, state: Any) -> Any:
        return original(request=_ContentReadOnce(request), state=state)

    push_object._fedsm_reads_once = True  # type: ignore[attr-defined]
    fleet_handlers.push_object = push_object


def read_responses_in_large_pieces() -> None:
    """Let Flower's HTTP clients read a response :data:`READ_SIZE` bytes at a time.

    ``READ_NUM_BYTES`` is the class attribute httpcore itself reads for that size; if a later
    httpcore drops it, this does nothing.
    """
    try:
        from httpcore._sync.http11 import HTTP11Connection
    except ImportError:
        return
    if hasattr(HTTP11Connection, "READ_NUM_BYTES"):
        HTTP11Connection.READ_NUM_BYTES = READ_SIZE


def apply() -> None:
    """Install the four changes in this process (idempotent)."""
    from flwr.app import Array
    from flwr.app.message.arraychunk import ArrayChunk

    global flower_array_inflate, flower_chunk_deflate, flower_chunk_object_id
    current = Array.__dict__["inflate"]
    if getattr(current, "__func__", None) is not inflate_array:
        flower_array_inflate = current
        Array.inflate = classmethod(inflate_array)  # type: ignore[method-assign, assignment]
    if ArrayChunk.__dict__["deflate"] is not deflate_array_chunk:
        flower_chunk_deflate = ArrayChunk.__dict__["deflate"]
        ArrayChunk.deflate = deflate_array_chunk  # type: ignore[method-assign]
    if ArrayChunk.__dict__.get("object_id") is not array_chunk_object_id:
        flower_chunk_object_id = ArrayChunk.object_id
        ArrayChunk.object_id = array_chunk_object_id  # type: ignore[method-assign, assignment]
    read_responses_in_large_pieces()
