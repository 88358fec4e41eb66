"""Aggregation rules against hand-computed values."""

import pytest
import torch

from engine.errors import ConfigError, WeightsError
from engine.fl.aggregation import (
    check_lam,
    fedavg,
    proximal_penalty,
    scaffold_server_update,
    scaffold_site_control,
    soft_pull,
)


def w(*values: float) -> dict[str, torch.Tensor]:
    return {"a": torch.tensor(list(values), dtype=torch.float32)}


def test_fedavg_weights_by_sample_count():
    # Prepare: (1,2) with n=1 and (4,8) with n=3 -> 1/4*(1,2) + 3/4*(4,8) = (3.25, 6.5)
    updates = [(w(1.0, 2.0), 1), (w(4.0, 8.0), 3)]
    # Execute
    out = fedavg(updates)
    # Assert
    assert torch.allclose(out["a"], torch.tensor([3.25, 6.5]))
    assert out["a"].dtype == torch.float32


def test_fedavg_keeps_integer_buffers_integer():
    a = {"n": torch.tensor(10, dtype=torch.int64)}
    b = {"n": torch.tensor(21, dtype=torch.int64)}
    out = fedavg([(a, 1), (b, 1)])
    assert out["n"].dtype == torch.int64
    assert int(out["n"]) == 16  # round(15.5) to even -> 16


def test_fedavg_rejects_empty_and_zero_samples():
    with pytest.raises(WeightsError):
        fedavg([])
    with pytest.raises(WeightsError):
        fedavg([(w(1.0), 0)])


def test_soft_pull_with_lam_one_over_k_is_the_unweighted_mean():
    models = {"s1": w(0.0, 3.0), "s2": w(3.0, 6.0), "s3": w(6.0, 0.0)}
    out = soft_pull(models, lam=1 / 3)
    for name in models:
        assert torch.allclose(out[name]["a"], torch.tensor([3.0, 3.0]))


def test_soft_pull_with_lam_one_keeps_each_model():
    models = {"s1": w(1.0), "s2": w(5.0), "s3": w(9.0)}
    out = soft_pull(models, lam=1.0)
    for name, weights in models.items():
        assert torch.equal(out[name]["a"], weights["a"])


def test_soft_pull_hand_computed_lam_0_7():
    # s1 <- 0.7*1 + 0.3/2*(5+9) = 0.7 + 2.1 = 2.8
    models = {"s1": w(1.0), "s2": w(5.0), "s3": w(9.0)}
    out = soft_pull(models, lam=0.7)
    assert out["s1"]["a"].item() == pytest.approx(2.8, abs=1e-6)
    assert out["s2"]["a"].item() == pytest.approx(0.7 * 5 + 0.15 * 10, abs=1e-6)
    assert out["s3"]["a"].item() == pytest.approx(0.7 * 9 + 0.15 * 6, abs=1e-6)


def test_soft_pull_one_responding_site_is_unchanged():
    out = soft_pull({"only": w(2.0, -3.0)}, lam=0.3)
    assert torch.equal(out["only"]["a"], torch.tensor([2.0, -3.0]))


def test_lam_range_checked_against_k():
    check_lam(1 / 3, 3)
    check_lam(1.0, 3)
    with pytest.raises(ConfigError, match=r"\[1/K, 1\]"):
        check_lam(0.2, 3)
    with pytest.raises(ConfigError):
        check_lam(1.1, 3)


def test_fedprox_gradient_is_mu_times_distance():
    # Prepare: one parameter vector w = (1, 2), anchor (0, 4), mu = 0.5
    net = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 2.0]]))
    anchor = {"weight": torch.tensor([[0.0, 4.0]])}
    # Execute
    penalty = proximal_penalty(net, anchor, mu=0.5)
    penalty.backward()
    # Assert: value mu/2 * (1 + 4) = 1.25, gradient mu * (w - anchor) = (0.5, -1.0)
    assert penalty.item() == pytest.approx(1.25)
    assert torch.allclose(net.weight.grad, torch.tensor([[0.5, -1.0]]))


def test_scaffold_site_control_is_the_mean_gradient():
    # c_k+ = (sum of the round's uncorrected gradients) / steps = (3, -6)/3 = (1, -2), whatever c_k was
    out = scaffold_site_control(w(3.0, -6.0), 3, site_control=w(10.0, 10.0))
    assert torch.allclose(out["a"], torch.tensor([1.0, -2.0]))


def test_scaffold_site_control_without_gradients_keeps_c_k_and_checks_keys():
    kept = scaffold_site_control(w(5.0), 0, site_control=w(0.25))
    assert kept["a"].item() == pytest.approx(0.25)
    with pytest.raises(WeightsError):
        scaffold_site_control({"b": torch.zeros(1)}, 1, site_control=w(0.0))
    with pytest.raises(ConfigError):
        scaffold_site_control(w(1.0), -1, site_control=w(0.0))


def test_scaffold_server_control_uses_all_sites_in_denominator():
    # c + (1/N) * sum(deltas) with N = 4 sites, 2 answered: 1 + (2 + 6)/4 = 3
    out = scaffold_server_update(w(1.0), [w(2.0), w(6.0)], num_sites=4)
    assert out["a"].item() == pytest.approx(3.0)
