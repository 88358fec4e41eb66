"""The reference-style selector step, its server-side moment averaging, temperature scaling and ECE."""

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError, WeightsError
from engine.fl.local_training import RoundContext
from engine.fl.methods import FedSM, SiteUpdate
from engine.fl.selector_schemes import default_selector_lr
from engine.fl.selector_training import (
    TEMPERATURE_GRID,
    adam_step_from_state,
    apply_temperature,
    confidence_summary,
    expected_calibration_error,
    fit_temperature,
    initial_optimizer_state,
    reference_selector_round,
    temperature_statistics,
)
from engine.tasks import FUNDUS


def _softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_summed_gradient_and_one_adam_step_match_hand_computation():
    # a 2-in, 2-class linear "selector"; two batches of one site's images, label 1
    net = torch.nn.Linear(2, 2)
    w0 = np.array([[0.5, -0.25], [0.125, 0.75]])
    b0 = np.array([0.1, -0.2])
    with torch.no_grad():
        net.weight.copy_(torch.tensor(w0, dtype=torch.float32))
        net.bias.copy_(torch.tensor(b0, dtype=torch.float32))
    batches = [np.array([[1.0, 2.0], [0.0, -1.0]]), np.array([[3.0, 1.0]])]
    label = 1
    net.zero_grad()
    for x in batches:
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x, dtype=torch.float32)),
                                                 torch.full((len(x),), label))
        loss.backward()
    # by hand: d(mean CE)/dz = (softmax - onehot) / batch; dW = dz^T x, db = sum dz; summed over batches
    gw = np.zeros((2, 2))
    gb = np.zeros(2)
    for x in batches:
        dz = (_softmax(x @ w0.T + b0) - np.eye(2)[label]) / len(x)
        gw += dz.T @ x
        gb += dz.sum(0)
    assert np.allclose(net.weight.grad.numpy(), gw, atol=1e-6)
    assert np.allclose(net.bias.grad.numpy(), gb, atol=1e-6)

    # Adam from averaged moments at step 3 (the server's state), one step
    m_w, v_w = np.full((2, 2), 0.01), np.full((2, 2), 0.002)
    m_b, v_b = np.array([0.02, -0.01]), np.array([0.001, 0.003])
    state = {"step": torch.tensor([3.0]), "exp_avg.weight": torch.tensor(m_w, dtype=torch.float32),
             "exp_avg_sq.weight": torch.tensor(v_w, dtype=torch.float32),
             "exp_avg.bias": torch.tensor(m_b, dtype=torch.float32),
             "exp_avg_sq.bias": torch.tensor(v_b, dtype=torch.float32)}
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    new = adam_step_from_state(net, state, lr)
    for name, w, g, m, v in (("weight", w0, gw, m_w, v_w), ("bias", b0, gb, m_b, v_b)):
        m1 = b1 * m + (1 - b1) * g
        v1 = b2 * v + (1 - b2) * g * g
        expected = w - lr * (m1 / (1 - b1 ** 4)) / (np.sqrt(v1 / (1 - b2 ** 4)) + eps)
        assert np.allclose(getattr(net, name).detach().numpy(), expected, atol=1e-6), name
        assert np.allclose(new[f"exp_avg.{name}"].numpy(), m1, atol=1e-7)
        assert np.allclose(new[f"exp_avg_sq.{name}"].numpy(), v1, atol=1e-8)
    assert float(new["step"][0]) == 4.0


def test_first_step_from_zero_state_is_plain_adam():
    net = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    for m in (net, ref):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    adam_step_from_state(net, initial_optimizer_state(net), 1e-3)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt.step()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)


def test_state_of_another_network_is_refused():
    net = torch.nn.Linear(3, 2)
    with pytest.raises(WeightsError, match="does not belong"):
        adam_step_from_state(net, {"step": torch.zeros(1)}, 1e-3)


