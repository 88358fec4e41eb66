"""Checkpoints carry a content hash; the last N are kept; a corrupt newest one falls back to the one before.

The acceptance case: a flipped tensor byte (valid header) in the newest checkpoint is found on
``--resume`` (an ``error`` event), and the run resumes from the previous round's checkpoint
and ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import struct

import pytest
import torch
from fakegrid import FakeGrid, workers_for
from test_server_app import assert_same_state, runner, spec

from engine.errors import ConfigError
from engine.federation.checkpoint import Checkpoint, load_latest_valid, load_weightset, round_files, save_weightset
from engine.federation.events import EventWriter


def flip_tensor_byte(path, offset_in_data=100):
    """Change one byte of tensor data, keeping the safetensors header valid."""
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_len + offset_in_data] ^= 0x40
    path.write_bytes(bytes(raw))


def _checkpoint(rnd):
    state = {"global": {"w": torch.full((64,), float(rnd)), "n": torch.tensor(rnd)}}
    return Checkpoint(rnd, state, "{}", "s1", "sha256:x", [{"round": r} for r in range(1, rnd + 1)])


def test_a_flipped_tensor_byte_is_detected(tmp_path):
    path = save_weightset(tmp_path / "w.safetensors", {"p": {"w": torch.arange(100.0)}}, {"format": "f"})
    assert load_weightset(path, "f")[0]["p"]["w"][5] == 5.0
    flip_tensor_byte(path, 4 * 5 + 1)
    with pytest.raises(ConfigError, match="corrupt: its tensors do not match the content hash"):
        load_weightset(path, "f")


def test_last_n_are_kept_and_a_corrupt_newest_falls_back(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    for rnd in range(1, 6):
        _checkpoint(rnd).save(path, keep=3)
    assert sorted(round_files(path)) == [3, 4, 5]
    assert Checkpoint.load(path).round == 5
    flip_tensor_byte(path)  # the newest (checkpoint.safetensors and its round file are one file)
    ckpt, problems = load_latest_valid(path)
    assert ckpt.round == 4 and len(problems) == 1 and "corrupt" in problems[0]
    assert float(ckpt.state["global"]["w"][0]) == 4.0
    round_files(path)[4].write_bytes(b"truncated")
    ckpt, problems = load_latest_valid(path)
    assert ckpt.round == 3 and len(problems) == 2
    round_files(path)[3].unlink()
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        load_latest_valid(path)


@pytest.mark.slow
def test_resume_skips_a_corrupt_newest_checkpoint_and_equals_an_uninterrupted_run(tmp_path):
    from engine.data.synth import generate_federation
    from engine.federation.config import load_federation_config
    from engine.federation.flower.server import _prepare_resume

    datalists = generate_federation("fundus", 3, tmp_path / "data", image_size=32, seed=0)
    s = spec("fedavg", rounds=3)
    work = tmp_path / "coordinator"
    grid = FakeGrid(workers_for(datalists, work))
    whole = runner(s, grid, work, []).run(grid)
    ckpt_path = work / "ckpt.safetensors"
    assert sorted(round_files(ckpt_path)) == [1, 2, 3]
    flip_tensor_byte(ckpt_path)
    # the coordinator's --resume path, with a federation.toml whose work_dir holds that checkpoint
    toml = tmp_path / "federation.toml"
    toml.write_text(f'[federation]\nsites = ["site1", "site2", "site3"]\nwork_dir = "{work}"\n'
                    '[training]\ntask = "fundus"\nmethod = "fedavg"\nrounds = 3\nimage_size = 32\nbatch_size = 4\n'
                    'selector_lr = 0.0001\nselector_width = 16\n')  # test_server_app.spec's settings
    cfg = load_federation_config(toml)
    (work / "checkpoint.safetensors").unlink(missing_ok=True)
    ckpt_path.rename(work / "checkpoint.safetensors")
    for rnd, f in round_files(ckpt_path).items():
        f.rename(work / f"checkpoint.round-{rnd}.safetensors")
    events: list[dict] = []
    checkpoint, session = _prepare_resume(cfg, True, "sha256:" + "0" * 64, EventWriter("server",
                                                                                         listener=events.append))
    assert checkpoint is not None and checkpoint.round == 2 and session == "session1"
    assert any(e["event"] == "error" and "corrupt" in e["message"] for e in events)
    resumed_grid = FakeGrid(workers_for(datalists, work))
    resumed = runner(s, resumed_grid, work, []).run(resumed_grid, checkpoint)
    assert_same_state(resumed, whole)


@pytest.mark.slow
def test_simulate_on_a_full_disk_writes_the_report_and_ends_with_a_clear_error(tmp_path, monkeypatch):
    """The super model's write fails with the safetensors error a full disk gives; the report is still written."""
    import json

    import safetensors.torch
    from safetensors import SafetensorError

    from engine.errors import FedSMError
    from engine.simulate import SimulationConfig, run_simulation

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    cfg = SimulationConfig(task="fundus", sites=2, rounds=1, methods=("fedsm",), image_size=32, batch_size=4,
                           device="cpu")
    with pytest.raises(FedSMError, match=r"report was written .* supermodel.safetensors \(SafetensorError: .*No space"):
        run_simulation(cfg, tmp_path / "out")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["supermodel"]["fedsm"]["path"] is None and "No space" in report["supermodel"]["fedsm"]["error"]
    assert "not written" in (tmp_path / "out" / "report.md").read_text()
    assert not (tmp_path / "out" / "supermodel.safetensors").exists()
