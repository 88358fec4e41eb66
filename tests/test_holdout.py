"""``fedsm simulate --holdout-site``: one site left out of training and evaluated as unseen."""

import json

import pytest

from engine.cli.main import main
from engine.errors import ConfigError
from engine.simulate import Simulation, SimulationConfig


@pytest.mark.slow
def test_holdout_site_is_not_trained_on_and_is_reported(tmp_path):
    out = tmp_path / "run"
    code = main(["simulate", "--task", "fundus", "--sites", "3", "--holdout-site", "site3", "--rounds", "1",
                 "--selector-warmup", "1", "--image-size", "32", "--methods", "fedavg,fedsm", "--device", "cpu",
                 "--gamma", "auto", "--site-routing", "style",
                 "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["sites"]] == ["site1", "site2"]
    assert report["holdout_site"]["name"] == "site3"
    fedsm = report["methods"]["fedsm"]
    assert set(fedsm["dice"]) == {"site1", "site2"}
    assert len(fedsm["rounds"]) == 1 + 1 + 1  # warm-up, training, last round
    sel = fedsm["extra"]["selector"]
    assert sel["unseen_site"] == "site3"
    assert sel["confidence"]["unseen"]["n"] == sum(report["holdout_site"][k]["images"]
                                                   for k in ("train", "validation", "test"))
    assert 0.0 <= sel["ece"]["participating"] <= 1.0
    for row in sel["routing_per_gamma"]:
        assert sum(row["seen"].values()) == pytest.approx(1.0)
        assert row["unseen"]["global"] + row["unseen"]["site"] == pytest.approx(1.0)
    # gamma 0.99: nothing is that sure after two Adam steps; everything goes to the global model
    assert sel["routing_per_gamma"][-1]["unseen"]["global"] == 1.0
    # --gamma auto: the federation's gamma, from every participating validation image, routes the run
    choice = sel["gamma_choice"]
    assert choice["pass_fraction"] == 0.95 and 0.5 <= choice["gamma"] < 1.0  # two sites: gamma >= 1/K
    assert choice["images"] == sum(s["validation"]["images"] for s in report["sites"])
    assert sel["gamma"] == fedsm["extra"]["gamma"] == choice["gamma"] == sel["dice"]["gamma"]
    assert choice["gamma"] in [row["gamma"] for row in sel["routing_per_gamma"]]
    assert f"Gamma chosen by the federation (`--gamma auto`): {choice['gamma']:.2f}" in (out / "report.md").read_text()
    dice = sel["dice"]
    assert set(dice["participating"]) == set(dice["unseen"]) == {"guard_on", "guard_off", "global_only", "gate_off",
                                                                  "style"}
    # --site-routing style: the bundle routes by the gate's nearest site, and the report's guard_on follows it
    from engine.bundle import load_bundle

    assert load_bundle(out / "supermodel.safetensors").metadata.site_routing == "style"
    assert dice["routing"] == "style" and dice["participating"]["guard_on"] == dice["participating"]["style"]
    # the site-style gate (on by default) is reported with its effect on seen and unseen images
    gate = sel["style_gate"]
    assert gate["quantile"] == 0.95 and gate["sites"] == ["site1", "site2"]
    assert 0.0 <= gate["seen_unlike"] <= 1.0 and 0.0 <= gate["unseen_unlike"] <= 1.0
    for row in sel["routing_per_gamma"]:
        assert sum(row["seen_gated"].values()) == pytest.approx(1.0)
        assert row["seen_gated"]["global"] >= row["seen"]["global"]  # the gate only ever adds global routing
        assert row["unseen_gated"]["global"] >= row["unseen"]["global"]
    # style routing sends exactly the gate's unlike images to global, the rest to a site
    style = sel["style_routing"]
    assert sum(style["seen"].values()) == pytest.approx(1.0)
    assert style["seen"]["global"] == pytest.approx(gate["seen_unlike"])
    assert style["unseen"]["global"] == pytest.approx(gate["unseen_unlike"])
    assert "Style routing (each image to the style gate's nearest site" in (out / "report.md").read_text()
    assert set(sel["guard"]) == {"site1", "site2"}
    assert 0.0 <= report["methods"]["fedavg"]["extra"]["unseen"]["dice"] <= 1.0


def test_unknown_holdout_site_is_refused(tmp_path):
    sim = Simulation(SimulationConfig(sites=2, holdout_site="site9", image_size=32, methods=("fedavg",)), tmp_path)
    with pytest.raises(ConfigError, match="site9"):
        sim.load_sites()
    with pytest.raises(ConfigError, match="no site to train on"):
        SimulationConfig(sites=1, holdout_site="site1")
