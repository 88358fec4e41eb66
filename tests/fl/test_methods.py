"""Federated methods through the in-process transport: rounds, failures, determinism."""

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import WeightsError
from engine.federation.inprocess import run_rounds
from engine.fl.methods import FedAvg, FedProx, FedSM, FedSMExtra, LocalOnly, Scaffold, SiteRuntime
from engine.tasks import FUNDUS


def sites(n_sites: int = 3) -> list[SiteRuntime]:
    return [SiteRuntime(f"site{k + 1}", k, random_split(4 + 2 * k, seed=k, shift=0.3 * k),
                        validation=random_split(3, seed=10 + k, shift=0.3 * k)) for k in range(n_sites)]


def names(rts):
    return [s.name for s in rts]


def test_fedavg_is_deterministic(tiny_training):
    rts = sites()
    a, _ = run_rounds(FedAvg(FUNDUS, names(rts), tiny_training, seed=3), rts, 1)
    b, _ = run_rounds(FedAvg(FUNDUS, names(sites()), tiny_training, seed=3), sites(), 1)
    for key in a["global"]:
        assert torch.equal(a["global"][key], b["global"][key])


def test_fedsm_lda_round_and_calibration(tiny_training):
    rts = sites()
    method = FedSM(FUNDUS, names(rts), tiny_training, seed=0, rounds=1, lam=0.7, selector_calibration="lda")
    assert method.total_rounds == 2
    initial = method.initial_state()
    assert "selector_optim" not in initial
    state, records = run_rounds(method, rts, method.total_rounds)
    assert [r.answered for r in records] == [names(rts)] * 2
    # personalized models differ from each other after SoftPull with lam < 1
    key = "model.0.conv.unit0.conv.weight"
    p1, p2 = state["personal/site1"], state["personal/site2"]
    assert not torch.equal(p1[key], p2[key])
    # the calibration round wrote the selector's last layer
    last_w = "classifier.3.weight"
    assert not torch.equal(state["selector"][last_w], initial["selector"][last_w])
    # calibration traffic is statistics only: count, sum, outer
    assert records[1].bytes_from_site["site1"] < records[0].bytes_from_site["site1"] / 10


def test_fedsm_reference_selector_averages_adam_state(tiny_training):
    rts = sites()
    method = FedSM(FUNDUS, names(rts), tiny_training, seed=0, rounds=2, lam=0.7)
    assert method.selector_calibration == "none" and method.total_rounds == 3
    initial = method.initial_state()
    assert float(initial["selector_optim"]["step"][0]) == 0.0
    state, records = run_rounds(method, rts, method.total_rounds)
    assert [r.answered for r in records] == [names(rts)] * 3
    # two rounds, one Adam step each, averaged over the sites
    assert float(state["selector_optim"]["step"][0]) == 2.0
    assert any(float(v.abs().sum()) > 0 for k, v in state["selector_optim"].items() if k.startswith("exp_avg."))
    assert records[0].metrics["site1"]["selector_accuracy"] >= 0.0
    # the last round: no weights back, only both models' validation Dice, recorded for the guard
    assert records[2].bytes_from_site["site1"] == 0
    assert set(state["validation_dice"]) == {f"{s}.{w}" for s in names(rts)
                                             for w in ("global", "personal", "cases", "diff_sd")}
    # each site holds 3 validation cases; the spread of the per-case Dice differences is a number in [0, 1]
    assert all(float(state["validation_dice"][f"{s}.cases"][0]) == 3 for s in names(rts))
    assert all(0.0 <= float(v[0]) <= 1.0 for k, v in state["validation_dice"].items() if not k.endswith(".cases"))


def test_site_reports_its_validation_cases_and_the_spread_of_the_per_case_difference(tiny_training):
    from engine.fl.evaluation import dice_per_case, segment_with
    from engine.fl.methods import check_validation_metrics, site_validation_dice
    from engine.models import build_segmentation_net

    site = sites(1)[0]
    torch.manual_seed(0)
    weights = {w: build_segmentation_net(3, 2).state_dict() for w in ("global", "personal")}
    metrics = site_validation_dice(FUNDUS, weights, site, tiny_training)
    val = site.validation
    per = {w: dice_per_case(segment_with(FUNDUS, weights[w], val.images, "cpu"), val.masks, val.case_ids).mean(1)
           for w in ("global", "personal")}
    assert metrics["val_cases"] == 3
    assert metrics["val_dice_global"] == pytest.approx(per["global"].mean())
    assert metrics["val_dice_diff_sd"] == pytest.approx(np.std(per["personal"] - per["global"], ddof=1))
    check_validation_metrics(metrics, "site1")
    with pytest.raises(WeightsError, match="val_cases"):
        check_validation_metrics({**metrics, "val_cases": 2.5}, "site1")
    with pytest.raises(WeightsError, match="val_dice_diff_sd"):
        check_validation_metrics({**metrics, "val_dice_diff_sd": float("nan")}, "site1")
    one = SiteRuntime("one", 0, site.train, validation=random_split(1, seed=3))
    assert site_validation_dice(FUNDUS, weights, one, tiny_training)["val_dice_diff_sd"] == 0.0


