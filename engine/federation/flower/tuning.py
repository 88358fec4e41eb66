"""Three per-byte costs of Flower 1.41's message handling, removed in the FedSM processes.

Applied by :func:`apply` in every federation process (``fedsm server``, ``fedsm site`` and
their Flower children, see :mod:`engine.federation.flower.launch`); both replace Flower
behaviour with one that produces the same bytes and the same objects, only with fewer copies.
The tests in ``tests/federation/test_tuning.py`` compare them with Flower's own.

- **Array inflation** (:func:`inflate_array`). Flower rebuilds a received ``Array`` by
  appending its 5 MB chunks to a ``bytearray`` one after the other and copying the result
  into ``bytes``: the buffer is reallocated and copied at almost every chunk, ~4 copies of a
  38 MB selector plus the final one. Here the chunks are joined once, into the final bytes.
- **Chunk encoding** (:func:`deflate_array_chunk`). Flower writes a chunk's header and 5 MB
  of data into a ``bytearray`` and copies that into ``bytes``, and it does so twice per
  chunk sent (once for the object id, once to send). Here header and data are joined once.
- **HTTP reads** (:func:`read_responses_in_large_pieces`). httpcore reads a response 64 KB at
  a time; every weight chunk a SuperNode or the coordinator pulls is a 5 MB response, so
  80 socket reads and parser steps each. 1 MB reads do the same work in 5.
"""

from __future__ import annotations

import json
from typing import Any

#: httpcore's read size for Flower's HTTP clients (httpcore's default: 64 KB).
READ_SIZE = 1 << 20
#: Flower's own ``Array.inflate`` (the classmethod object), kept by :func:`apply` for comparison.
flower_array_inflate: Any = None
#: Flower's own ``ArrayChunk.deflate``, kept by :func:`apply` for comparison.
flower_chunk_deflate: Any = None


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
    """Install the three changes in this process (idempotent)."""
    from flwr.app import Array
    from flwr.app.message.arraychunk import ArrayChunk

    global flower_array_inflate, flower_chunk_deflate
    current = Array.__dict__["inflate"]
    if getattr(current, "__func__", None) is not inflate_array:
        flower_array_inflate = current
        Array.inflate = classmethod(inflate_array)  # type: ignore[method-assign, assignment]
    if ArrayChunk.__dict__["deflate"] is not deflate_array_chunk:
        flower_chunk_deflate = ArrayChunk.__dict__["deflate"]
        ArrayChunk.deflate = deflate_array_chunk  # type: ignore[method-assign]
    read_responses_in_large_pieces()
