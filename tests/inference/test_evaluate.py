"""fedsm evaluate against hand-computed Dice; single-model (FedAvg) bundles through infer and evaluate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from testsupport import fedavg_network_bundle, write_photo_site

from engine import api
from engine.bundle import load_bundle, read_metadata, save_bundle
from engine.bundle.single import single_model_bundle
from engine.cli.main import main
from engine.data.datalist import load_datalist_with_info
from engine.data.preprocess import label_channels, read_task_channels
from engine.errors import ConfigError
from engine.inference.evaluate import evaluate_bundle, structure_metrics
from engine.io.privacy import content_name
from engine.io.readers import open_study
from engine.models import build_segmentation_net
from engine.tasks import get_task

FUNDUS = get_task("fundus")


def hand_dice(pred: np.ndarray, truth: np.ndarray) -> float:
    inter = np.logical_and(pred, truth).sum()
    total = pred.sum() + truth.sum()
    return 1.0 if total == 0 else 2.0 * inter / total


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> list[Path]:
    """Two sites named like the bundle's ("north", "south"), three test photos each."""
    root = tmp_path_factory.mktemp("eval")
    out = []
    for name, size in (("north", 40), ("south", 56)):
        site = write_photo_site(root / name, [f"{name}{i}" for i in range(4)], size=size)
        api.build_datalist(site / "images", site / "masks", site / "datalist.json", split=(0.25, 0, 0.75), seed=0)
        out.append(site / "datalist.json")
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from test_run import write_bundle

    return write_bundle(tmp_path_factory.mktemp("b") / "fedsm.safetensors", "fundus")


def test_metrics_match_hand_computation():
    # Prepare: a 10x10 square and the same square shifted 3 pixels right, plus an empty channel pair
    truth = np.zeros((2, 32, 32), np.uint8)
    pred = np.zeros_like(truth)
    truth[0, 10:20, 10:20] = 1
    pred[0, 10:20, 13:23] = 1
    # Execute
    dice, hd = structure_metrics(pred, truth, (1.0, 1.0))
    dice2, hd2 = structure_metrics(pred, truth, (2.0, 2.0))
    # Assert: Dice = 2*70/200; HD95 of a 3-pixel shift is 3 pixels, 6 mm at 2 mm spacing; both empty -> 1, None
    assert dice[0] == pytest.approx(0.7) and dice[1] == 1.0
    assert hd[0] == pytest.approx(3.0) and hd[1] is None
    assert dice2[0] == pytest.approx(0.7) and hd2[0] == pytest.approx(6.0)


def test_evaluate_equals_hand_computed_dice_per_image_and_site(bundle, sites):
    # Execute
    report = evaluate_bundle(bundle, sites, split="testing", model_choice="all", device="cpu")
    # Assert: every image's Dice is numpy Dice of segment_study's mask against the expert mask
    assert list(report["choices"]) == ["routed", "global", "personal"]
    expected: dict[tuple[str, str], list[float]] = {}
    for path in sites:
        sections, info = load_datalist_with_info(path)
        for entry in sections["testing"]:
            study = open_study(entry["image"])
            truth = read_task_channels(FUNDUS, entry["label"], study)
            for choice, force in (("routed", None), ("global", "global"), ("personal", info["name"])):
                seg = api.segment_study(bundle, study, device="cpu", force_model=force)
                pred = label_channels(FUNDUS, seg.labels.array)
                dice = [hand_dice(pred[c] > 0, truth[c] > 0) for c in range(2)]
                case = content_name([entry["image"]])  # rows name images by content, not file name
                row = next(r for r in report["images"] if r["choice"] == choice and r["case"] == case)
                assert [row["dice"]["disc"], row["dice"]["cup"]] == pytest.approx(dice, abs=1e-6)
                assert row["models"] == seg.models_used
                expected.setdefault((choice, info["name"]), []).append(dice[0])
    for (choice, site), values in expected.items():
        got = report["choices"][choice]["sites"][site]
        assert got["images"] == 3 and got["dice"]["disc"] == pytest.approx(np.mean(values), abs=1e-6)
    assert report["choices"]["personal"]["sites"]["north"]["routing"] == {"north": 3}
    avg = report["choices"]["global"]["client_average"]["dice"]["disc"]
    assert avg == pytest.approx(np.mean([np.mean(expected[("global", s)]) for s in ("north", "south")]), abs=1e-6)


