"""The copy savings in Flower's message handling give exactly what Flower's own code gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.federation.flower import records, tuning


@pytest.fixture(scope="module")
def flower_inflate():
    tuning.apply()
    tuning.apply()  # idempotent: Flower's own method is still the one kept
    assert tuning.flower_array_inflate is not None
    assert getattr(tuning.flower_array_inflate, "__func__", None) is not tuning.inflate_array
    return tuning.flower_array_inflate.__func__


def _deflated(array):
    """An Array's content and its chunks' objects, as a receiver gets them."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    objects = get_all_nested_objects(array)
    content = objects.pop(array.object_id).deflate()
    children = {oid: type(obj).inflate(obj.deflate()) for oid, obj in objects.items()}
    return content, children


@pytest.mark.parametrize("values", [
    np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32),  # 12 MB: three chunks
    np.zeros(3_000_000, dtype=np.float32),  # identical chunks share one object id
    np.arange(10, dtype=np.int64),  # one small chunk
    np.array([], dtype=np.float32),  # no data at all
])
def test_joined_inflation_equals_flowers(flower_inflate, values):
    from flwr.app import Array

    content, children = _deflated(Array(values))
    ours = tuning.inflate_array(Array, content, children)
    theirs = flower_inflate(Array, content, children)
    assert type(ours.data) is bytes and ours.data == theirs.data
    assert (ours.dtype, ours.shape, ours.stype) == (theirs.dtype, theirs.shape, theirs.stype)
    assert ours.object_id == theirs.object_id == Array(values).object_id
    np.testing.assert_array_equal(ours.numpy(), values)


def test_joined_inflation_refuses_children_that_do_not_match(flower_inflate):
    from flwr.app import Array

    content, children = _deflated(Array(np.arange(5, dtype=np.float32)))
    _, other_children = _deflated(Array(np.arange(6, dtype=np.float32)))
    with pytest.raises(ValueError, match="Unexpected set of `children`"):
        tuning.inflate_array(Array, content, other_children)
    with pytest.raises(ValueError, match="Unexpected set of `children`"):
        tuning.inflate_array(Array, content, {**children, **other_children})


def test_a_whole_message_round_trips_through_flower_with_the_joined_inflation(flower_inflate, monkeypatch):
    from flwr.app import Array, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 7), ("_node_id", 5)):  # as a ServerApp has them
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)
    assert Array.inflate.__func__ is tuning.inflate_array
    weights = {"a": torch.randn(2_000_000), "b": torch.arange(7), "c": torch.tensor([True, False])}
    message = Message(RecordDict(records.weights_records({"global": weights})), dst_node_id=5,
                      message_type="train", ttl=100)
    objects = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    back = inflate_object_from_contents(message.object_id, objects)
    decoded = records.unpack(back.content.array_records["weights:global"],
                             back.content.config_records["layout"]["global"], "global")
    assert set(decoded) == set(weights)
    for key, tensor in weights.items():
        assert torch.equal(decoded[key], tensor) and decoded[key].dtype == tensor.dtype


def test_large_reads_for_flowers_http_clients():
    from httpcore._sync.http11 import HTTP11Connection

    tuning.apply()
    assert HTTP11Connection.READ_NUM_BYTES == tuning.READ_SIZE


@pytest.mark.parametrize("size", [0, 1, 5_000_000, 5 * 1024 * 1024, 12_345_679])
def test_one_copy_chunk_encoding_equals_flowers(flower_inflate, size):  # the fixture applies the tuning
    from flwr.app import Array
    from flwr.app.message.arraychunk import ArrayChunk

    assert ArrayChunk.deflate is tuning.deflate_array_chunk
    values = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    for _, chunk in Array(values).slice_array():
        assert tuning.deflate_array_chunk(chunk) == tuning.flower_chunk_deflate(chunk)
        assert type(chunk.deflate()) is bytes
        back = ArrayChunk.inflate(chunk.deflate())
        assert bytes(back.data) == bytes(chunk.data)


