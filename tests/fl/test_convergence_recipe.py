"""Training recipe: learning-rate schedules over rounds, the loss choice, and best-round selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError
from engine.fl.local_training import LocalTrainingConfig, scheduled_lr, segmentation_loss


# --- schedules --------------------------------------------------------------------------------
def test_cosine_schedule_by_hand():
    # round 1 -> lr; last round -> lr * min_ratio; middle round of 5 (t = 0.5) -> half way
    assert scheduled_lr(1e-3, "cosine", 1, 5, 0.01) == pytest.approx(1e-3)
    assert scheduled_lr(1e-3, "cosine", 5, 5, 0.01) == pytest.approx(1e-5)
    assert scheduled_lr(1e-3, "cosine", 3, 5, 0.01) == pytest.approx(1e-3 * (0.01 + 0.99 * 0.5))
    assert scheduled_lr(1e-3, "cosine", 2, 5, 0.01) == pytest.approx(
        1e-3 * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi / 4))))
    # rounds past the training rounds (selector, calibration) keep the last value
    assert scheduled_lr(1e-3, "cosine", 9, 5, 0.01) == pytest.approx(1e-5)


def test_step_and_constant_schedules():
    values = [scheduled_lr(1.0, "step", r, 8) for r in range(1, 9)]
    assert values == pytest.approx([1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01])
    assert {scheduled_lr(0.5, "constant", r, 8) for r in range(1, 9)} == {0.5}


def test_schedule_rejects_bad_input():
    with pytest.raises(ConfigError, match="lr_schedule"):
        scheduled_lr(1e-3, "linear", 1, 5)
    with pytest.raises(ConfigError, match="lr_schedule"):
        LocalTrainingConfig(lr_schedule="linear")
    with pytest.raises(ConfigError, match="lr_min_ratio"):
        LocalTrainingConfig(lr_min_ratio=0.0)
    with pytest.raises(ConfigError, match="loss"):
        LocalTrainingConfig(loss="focal")


def test_method_trains_each_round_with_the_scheduled_rate(monkeypatch):
    from engine.fl import methods as m
    from engine.fl.methods import averaging
    from engine.tasks import FUNDUS

    seen: list[float] = []

    def fake_round(task, weights, data, cfg, seed, ctx, **kw):
        seen.append(cfg.lr)
        return dict(weights), {"loss": 0.0}

    monkeypatch.setattr(averaging, "train_segmentation_round", fake_round)  # where FedAvg looks it up
    cfg = LocalTrainingConfig(lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, device="cpu")
    method = m.FedAvg(FUNDUS, ["a"], cfg, rounds=3)
    site = m.SiteRuntime("a", 0, random_split(2))
    state = method.initial_state()
    for rnd in (1, 2, 3):
        method.train_at_site(method.site_instructions(state, rnd, "a"), site)
    assert seen == pytest.approx([1e-3, 1e-3 * (0.1 + 0.9 * 0.5), 1e-4])
    assert method.round_training(2).selector_lr == cfg.selector_lr  # the selector's rate is not scheduled


def test_network_spec_carries_the_recipe():
    from engine.federation.spec import MethodSpec, build_method

    spec = MethodSpec("fedavg", "fundus", ("a", "b"), rounds=4, lr_schedule="cosine", lr_min_ratio=0.05,
                      loss="dicece")
    again = MethodSpec.from_json(spec.to_json())
    assert again == spec
    training = build_method(again, "cpu").training
    assert (training.lr_schedule, training.lr_min_ratio, training.loss) == ("cosine", 0.05, "dicece")


def test_dicece_adds_cross_entropy_to_dice():
    logits = torch.tensor([[[[2.0, -1.0], [0.5, -3.0]]]])
    target = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]]])
    dice = float(segmentation_loss("dice")(logits, target))
    bce = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, target))
    assert float(segmentation_loss("dicece")(logits, target)) == pytest.approx(dice + bce, rel=1e-5)


# --- best round by validation -----------------------------------------------------------------
class _Site:
    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.validation = random_split(3, seed=seed)


def _perfect_if_good(task, weights, images, device):
    """Stand-in segmenter: weights {'q': 1} return a fixed good mask, {'q': 0} an empty one."""
    return np.zeros((len(images), 2, *images.shape[2:]), dtype=np.uint8) + int(weights["q"].item())


class _Method:
    name = "fedavg"
    rounds = 4


def test_keeper_keeps_the_best_round_and_swaps_it_in():
    from engine.fl.model_selection import BestRoundKeeper
    from engine.tasks import FUNDUS

    keeper = BestRoundKeeper(FUNDUS, [_Site("a", 1), _Site("b", 2)], "cpu", segment=_perfect_if_good)
    qualities = [0, 1, 1, 0]  # rounds 2 and 3 tie: the earlier one is kept
    for rnd, q in enumerate(qualities, start=1):
        keeper(_Method(), rnd, {"global": {"q": torch.tensor(q, dtype=torch.float32)}, "control": {}}, [])
    summary = keeper.summary()
    assert summary["best_round"] == 2
    assert [p["round"] for p in summary["curve"]] == [1, 2, 3, 4]
    assert summary["curve"][0]["global"] == pytest.approx(0.0)
    assert summary["best_val_dice"] > 0.4
    final = {"global": {"q": torch.tensor(0.0)}, "control": {"c": torch.tensor(1.0)}}
    swapped = keeper.substitute(_Method(), final, [])
    assert swapped["global"]["q"].item() == 1.0
    assert swapped["control"] is final["control"]


def test_keeper_picks_each_sites_own_best_personalized_model():
    from engine.fl.model_selection import BestRoundKeeper
    from engine.tasks import FUNDUS

    class FedSMLike(_Method):
        name = "fedsm"

    def state(qa, qb, qg=0):
        return {"global": {"q": torch.tensor(float(qg))}, "personal/a": {"q": torch.tensor(float(qa))},
                "personal/b": {"q": torch.tensor(float(qb))}}

    keeper = BestRoundKeeper(FUNDUS, [_Site("a", 1), _Site("b", 2)], "cpu", segment=_perfect_if_good)
    keeper(FedSMLike(), 1, state(1, 0), [])
    keeper(FedSMLike(), 2, state(0, 1, qg=1), [])
    keeper(FedSMLike(), 5, state(0, 0), [])  # past the training rounds: not scored
    summary = keeper.summary()
    assert summary["best_round_personal"] == {"a": 1, "b": 2}
    assert summary["best_round"] == 2
    swapped = keeper.substitute(FedSMLike(), state(0, 0), [])
    assert [swapped[k]["q"].item() for k in ("global", "personal/a", "personal/b")] == [1.0, 1.0, 1.0]


def test_simulation_evaluates_the_best_round_and_reports_it(tmp_path):
    """Through the real simulation: the evaluated model is the kept one, and the report says which round."""
    from engine.simulate import Simulation, SimulationConfig

    class Sites(Simulation):
        def load_sites(self) -> None:
            from engine.data.site_data import SiteData

            self.sites = [SiteData(f"s{k}", random_split(4, seed=k), random_split(2, seed=10 + k),
                                   random_split(2, seed=20 + k)) for k in range(2)]

    cfg = SimulationConfig(sites=2, rounds=3, methods=("fedavg", "local"), image_size=32, batch_size=4,
                           device="cpu", lr_schedule="cosine")
    sim = Sites(cfg, tmp_path)
    sim.load_sites()
    result = sim.run_method("fedavg")
    assert result.best_round in (1, 2, 3)
    curve = result.model_selection["curve"]
    assert [p["round"] for p in curve] == [1, 2, 3]
    assert result.model_selection["best_val_dice"] == pytest.approx(max(p["global"] for p in curve))
    local = sim.run_method("local")
    assert set(local.model_selection["best_round_personal"]) == {"s0", "s1"}
    cross = local.extra["cross_site"]
    assert set(cross["per_model"]) == {"s0", "s1"}
    assert 0.0 <= cross["client_average"]["mean"] <= 1.0