def test_evaluate_cli_prints_the_table_and_writes_json(bundle, sites, tmp_path, capsys):
    code = main(["evaluate", "--model", str(bundle), "--datalist", *map(str, sites), "--model-choice",
                 "personal:south", "--device", "cpu", "--json", str(tmp_path / "e.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "disc Dice" in out and "cup HD95 (pixels)" in out and "personal:south  north" in out
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["choices"]["personal:south"]["sites"]["north"]["routing"] == {"south": 3}
    with pytest.raises(ConfigError, match="no personalized model of site 'east'"):
        evaluate_bundle(bundle, sites, model_choice="personal:east", device="cpu")
    assert main(["evaluate", "--model", str(bundle), "--datalist", str(sites[0]), "--split", "validation"]) == 2
    assert "'validation' section is empty" in capsys.readouterr().err


def test_fedavg_network_bundle_opens_in_infer_and_evaluate(sites, tmp_path, capsys):
    # Prepare
    model = fedavg_network_bundle(tmp_path / "coordinator")
    meta = read_metadata(model)
    photo = load_datalist_with_info(sites[0])[0]["testing"][0]["image"]
    # Execute
    code = main(["infer", "--model", str(model), "--input", str(photo), "--out", str(tmp_path / "masks"),
                 "--device", "cpu"])
    # Assert: the global model segments every image; no selector, no personalized model
    assert code == 0 and "routed to global" in capsys.readouterr().out
    assert meta.method == "fedavg" and meta.routing == "none" and meta.model_names == ["global"]
    assert load_bundle(model).personal_weights == {}
    routing = json.loads((tmp_path / "masks" / "routing.json").read_text())
    assert routing["method"] == "fedavg" and routing["inputs"][0]["models_used"] == {"global": 1}
    report = evaluate_bundle(model, sites, model_choice="all", device="cpu")
    assert list(report["choices"]) == ["global"]
    assert main(["infer", "--model", str(model), "--input", str(photo), "--out", str(tmp_path / "m2"),
                 "--model-choice", "north"]) == 2
    assert "not a model of this bundle" in capsys.readouterr().err


def test_single_model_bundle_round_trip_and_refusals(tmp_path):
    weights = build_segmentation_net(3, 2).state_dict()
    bundle = single_model_bundle("fundus", "scaffold", weights, ["a", "b"], 32, rounds=3, val_dice={"a": 0.5})
    save_bundle(tmp_path / "s.safetensors", bundle)
    loaded = load_bundle(tmp_path / "s.safetensors")
    assert loaded.metadata.val_dice == {"a": 0.5} and loaded.metadata.selector_classes == 0
    assert all(torch.equal(loaded.global_weights[k], v) for k, v in weights.items())
    with pytest.raises(ConfigError, match="does not produce a single global model"):
        single_model_bundle("fundus", "fedsm", weights, ["a"], 32)


def test_single_model_bundle_through_the_app_api(sites, tmp_path):
    # the desktop app reads the metadata and calls segment_study (engine.api) on the opened study
    model = fedavg_network_bundle(tmp_path / "coordinator")
    meta = api.read_bundle_metadata(model)
    study = open_study(load_datalist_with_info(sites[1])[0]["testing"][0]["image"])
    seg = api.segment_study(model, study, device="cpu")
    assert meta["routing"] == "none" and meta["site_names"] == ["north", "south"]
    assert seg.models_used == {"global": 1} and seg.records[0].probabilities == {"global": 1.0}
    assert seg.labels.array.shape == study.array.shape[:2] and seg.provenance().method == "fedavg"
