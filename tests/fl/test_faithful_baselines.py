"""The baselines behave as their papers define them (issue 15, item 4)."""

from __future__ import annotations

import pytest
import torch
from testsupport import random_split

from engine.fl.local_training import LocalTrainingConfig
from engine.fl.personalization import PersonalizationConfig, train_personalized_round
from engine.tasks import FUNDUS


def _ctx():
    from engine.fl.local_training import RoundContext

    return RoundContext("fedsm", 1, "a")


def _weights(seed: int):
    from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH
    from engine.fl.weights import model_weights
    from engine.models import build_segmentation_net, build_selector

    torch.manual_seed(seed)
    return {"global": model_weights(build_segmentation_net(3, 2)),
            "selector": model_weights(build_selector(3, 2, width=DEFAULT_SELECTOR_WIDTH))}


def _max_distance(a, b) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.fixture
def cfg():
    return LocalTrainingConfig(epochs=1, batch_size=4, lr=1e-3, selector_lr=1e-4, device="cpu")


def test_pfedme_theta_starts_each_round_at_the_received_model(cfg):
    """pFedMe's code resets the personalized model to the new global model every round."""
    data = random_split(4, seed=3)
    received = _weights(1)
    received["personal"] = _weights(2)["global"]
    # a stale theta from an earlier round, far from the received model
    stale = {k: (v + 5.0 if v.is_floating_point() else v) for k, v in received["personal"].items()}
    state = {"pfedme_theta": stale}
    pcfg = PersonalizationConfig(pfedme_inner_steps=1)
    train_personalized_round("pfedme", FUNDUS, received, 0, 2, data, cfg, pcfg, state, 0, _ctx())
    theta = state["pfedme_theta"]
    # one batch, one inner Adam step: theta moved at most ~lr from the received model
    assert _max_distance(theta, received["personal"]) < 5 * cfg.lr
    assert _max_distance(theta, stale) > 4.0


@pytest.mark.parametrize("outer", ["adam", "sgd"])
def test_pfedme_local_model_step_by_hand(cfg, outer):
    """One batch, one inner step. theta starts at the received w, so its first Adam step moves each
    parameter by lr (the proximal term is zero there). The envelope gradient lam (w - theta) is then
    +-lam lr per parameter: Adam's first step moves w by lr towards theta, i.e. onto it; the paper's
    step moves it eta lam = 0.075 of the way."""
    data = random_split(4, seed=3)
    received = _weights(1)
    received["personal"] = _weights(2)["global"]
    pcfg = PersonalizationConfig(pfedme_inner_steps=1, pfedme_outer=outer, pfedme_lam=15.0, pfedme_eta=0.005)
    state: dict = {}
    parts, _ = train_personalized_round("pfedme", FUNDUS, received, 0, 2, data, cfg, pcfg, state, 0, _ctx())
    w, theta, start = parts["personal"], state["pfedme_theta"], received["personal"]
    keys = [k for k in start if start[k].is_floating_point()]
    step = torch.cat([(theta[k] - start[k]).flatten() for k in keys]).double()
    w_step = torch.cat([(w[k] - start[k]).flatten() for k in keys]).double()
    # Adam's first step is lr * g / (|g| + eps): lr for every parameter whose gradient is not tiny
    full = (step.abs() - cfg.lr).abs() < 0.01 * cfg.lr
    assert full.float().mean() > 0.95
    expected = step if outer == "adam" else 0.075 * step
    assert torch.allclose(w_step[full], expected[full], atol=0.02 * cfg.lr)


def _apfl_private_step(alpha: float, optimizer: str, cfg) -> float:
    data = random_split(4, seed=4)
    received = _weights(1)
    state = {"apfl_alpha": {"alpha": torch.tensor([alpha], dtype=torch.float64)}}
    pcfg = PersonalizationConfig(apfl_v_optimizer=optimizer, apfl_v_lr=0.1, apfl_alpha_lr=1e-9)
    train_personalized_round("apfl", FUNDUS, received, 0, 2, data, cfg, pcfg, state, 0, _ctx())
    v = state["apfl_v"]
    return float(sum(((v[k] - received["global"][k]) ** 2).sum() for k in v if v[k].is_floating_point()) ** 0.5)