def test_chunk_ids_are_flowers_and_hashed_once_per_data(flower_inflate, monkeypatch):
    from flwr.app import Array
    from flwr.app.message.arraychunk import ArrayChunk
    from flwr.supercore.inflatable import inflatable_object
    from flwr.supercore.inflatable.inflatable_object import get_object_tree

    assert ArrayChunk.object_id is tuning.array_chunk_object_id
    hashed = []
    real = inflatable_object.get_object_id
    monkeypatch.setattr(inflatable_object, "get_object_id",
                        lambda content: hashed.append(len(content)) or real(content))
    values = np.random.default_rng(1).standard_normal(3_000_000).astype(np.float32)  # three chunks
    array = Array(values)
    chunks = [chunk for _, chunk in array.slice_array()]
    assert len(chunks) == 3
    for chunk in chunks:
        assert chunk.object_id == tuning.flower_chunk_object_id.fget(chunk) == real(chunk.deflate())
    assert array.object_id  # the array's own id (its metadata, not its data)
    hashed.clear()
    get_object_tree(array)  # Flower's walk asks every chunk for its id again
    assert [chunk.object_id for chunk in chunks] and hashed == []
    # new data, new id
    chunk = chunks[0]
    first = chunk.object_id
    chunk.data = memoryview(b"other data")
    assert chunk.object_id == real(chunk.deflate()) != first


def test_the_site_object_store_checks_structure_but_not_the_hash():
    from flwr.app.message.arraychunk import ArrayChunk
    from flwr.supercore.inflatable.inflatable_object import UnexpectedObjectContentError, get_object_id
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore

    store = tuning.site_object_store()
    content = ArrayChunk(memoryview(b"\x01" * 1000)).deflate()
    object_id = get_object_id(content)
    store.preregister(7, get_tree(object_id))
    store.put(object_id, content)
    assert store.get(object_id) == content
    other = tuning.site_object_store()
    other.preregister(7, get_tree(object_id))
    with pytest.raises(UnexpectedObjectContentError):  # not an object at all: refused, not stored
        other.put(object_id, b"no head, no body")
    assert other.get(object_id) == b""
    flower = InMemoryObjectStore()
    flower.preregister(7, get_tree(object_id))
    with pytest.raises(ValueError, match="does not match"):  # Flower's own store re-hashes
        flower.put(object_id, content[:-1] + b"\x02")


def get_tree(object_id):
    from flwr.proto.message_pb2 import ObjectTree

    return ObjectTree(object_id=object_id, children=[])


def test_the_supernode_command_builds_the_site_store(monkeypatch):
    import types

    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore

    command = types.SimpleNamespace(ObjectStoreFactory=ObjectStoreFactory)
    tuning.store_without_rehash(command)
    factory = command.ObjectStoreFactory()
    store = factory.store()
    assert isinstance(store, InMemoryObjectStore) and store.verify is False
    assert factory.store() is store
    with pytest.raises(SystemExit, match=r"flwr 1\.41"):
        tuning.store_without_rehash(types.SimpleNamespace())


def test_the_superlink_reads_an_uploads_content_once(monkeypatch):
    from flwr.superlink.servicer.fleet import fleet_handlers

    seen = []

    def flower_push_object(request, state):
        seen.append((request.object_content, request.object_content, request.object_id, state))
        return "stored"

    monkeypatch.setattr(fleet_handlers, "push_object", flower_push_object)
    tuning.fleet_push_reads_content_once()
    tuning.fleet_push_reads_content_once()  # idempotent: wrapped once

    class Request:
        reads = 0
        object_id = "abc"

        @property
        def object_content(self):
            Request.reads += 1
            return b"content"

    assert fleet_handlers.push_object(Request(), "state") == "stored"
    assert Request.reads == 1
    assert seen == [(b"content", b"content", "abc", "state")]