def test_fedsm_temperature_calibration_scales_last_layer(tiny_training):
    rts = sites(2)
    method = FedSM(FUNDUS, names(rts), tiny_training, seed=0, rounds=1, lam=0.5, selector_calibration="temperature")
    state, records = run_rounds(method, rts, 1)
    state2, _ = run_rounds(method, rts, 2, state=state, first_round=2)
    temperature = float(state2["selector_calibration"]["temperature"][0])
    for key in ("classifier.3.weight", "classifier.3.bias"):
        assert torch.allclose(state2["selector"][key], state["selector"][key] / temperature, atol=1e-6)
    assert records[0].answered == names(rts)


def test_site_that_fails_is_left_out_and_keeps_its_personal_model(tiny_training):
    rts = sites()

    class Broken(FedSM):
        def train_at_site(self, instructions, site, progress=None, cancel=None):
            if site.name == "site2":
                raise RuntimeError("disk unplugged")
            return super().train_at_site(instructions, site, progress, cancel)

    method = Broken(FUNDUS, names(rts), tiny_training, seed=0, rounds=1, lam=0.7)
    initial = method.initial_state()
    state, records = run_rounds(method, rts, 1)
    assert records[0].answered == ["site1", "site3"]
    assert "disk unplugged" in records[0].failed["site2"]
    for key, value in initial["personal/site2"].items():
        assert torch.equal(state["personal/site2"][key], value)


def test_update_with_nan_is_rejected_not_aggregated(tiny_training):
    rts = sites(2)

    class Poisoned(FedAvg):
        def train_at_site(self, instructions, site, progress=None, cancel=None):
            update = super().train_at_site(instructions, site, progress, cancel)
            if site.name == "site1":
                first = next(iter(update.weights["global"]))
                update.weights["global"][first] = torch.full_like(update.weights["global"][first], float("nan"))
            return update

    method = Poisoned(FUNDUS, names(rts), tiny_training, seed=0)
    state, records = run_rounds(method, rts, 1)
    assert records[0].answered == ["site2"]
    assert "NaN" in records[0].failed["site1"]
    assert all(bool(torch.isfinite(v).all()) for v in state["global"].values() if v.dtype.is_floating_point)


def test_update_with_wrong_shape_is_rejected(tiny_training):
    rts = sites(1)
    method = FedAvg(FUNDUS, names(rts), tiny_training)
    state = method.initial_state()
    update = method.train_at_site(method.site_instructions(state, 1, "site1"), rts[0])
    key = next(iter(update.weights["global"]))
    update.weights["global"][key] = torch.zeros(3)
    with pytest.raises(WeightsError, match="shape"):
        method.validate_update(state, "site1", update)


def test_scaffold_updates_control_variates(tiny_training):
    rts = sites(2)
    method = Scaffold(FUNDUS, names(rts), tiny_training, seed=0)
    state, records = run_rounds(method, rts, 1)
    assert records[0].answered == names(rts)
    assert any(float(v.abs().sum()) > 0 for v in state["control"].values())
    # from c = c_k = 0, both sites answering: c = (1/N) sum_k c_k+, each c_k+ a mean gradient
    c1, c2 = (rt.state["scaffold_control"] for rt in rts)
    assert set(state["control"]) == set(c1)
    for key, value in state["control"].items():
        assert torch.allclose(value, (c1[key] + c2[key]) / 2, atol=1e-7)
    assert all(bool(torch.isfinite(v).all()) for v in c1.values())


def test_fedprox_with_huge_mu_stays_near_the_round_start(tiny_training):
    # several steps: at the first step w equals the anchor and the proximal gradient is zero
    def one_site():
        return [SiteRuntime("site1", 0, random_split(16, seed=5))]

    start = FedAvg(FUNDUS, ["site1"], tiny_training).initial_state()["global"]
    free, _ = run_rounds(FedProx(FUNDUS, ["site1"], tiny_training, mu=0.0), one_site(), 1)
    tied, _ = run_rounds(FedProx(FUNDUS, ["site1"], tiny_training, mu=1e4), one_site(), 1)

    def dist(w):
        return sum(float((w[k] - start[k]).pow(2).sum()) for k in start if start[k].dtype.is_floating_point)

    assert dist(tied["global"]) < dist(free["global"])


def test_local_sends_nothing(tiny_training):
    rts = sites(2)
    _, records = run_rounds(LocalOnly(FUNDUS, names(rts), tiny_training, rounds=2), rts, 2)
    assert all(v == 0 for r in records for v in r.bytes_from_site.values())
    assert records[1].bytes_to_site == {"site1": 0, "site2": 0}


def test_fedsm_extra_phases(tiny_training):
    rts = sites(2)
    method = FedSMExtra(FUNDUS, names(rts), tiny_training, rounds=1, extra_rounds=1, lam=0.5)
    assert [method.phase(r) for r in (1, 2, 3)] == ["train", "selector", "calibrate"]
    state, records = run_rounds(method, rts, method.total_rounds)
    assert state["selector"]["classifier.3.weight"].shape[0] == 3  # K + 1 models
    assert set(records[1].metrics["site1"]) >= {"label_share_0", "loss_selector"}
    assert np.isclose(sum(v for k, v in records[1].metrics["site1"].items() if k.startswith("label_share")), 1.0)
