"""Checkpoints, a site's private state, and the JSON-lines event writer."""

import io
import json

import pytest
import torch

from engine.errors import ConfigError
from engine.federation.checkpoint import Checkpoint, load_site_state_before, save_site_state, save_weightset
from engine.federation.events import EventWriter, read_events


def test_checkpoint_round_trip_with_shared_tensors(tmp_path):
    shared = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor(3)}
    state = {"global": shared, "personal/site1": shared, "personal/site2": {"w": torch.ones(2, 3), "n": shared["n"]}}
    path = Checkpoint(4, state, '{"method":"fedsm"}', "abc123", "sha256:" + "0" * 64,
                      [{"round": 4, "answered": ["site1"]}]).save(tmp_path / "checkpoint.safetensors")
    got = Checkpoint.load(path)
    assert (got.round, got.session, got.spec_json) == (4, "abc123", '{"method":"fedsm"}')
    assert got.history == [{"round": 4, "answered": ["site1"]}]
    assert set(got.state) == set(state)
    for part, tensors in state.items():
        for key, value in tensors.items():
            assert got.state[part][key].dtype == value.dtype and torch.equal(got.state[part][key], value)
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic write left no temporary file


def test_checkpoint_refuses_other_files(tmp_path):
    save_weightset(tmp_path / "other.safetensors", {"x": {"a": torch.ones(1)}}, {"format": "something-else"})
    with pytest.raises(ConfigError, match="is not a fedsm-federation-checkpoint file"):
        Checkpoint.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        Checkpoint.load(tmp_path / "junk.safetensors")
    with pytest.raises(ConfigError, match="does not exist"):
        Checkpoint.load(tmp_path / "missing.safetensors")


def test_site_state_is_kept_per_round(tmp_path):
    def control(value):
        return {"scaffold_control": {"w": torch.full((2,), float(value))}, "note": "not a tensor"}

    for rnd in (1, 2, 3, 4):
        save_site_state(tmp_path, "sess", rnd, control(rnd), keep=3)
    # a repeated round 3 starts from the state after round 2, not after round 3 or 4
    assert torch.equal(load_site_state_before(tmp_path, "sess", 3)["scaffold_control"]["w"], torch.full((2,), 2.0))
    assert torch.equal(load_site_state_before(tmp_path, "sess", 99)["scaffold_control"]["w"], torch.full((2,), 4.0))
    assert load_site_state_before(tmp_path, "sess", 2) == {}  # round 1's state was pruned (keep=3)
    assert load_site_state_before(tmp_path, "other", 3) == {}
    assert save_site_state(tmp_path, "sess", 5, {"note": 1}) is None


def test_event_writer(tmp_path):
    stream = io.StringIO()
    seen = []
    with EventWriter("site", "site1", tmp_path / "events.jsonl", stream=stream, listener=seen.append) as events:
        events.emit("metrics", round=1, loss={"seg": float("nan")}, dice={"global": 0.5})
        events.emit("connected", site="site2", coordinator="c:1")
        events.status("hello")
        with pytest.raises(ValueError, match="unknown event kind"):
            events.emit("nonsense")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines == read_events(tmp_path / "events.jsonl") == seen
    assert [e["event"] for e in lines] == ["metrics", "connected", "status"]
    assert all({"event", "time", "source", "site"} <= set(e) for e in lines)
    assert lines[0]["loss"] == {"seg": None} and lines[0]["site"] == "site1" and lines[1]["site"] == "site2"
    with (tmp_path / "events.jsonl").open("a") as fh:
        fh.write('{"event": "batch", "tim')  # a writer killed mid-line
    assert len(read_events(tmp_path / "events.jsonl")) == 3