def test_site_round_takes_exactly_one_step(tiny_training):
    method = FedSM(FUNDUS, ["a", "b"], tiny_training, lam=0.5)
    state = method.initial_state()
    data = random_split(10, seed=1)  # 10 images, batch 4: three batches, still ONE step
    lr = tiny_training.selector_lr
    weights, optim, metrics = reference_selector_round(
        FUNDUS, state["selector"], state["selector_optim"], np.full(10, 1), 2, data.images, tiny_training, 0,
        RoundContext("fedsm", 1, "b"))
    assert float(optim["step"][0]) == 1.0
    # Adam's first step from zero moments moves every parameter with a gradient by lr * sign(g)
    # (|m_hat / sqrt(v_hat)| = 1); a second step could move it by up to 2 lr
    params = dict(method._selector_template().named_parameters())
    moved = [float((weights[k] - state["selector"][k]).abs().max()) for k in params]
    assert max(moved) <= lr * (1 + 1e-3)
    assert sum(m > 0.5 * lr for m in moved) >= len(moved) // 2
    assert 0.0 <= metrics["selector_accuracy"] <= 1.0 and metrics["loss_selector"] > 0


def test_server_averages_adam_moments_with_the_weights(tiny_training):
    method = FedSM(FUNDUS, ["a", "b"], tiny_training, lam=0.5)
    state = method.initial_state()

    def update(value: float, n: int) -> SiteUpdate:
        optim = {k: torch.full_like(v, value) for k, v in state["selector_optim"].items()}
        optim["step"] = torch.tensor([1.0])
        sel = {k: (torch.full_like(v, value) if v.dtype.is_floating_point else v) for k, v in state["selector"].items()}
        return SiteUpdate({"global": state["global"], "personal": state["personal/a"], "selector": sel,
                           "selector_optim": optim}, n)

    new = method.aggregate(state, 1, {"a": update(1.0, 1), "b": update(4.0, 3)})
    # weighted by sample counts 1:3 -> 0.25 * 1 + 0.75 * 4 = 3.25, for moments and weights alike
    for key, value in new["selector_optim"].items():
        expected = 1.0 if key == "step" else 3.25
        assert torch.allclose(value, torch.full_like(value, expected)), key
    assert torch.allclose(new["selector"]["classifier.3.bias"], torch.full((2,), 3.25))


def test_temperature_fit_recovers_the_sharpening_and_folds_into_the_last_layer():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 400)
    true_logits = rng.normal(size=(400, 3)) + 2.0 * np.eye(3)[labels]
    # the selector's logits are 4x too flat: the best temperature is about 1/4
    sampled = np.array([rng.choice(3, p=p) for p in _softmax(true_logits)])
    stats = temperature_statistics(torch.tensor(true_logits / 4.0), sampled)
    t = fit_temperature([stats])
    assert 0.18 < t < 0.35
    assert set(stats) == {"nll", "count"} and stats["nll"].shape == (len(TEMPERATURE_GRID),)
    w = {"w": torch.ones(3, 2), "b": torch.ones(3), "other": torch.ones(1)}
    scaled = apply_temperature(w, "w", "b", 0.5)
    assert torch.equal(scaled["w"], torch.full((3, 2), 2.0)) and torch.equal(scaled["other"], w["other"])
    with pytest.raises(ConfigError):
        apply_temperature(w, "w", "b", 0.0)


def test_ece_and_confidence_summary():
    probs = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.6, 0.4]])
    labels = np.array([0, 1, 0, 0])
    # bin 0.9: accuracy 0.5 vs 0.9 -> 0.4; bin 0.6: accuracy 1.0 vs 0.6 -> 0.4; ECE = 0.4
    assert expected_calibration_error(probs, labels) == pytest.approx(0.4)
    assert expected_calibration_error(np.array([[1.0, 0.0]]), np.array([0])) == pytest.approx(0.0)
    summary = confidence_summary(probs.max(1))
    assert summary["n"] == 4 and summary["quantiles"]["median"] == pytest.approx(0.75)
    assert sum(summary["histogram"]["counts"]) == 4
    # the paper's rate at the paper's width; the measured 3e-3 for narrower reference selectors; lda keeps 1e-5
    assert default_selector_lr("none", None, 64) == 1e-3 and default_selector_lr("temperature", None, 64) == 1e-3
    assert default_selector_lr("none", None, 16) == 3e-3 and default_selector_lr("temperature", None, 8) == 3e-3
    assert default_selector_lr("lda", None, 16) == 1e-5 and default_selector_lr("lda", None, 64) == 1e-5
    assert default_selector_lr("lda", 0.01, 16) == 0.01 and default_selector_lr("none", 2e-4, 16) == 2e-4


