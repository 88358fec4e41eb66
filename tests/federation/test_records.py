"""Payloads as Flower records: exact round trips, strict decoding of what sites send."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from engine.errors import WeightsError
from engine.federation.flower import records
from engine.fl.methods import SiteInstructions, SiteUpdate
from engine.models import build_segmentation_net


def weights():
    torch.manual_seed(0)
    return build_segmentation_net(3, 2).state_dict()


def test_pack_round_trip_is_bit_exact_with_dtypes():
    w = {**weights(), "bn.num_batches_tracked": torch.tensor(5), "mask": torch.tensor([True, False]),
         "half": torch.tensor([0.5, -1.0], dtype=torch.float16), "scalar": torch.tensor(1.5)}
    record, layout = records.pack(w)
    assert set(record) == {"float32", "int64", "bool", "float16"}  # one flat array per dtype, not per tensor
    back = records.unpack(record, layout, "test")
    assert list(back) == list(w)
    for key, value in w.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value)


def test_update_round_trip():
    w = weights()
    content = records.encode_update(SiteUpdate({"global": w, "personal": w}, 7, {"loss": 0.25}), site="site2", rnd=3)
    assert records.record_contents(content) == {"global": len(w), "personal": len(w)}
    assert records.record_bytes(content) > 2 * sum(t.numel() * t.element_size() for t in w.values())
    update = records.decode_update(content, "site2", 3)
    assert update.num_samples == 7 and update.metrics == {"loss": 0.25}
    assert torch.equal(update.weights["personal"]["model.0.conv.unit0.conv.weight"],
                       w["model.0.conv.unit0.conv.weight"])


def test_instructions_round_trip():
    w = weights()
    ins = SiteInstructions(2, {"global": w, "personal/site3": w}, {"phase": "train"})
    content = records.encode_instructions(ins, rounds=3, method="fedsm", spec_json="{}", session="s1", site="site1")
    got = records.decode_instructions(content)
    assert (got.round, got.rounds, got.method, got.session, got.site) == (2, 3, "fedsm", "s1", "site1")
    assert got.instructions.config == {"phase": "train"}
    assert set(got.instructions.weights) == {"global", "personal/site3"}


def test_pack_cache_packs_a_shared_part_once():
    w = weights()
    cache = records.PackCache()
    assert cache.pack(w)[0] is cache.pack(w)[0]
    assert cache.pack(dict(w))[0] is not cache.pack(w)[0]


def reply(**changes):
    content = records.encode_update(SiteUpdate({"global": weights()}, 5, {"loss": 0.5}), site="site1", rnd=1)
    for key, value in changes.items():
        content[key] = value
    return content


@pytest.mark.parametrize(("content", "message"), [
    (reply(extra=ConfigRecord({"path": "/data/site1"})), "unexpected records ['extra']"),
    (reply(fedsm=ConfigRecord({"site": "site2", "round": 1})), "claims to be from site 'site2'"),
    (reply(fedsm=ConfigRecord({"site": "site1", "round": 2})), "for round 2"),
    (reply(metrics=MetricRecord({"loss": 0.5})), "'num-examples' must be a positive integer"),
    (reply(metrics=MetricRecord({"num-examples": -3})), "'num-examples' must be a positive integer"),
    (reply(metrics=MetricRecord({"num-examples": 5, "loss": [1.0, 2.0]})), "metric 'loss' is not a number"),
    (reply(layout=ConfigRecord({"global": "not json"})), "missing or unreadable tensor layout"),
    (reply(layout=ConfigRecord({})), "missing or unreadable tensor layout"),
])
def test_malformed_replies_are_refused(content, message):
    with pytest.raises(WeightsError) as err:
        records.decode_update(content, "site1", 1)
    assert message in str(err.value)


def test_arrays_that_do_not_add_up_are_refused():
    w = {"a": torch.ones(4), "b": torch.zeros(2, 3)}
    record, _ = records.pack(w)
    short = json.dumps([["a", "float32", [4]]])
    with pytest.raises(WeightsError, match="more values were sent than the layout describes"):
        records.unpack(record, short, "t")
    long = json.dumps([["a", "float32", [4]], ["b", "float32", [2, 4]]])
    with pytest.raises(WeightsError, match="needs more float32 values"):
        records.unpack(record, long, "t")
    twice = json.dumps([["a", "float32", [4]], ["a", "float32", [6]]])
    with pytest.raises(WeightsError, match="appears twice"):
        records.unpack(record, twice, "t")
    with pytest.raises(WeightsError, match="malformed layout entry"):
        records.unpack(record, json.dumps([["a", "float32", [-4]]]), "t")


def test_foreign_arrays_are_refused():
    big_endian = ArrayRecord({"float32": Array(np.ones(3, dtype=">f4"))})
    with pytest.raises(WeightsError, match=r"not a flat array of a numeric dtype|does not match"):
        records.unpack(big_endian, json.dumps([["a", "float32", [3]]]), "t")
    text = ArrayRecord({"<U3": Array(np.array(["abc"]))})
    with pytest.raises(WeightsError, match="numeric dtype"):
        records.unpack(text, json.dumps([["a", "<U3", [1]]]), "t")
    image_like = ArrayRecord({"float32": Array(np.ones((2, 3), dtype=np.float32))})
    with pytest.raises(WeightsError, match="flat array"):
        records.unpack(image_like, json.dumps([["a", "float32", [2, 3]]]), "t")


def test_instruction_without_settings_is_refused():
    with pytest.raises(WeightsError, match="without its 'fedsm' settings"):
        records.decode_instructions(RecordDict({}))


def test_packed_arrays_are_standard_npy_and_truncated_ones_are_refused():
    w = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([7.0])}
    record, layout = records.pack(w)
    # what np.save writes, so any Flower receiver (Array.numpy) reads it too
    assert np.array_equal(record["float32"].numpy(), np.array([0, 1, 2, 3, 4, 5, 7], dtype=np.float32))
    assert record["float32"].data == Array(np.array([0, 1, 2, 3, 4, 5, 7], dtype=np.float32)).data
    back = records.unpack(record, layout, "t")
    back["a"] += 1  # tensors own their memory: writable, and independent of the received bytes
    assert torch.equal(records.unpack(record, layout, "t")["a"], w["a"])
    cut = ArrayRecord({"float32": Array(dtype="float32", shape=(7,), stype="numpy.ndarray",
                                        data=record["float32"].data[:-4])})
    with pytest.raises(WeightsError, match="not readable"):
        records.unpack(cut, layout, "t")
    garbage = ArrayRecord({"float32": Array(dtype="float32", shape=(7,), stype="numpy.ndarray", data=b"\0" * 64)})
    with pytest.raises(WeightsError, match="not readable"):
        records.unpack(garbage, layout, "t")


def test_object_ids_walk_a_messages_tree_as_flower_does():
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_object import get_object_tree, iterate_object_tree
    from flwr.supercore.task_identity import TaskIdentity

    from engine.federation.flower.object_tree import object_ids

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as a task's process
    content = RecordDict({"weights": ArrayRecord([np.arange(70_000, dtype=np.float32), np.ones(3)]),
                          "config": ConfigRecord({"round": 2})})
    tree = get_object_tree(Message(content, dst_node_id=3, message_type="train"))
    assert object_ids(tree) == [t.object_id for t in iterate_object_tree(tree)]
    assert object_ids(tree)[-1] == tree.object_id and len(object_ids(tree)) > 4

    # protobuf refuses to decode trees nested past 100 levels; the walk itself must not depend on that
    from types import SimpleNamespace

    deep = SimpleNamespace(object_id="leaf", children=[])
    for level in range(5000):  # far deeper than Python's recursion limit
        deep = SimpleNamespace(object_id=f"n{level}", children=[deep])
    ids = object_ids(deep)
    assert len(ids) == 5001 and ids[0] == "leaf" and ids[-1] == "n4999"