def test_apfl_private_step_scales_with_alpha_under_sgd(cfg):
    """grad_v = alpha * grad f(vbar): with SGD the step is proportional to alpha (Adam would cancel it)."""
    # v starts at the global model, so vbar = w whatever alpha is and grad f(vbar) is the same
    small, large = _apfl_private_step(0.2, "sgd", cfg), _apfl_private_step(0.8, "sgd", cfg)
    assert small / large == pytest.approx(0.25, rel=1e-3)
    adam_small, adam_large = _apfl_private_step(0.2, "adam", cfg), _apfl_private_step(0.8, "adam", cfg)
    assert adam_small / adam_large == pytest.approx(1.0, abs=0.05)


def test_per_fedavg_uses_two_different_full_batches(cfg, monkeypatch):
    from engine.fl import personalization as p

    seen = []
    real = p.first_order_maml_gradient

    def spy(net, loss_fn, batch_a, batch_b, inner_lr):
        seen.append((batch_a[0].clone(), batch_b[0].clone()))
        return real(net, loss_fn, batch_a, batch_b, inner_lr)

    monkeypatch.setattr(p, "first_order_maml_gradient", spy)
    received = _weights(1)
    received["personal"] = received["global"]
    train_personalized_round("perfedavg", FUNDUS, received, 0, 2, random_split(8, seed=5), cfg,
                             PersonalizationConfig(), {}, 0, _ctx())
    assert len(seen) == 2  # 8 images, batch 4
    for a, b in seen:
        assert len(a) == len(b) == cfg.batch_size
        assert not torch.equal(a, b)


def test_fedsm_extra_fits_lda_with_empirical_priors(tiny_training):
    from engine.fl.methods import FedSM, FedSMExtra, SiteUpdate, empirical_log_priors
    from engine.fl.selector_calibration import class_statistics, final_layer_keys

    extra = FedSMExtra(FUNDUS, ["a", "b"], tiny_training, rounds=1, extra_rounds=1, lam=0.5)
    state = extra.initial_state()
    gen = torch.Generator().manual_seed(0)
    dim = extra._selector_template().classifier[-1].in_features
    feats = torch.randn(40, dim, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0] * 30 + [1] * 6 + [2] * 4).numpy()  # the global model wins most images
    stats = class_statistics(feats, labels, 3)
    updates = {"a": SiteUpdate({"selector_stats": stats}, 40)}
    with_priors = extra._calibrate(state, updates)["selector"]
    uniform = FedSM._calibrate(extra, state, updates)["selector"]
    _, bias_key = final_layer_keys(extra._selector_template())
    diff = with_priors[bias_key].double() - uniform[bias_key].double()
    expected = torch.log(torch.tensor([30 / 40, 6 / 40, 4 / 40], dtype=torch.float64))
    assert torch.allclose(diff, expected, atol=1e-5)
    assert torch.allclose(empirical_log_priors(torch.tensor([2.0, 0.0, 2.0])),
                          torch.tensor([-0.6931472, 0.0, -0.6931472], dtype=torch.float64), atol=1e-6)


def test_fedsm_extra_defaults_to_half_the_rounds():
    from engine.federation.spec import MethodSpec
    from engine.simulate import SimulationConfig

    assert SimulationConfig(rounds=100).extra_rounds == 50
    assert SimulationConfig(rounds=5).extra_rounds == 3
    assert MethodSpec("fedsm-extra", "fundus", ("a", "b", "c"), rounds=100).total_rounds == 151