def test_batch_statistics_mode_survives_a_lone_last_image(tiny_training):
    from dataclasses import replace

    cfg = replace(tiny_training, selector_bn="batch")
    method = FedSM(FUNDUS, ["a", "b"], cfg, lam=0.5)
    state = method.initial_state()
    for n in (5, 1):  # batch 4: batches of 4 and 1 -> one batch of 5; a single image: running statistics
        data = random_split(n, seed=2)
        weights, optim, _ = reference_selector_round(
            FUNDUS, state["selector"], state["selector_optim"], np.zeros(n), 2, data.images, cfg, 0,
            RoundContext("fedsm", 1, "a"))
        assert float(optim["step"][0]) == 1.0
        assert all(bool(torch.isfinite(v).all()) for v in weights.values() if v.dtype.is_floating_point)


def test_best_round_keeper_skips_warmup_rounds_and_substitutes_after_training(tiny_training):
    from engine.fl.model_selection import is_training_round, last_training_round

    method = FedSM(FUNDUS, ["a", "b"], tiny_training, lam=0.5, rounds=2, selector_warmup=3)
    assert [method.phase(r) for r in range(1, 7)] == ["selector"] * 3 + ["train"] * 2 + ["calibrate"]
    assert [is_training_round(method, r) for r in range(1, 7)] == [False] * 3 + [True] * 2 + [False]
    assert last_training_round(method) == 5
    with pytest.raises(ConfigError, match="warm-up"):
        FedSM(FUNDUS, ["a", "b"], tiny_training, lam=0.5, selector_calibration="lda", selector_warmup=1)


def test_fresh_batchnorm_statistics_forget_the_incoming_ones(tiny_training):
    from dataclasses import replace

    from engine.fl.selector_training import refresh_batchnorm_statistics

    bn = torch.nn.BatchNorm1d(2)
    bn.running_mean.fill_(100.0)
    refresh_batchnorm_statistics(bn)
    bn.train()
    a, b = torch.tensor([[0.0, 1.0], [2.0, 3.0]]), torch.tensor([[4.0, 1.0], [6.0, 5.0], [8.0, 3.0]])
    bn(a)
    bn(b)
    # cumulative average of the two batches' statistics (unbiased variances), nothing of the old 100
    assert torch.allclose(bn.running_mean, (a.mean(0) + b.mean(0)) / 2)
    assert torch.allclose(bn.running_var, (a.var(0) + b.var(0)) / 2)

    method = FedSM(FUNDUS, ["a", "b"], replace(tiny_training, selector_bn="fresh"), lam=0.5)
    state = method.initial_state()
    data = random_split(6, seed=2)
    stale = {k: (v + 50.0 if k.endswith("running_mean") else v) for k, v in state["selector"].items()}
    outs = [reference_selector_round(FUNDUS, weights, state["selector_optim"], np.zeros(6, dtype=int), 2, data.images,
                                     replace(tiny_training, selector_bn="fresh"), 0, RoundContext("fedsm", 1, "a"))[0]
            for weights in (state["selector"], stale)]
    means = [k for k in outs[0] if k.endswith("running_mean")]
    assert means and all(torch.allclose(outs[0][k], outs[1][k]) for k in means)
    with pytest.raises(ConfigError, match="selector_bn"):
        replace(tiny_training, selector_bn="frozen")
