"""The network run's final evaluation: sites measure the final models on their validation and test images.

# Prepare: three synthetic sites on real files, the real ClientApp behind a FakeGrid (messages serialised).
# Execute: a FedSM run, then the 'evaluate' query; the results written into the bundle.
# Assert: each site's numbers equal Dice computed here from the final state; only numbers came back.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from fakegrid import FakeGrid, workers_for

from engine.bundle import read_metadata
from engine.data.site_data import load_site
from engine.errors import WeightsError
from engine.federation.events import EventWriter
from engine.federation.flower.final_evaluation import decode_evaluation
from engine.federation.flower.server import write_results
from engine.federation.flower.server_app import FederationRunner, RegisteredSites, RoundSettings, evaluate_final
from engine.federation.spec import MethodSpec, build_method
from engine.fl.evaluation import dice_per_case, segment_with
from engine.tasks import get_task

SITES = ("site1", "site2", "site3")


@pytest.fixture(scope="module")
def datalists(tmp_path_factory):
    from engine.data.synth import generate_federation

    return generate_federation("fundus", 3, tmp_path_factory.mktemp("data"), image_size=32, seed=0)


@pytest.mark.slow
def test_sites_report_final_dice_that_reaches_the_bundle(datalists, tmp_path):
    # Prepare
    spec = MethodSpec(method="fedsm", task="fundus", site_names=SITES, rounds=1, image_size=32, batch_size=4,
                      selector_lr=1e-4, selector_width=16)
    site_events: list[dict] = []
    workers = workers_for(datalists, tmp_path, site_events)
    for w in workers.values():
        w.validate = True
    grid = FakeGrid(workers)
    events: list[dict] = []
    runner = FederationRunner(build_method(spec, "cpu"), spec,
                              RoundSettings(min_sites=1, round_timeout=10.0, start_timeout=2.0, poll_interval=0.01),
                              RegisteredSites({w.cfg.name: n for n, w in workers.items()}),
                              EventWriter("server", listener=events.append), tmp_path / "ckpt.safetensors",
                              "session1", "sha256:" + "0" * 64)
    state = runner.run(grid)
    # Execute
    site_dice = evaluate_final(runner, grid, state)
    cfg = type("Cfg", (), {"spec": spec, "work_dir": tmp_path})()
    summary = write_results(cfg, runner.method, state, runner.history, "session1", "sha256:" + "0" * 64, site_dice)
    # Assert: the numbers are the final models' Dice on each site's own splits
    task = get_task("fundus")
    assert list(site_dice) == list(SITES)
    for name, datalist in zip(SITES, datalists, strict=True):
        site = load_site(datalist, task, 32, name=name)
        for split_name, split in (("validation", site.validation), ("testing", site.test)):
            for model, weights in (("global", state["global"]), ("personalized", state[f"personal/{name}"])):
                dice = dice_per_case(segment_with(task, weights, split.images, "cpu"), split.masks, split.case_ids)
                assert site_dice[name][split_name][model] == pytest.approx(float(np.mean(dice)), abs=1e-6)
                assert site_dice[name][split_name][f"{model}/cup"] == pytest.approx(float(dice[:, 1].mean()),
                                                                                    abs=1e-6)
    meta = read_metadata(tmp_path / "supermodel.safetensors")
    assert meta.val_dice == {s: site_dice[s]["validation"]["personalized"] for s in SITES}
    assert meta.extra["site_dice"] == site_dice and summary["site_dice"] == site_dice
    # each site sent only its own personalized model's numbers, and was sent only its own personalized model
    queries = [m for m in grid.sent if m.content.metric_records.get("metrics") is not None
               and "testing/global" in m.content.metric_records["metrics"]]
    assert len(queries) == 3 and all(not m.content.array_records for m in queries)
    assert any(e["event"] == "metrics" and e.get("final") for e in site_events)


def test_a_bad_evaluation_answer_is_refused():
    from flwr.app import MetricRecord, RecordDict

    with pytest.raises(WeightsError, match=re.escape("expected 'validation/...' or 'testing/...'")):
        decode_evaluation(RecordDict({"metrics": MetricRecord({"training/global": 0.5})}), "site1")
    with pytest.raises(WeightsError, match="in \\[0, 1\\]"):
        decode_evaluation(RecordDict({"metrics": MetricRecord({"testing/global": 1.5})}), "site1")
    assert decode_evaluation(RecordDict({"metrics": MetricRecord({"testing/global": 0.5})}), "s") == {
        "testing": {"global": 0.5}}


def test_fundus_crop_travels_in_the_run_spec_to_the_sites_data(datalists, tmp_path):
    from engine.errors import ConfigError

    spec = MethodSpec(method="fedavg", task="fundus", site_names=SITES, rounds=1, image_size=32, fundus_crop="auto")
    assert MethodSpec.from_json(spec.to_json()).fundus_crop == "auto"
    with pytest.raises(ConfigError, match="unknown fundus crop"):
        MethodSpec(method="fedavg", task="fundus", site_names=SITES, fundus_crop="tight")
    worker = next(iter(workers_for(datalists[:1], tmp_path).values()))
    assert worker.data("fundus", 32, "auto") is not worker.data("fundus", 32)  # loaded apart, cached apart
    assert worker.data("fundus", 32, "auto") is worker.data("fundus", 32, "auto")