def _dice_loss_grads(weights, data, loss_name="dice"):
    """Gradient of the Dice loss of a U-Net with ``weights`` on all of ``data`` at once (one batch)."""
    from engine.fl.local_training import segmentation_loss
    from engine.models import build_segmentation_net

    net = build_segmentation_net(3, 2)
    net.load_state_dict(weights)
    net.train()
    loss = segmentation_loss(loss_name)(net(torch.from_numpy(data.images)), torch.from_numpy(data.masks))
    params = dict(net.named_parameters())
    return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))


def test_per_fedavg_personalized_model_is_one_gradient_step_from_the_meta_model(cfg):
    """Per-FedAvg's personalized model: ``theta - inner_lr * grad f(theta; site's training data)``."""
    from engine.fl.personalization import personalized_model

    data = random_split(4, seed=5)  # one batch of 4: the full-data gradient is this batch's
    meta = _weights(3)["global"]
    pcfg = PersonalizationConfig(inner_lr=0.05, adapt_steps=1)
    out = personalized_model("perfedavg", FUNDUS, {"global": _weights(1)["global"], "personal": meta}, data, cfg,
                             pcfg, {}, 0, _ctx())
    grads = _dice_loss_grads(meta, data)
    for name, g in grads.items():
        assert torch.allclose(out[name], meta[name] - 0.05 * g, atol=1e-6), name


def test_finetune_first_step_is_adams_first_step_on_the_global_model(cfg):
    """Fine-tuning one epoch of one batch: Adam's first step moves each weight by lr against its gradient's sign."""
    from engine.fl.personalization import personalized_model

    data = random_split(4, seed=6)
    glob = _weights(2)["global"]
    out = personalized_model("finetune", FUNDUS, {"global": glob}, data, cfg, PersonalizationConfig(finetune_epochs=1),
                             {}, 0, _ctx())
    grads = _dice_loss_grads(glob, data)
    for name, g in grads.items():
        clear = g.abs() > 1e-6  # Adam's first step is lr * g / (|g| + eps): the full lr where g is not tiny
        expected = glob[name] - cfg.lr * torch.sign(g)
        assert torch.allclose(out[name][clear], expected[clear], atol=0.02 * cfg.lr), name


def test_the_guard_judges_an_apfl_super_model_by_the_mixture_the_site_built(tiny_training):
    """With APFL the last round scores the site's mixture ``alpha v + (1 - alpha) w`` against the global model,
    and the bundle's guard decides on those numbers."""
    import numpy as np

    from engine.federation.inprocess import run_rounds
    from engine.fl.evaluation import dice_per_case, segment_with
    from engine.fl.methods import FedSM, SiteRuntime
    from engine.inference.guard import guard_decisions, site_validation_from_state

    sites = [SiteRuntime("a", 0, random_split(4, seed=1), validation=random_split(3, seed=7)),
             SiteRuntime("b", 1, random_split(4, seed=2, shift=0.4), validation=random_split(3, seed=8, shift=0.4))]
    method = FedSM(FUNDUS, ["a", "b"], tiny_training, seed=0, rounds=2, lam=0.5, personalization="apfl")
    state, _ = run_rounds(method, sites, method.total_rounds)
    recorded = site_validation_from_state(state, ["a", "b"])
    for site in sites:
        val = site.validation
        for which, weights in (("personal", state[f"personal/{site.name}"]), ("global", state["global"])):
            masks = segment_with(FUNDUS, weights, val.images, "cpu")
            expected = float(np.mean(dice_per_case(masks, val.masks, val.case_ids).mean(axis=1)))
            assert recorded[site.name][which] == pytest.approx(expected, abs=1e-6)
        assert recorded[site.name]["cases"] == 3
    decisions = guard_decisions(["a", "b"], recorded)
    for decision in decisions:
        scores = recorded[decision.site]
        if decision.allowed:
            assert scores["personal"] > scores["global"]
        assert decision.site in decision.why
