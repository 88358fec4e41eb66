"""Personalization alternatives inside FedSM: update rules against hand-computed values, and one
federated run per alternative through the real in-process transport."""

from __future__ import annotations

import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError
from engine.fl.personalization import (
    PersonalizationConfig,
    apfl_alpha_step,
    apfl_gradients,
    apfl_mix,
    apfl_model_now,
    first_order_maml_gradient,
    pfedme_envelope_gradient,
    pfedme_local_update,
    pfedme_objective,
    pfedme_server_update,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- APFL ------------------------------------------------------------------------------------
def test_apfl_mix_is_convex_combination():
    # Prepare
    v, w = {"a": t(1.0, 2.0)}, {"a": t(3.0, 4.0)}
    # Execute
    mixed = apfl_mix(v, w, 0.25)
    # Assert: 0.25 * [1, 2] + 0.75 * [3, 4]
    assert torch.allclose(mixed["a"], t(2.5, 3.5))


def test_apfl_model_now_mixes_the_kept_private_model_with_the_given_global_one():
    # Prepare: v = 1 and the kept alpha 0.25; the global model 0 (the configured alpha, 0.5, is unused)
    state = {"apfl_v": {"w": t(1.0, 1.0)}, "apfl_alpha": {"alpha": torch.tensor([0.25], dtype=torch.float64)}}
    # Execute / Assert: 0.25 * 1 + 0.75 * 0
    assert torch.allclose(apfl_model_now(state, {"w": t(0.0, 4.0)}, 0.5)["w"], t(0.25, 3.25))
    # before the site's first round: the configured alpha; without v: nothing to build
    assert torch.allclose(apfl_model_now({"apfl_v": {"w": t(2.0)}}, {"w": t(0.0)}, 0.5)["w"], t(1.0))
    assert apfl_model_now({}, {"w": t(0.0)}, 0.5) is None


def test_apfl_gradients_by_hand():
    v, w, g = {"a": t(1.0, 2.0)}, {"a": t(3.0, 4.0)}, {"a": t(0.5, -1.0)}
    grad_v, grad_alpha = apfl_gradients(v, w, 0.25, g)
    assert torch.allclose(grad_v["a"], t(0.125, -0.25))  # alpha * g
    assert grad_alpha == pytest.approx((1 - 3) * 0.5 + (2 - 4) * -1.0)  # <v - w, g> = 1


@pytest.mark.parametrize(("alpha", "grad", "expected"), [(0.5, 1.0, 0.4), (0.05, 1.0, 0.0), (0.95, -1.0, 1.0)])
def test_apfl_alpha_step_is_clipped_to_unit_interval(alpha, grad, expected):
    assert apfl_alpha_step(alpha, grad, 0.1) == pytest.approx(expected)


# --- pFedMe -----------------------------------------------------------------------------------
def test_pfedme_local_update_moves_towards_theta():
    # w - eta * lam * (w - theta) = [1, 1] - 0.075 * ([1, 1] - [0, 2])
    out = pfedme_local_update({"a": t(1.0, 1.0)}, {"a": t(0.0, 2.0)}, lam=15.0, eta=0.005)
    assert torch.allclose(out["a"], t(0.925, 1.075))


def test_pfedme_envelope_gradient_by_hand():
    # lam * (w - theta) = 15 * ([1, 1] - [0, 2]); the paper's step is w - eta * this
    grad = pfedme_envelope_gradient({"a": t(1.0, 1.0)}, {"a": t(0.0, 2.0)}, lam=15.0)
    assert torch.allclose(grad["a"], t(15.0, -15.0))
    step = pfedme_local_update({"a": t(1.0, 1.0)}, {"a": t(0.0, 2.0)}, lam=15.0, eta=0.005)
    assert torch.allclose(step["a"], t(1.0, 1.0) - 0.005 * grad["a"])


@pytest.mark.parametrize(("beta", "expected"), [(1.0, 3.0), (0.5, 1.5)])
def test_pfedme_server_update(beta, expected):
    out = pfedme_server_update({"a": t(0.0)}, [{"a": t(2.0)}, {"a": t(4.0)}], beta)
    assert torch.allclose(out["a"], t(expected))


def test_pfedme_server_update_without_answers_keeps_model():
    server = {"a": t(7.0)}
    assert torch.equal(pfedme_server_update(server, [], 1.0)["a"], server["a"])


def test_pfedme_objective_adds_proximal_term():
    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(3.0)
    value = pfedme_objective(net, torch.tensor(0.5), {"weight": torch.tensor([[1.0]])}, lam=2.0)
    assert float(value.detach()) == pytest.approx(0.5 + 0.5 * 2.0 * (3.0 - 1.0) ** 2)


# --- Per-FedAvg ---------------------------------------------------------------------------------
def test_first_order_maml_gradient_by_hand():
    # f(a; x, y) = (a x - y)^2 with a = 0. Batch A (x=1, y=2): grad = 2 (a x - y) x = -4, so the
    # adapted a' = 0 - 0.1 * -4 = 0.4. Batch B (x=2, y=2): grad at a' = 2 (0.8 - 2) 2 = -4.8.
    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.zero_()

    def loss(forward, batch):
        x, y = batch
        return ((forward(x) - y) ** 2).mean()

    grads = first_order_maml_gradient(net, loss, (t(1.0)[:, None], t(2.0)[:, None]),
                                      (t(2.0)[:, None], t(2.0)[:, None]), inner_lr=0.1)
    assert grads["weight"].item() == pytest.approx(-4.8)
    assert net.weight.item() == 0.0  # the network itself is untouched


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError):
        PersonalizationConfig(apfl_alpha=1.5)
    with pytest.raises(ConfigError):
        PersonalizationConfig(pfedme_inner_steps=0)
    with pytest.raises(ConfigError, match="pfedme_outer"):
        PersonalizationConfig(pfedme_outer="rmsprop")


# --- whole method through the in-process transport --------------------------------------------
def _run(kind: str, tiny_training, **options):
    from engine.federation.inprocess import run_rounds
    from engine.fl.methods import FedSM, SiteRuntime
    from engine.tasks import FUNDUS

    sites = [SiteRuntime("a", 0, random_split(4, seed=1), validation=random_split(2, seed=3)),
             SiteRuntime("b", 1, random_split(4, seed=2, shift=0.4), validation=random_split(2, seed=4, shift=0.4))]
    method = FedSM(FUNDUS, ["a", "b"], tiny_training, seed=0, rounds=1, lam=0.5, personalization=kind, **options)
    initial = method.initial_state()
    state, records = run_rounds(method, sites, method.total_rounds)
    return method, sites, initial, state, records


@pytest.mark.parametrize("kind", ["finetune", "apfl", "perfedavg", "pfedme"])
def test_each_alternative_trains_and_fills_the_super_model(kind, tiny_training):
    """Every rule goes through FedSM's one path: reference selector, style gate, validation Dice for the guard."""
    method, sites, initial, state, records = _run(kind, tiny_training, style_gate=0.95)
    assert all(not r.failed for r in records), [r.failed for r in records]
    assert method.name == "fedsm" and method.total_rounds == 2 and method.reference_selector
    assert "style_gate" in state and "selector_optim" in state
    for site in sites:
        personal = state[f"personal/{site.name}"]
        assert set(personal) == set(initial["global"])
        assert all(torch.isfinite(v).all() for v in personal.values())
        assert any(not torch.equal(personal[k], initial["global"][k]) for k in personal)
        # the last round scored the site's own personalized model for the routing guard
        assert f"{site.name}.personal" in state["validation_dice"]
    if kind == "apfl":
        for site in sites:  # the personalized model is the final mixture alpha v + (1 - alpha) w_global
            alpha = float(site.state["apfl_alpha"]["alpha"][0])
            expected = apfl_mix(site.state["apfl_v"], state["global"], alpha)
            assert all(torch.allclose(state[f"personal/{site.name}"][k], expected[k]) for k in expected)
    if kind == "pfedme":
        for site in sites:  # theta stays at the site during training and is the personalized model
            assert all(torch.equal(state[f"personal/{site.name}"][k], site.state["pfedme_theta"][k])
                       for k in site.state["pfedme_theta"])
    if kind in ("finetune", "apfl"):
        assert "shared" not in state
    else:
        assert "shared" in state


def test_training_round_sends_no_private_model(tiny_training):
    from engine.federation.inprocess import weightset_bytes
    from engine.fl.methods import FedSM
    from engine.tasks import FUNDUS

    method = FedSM(FUNDUS, ["a", "b"], tiny_training, seed=0, rounds=1, lam=0.5, personalization="apfl")
    state = method.initial_state()
    sent = method.site_instructions(state, 1, "a").weights
    assert set(sent) == {"global", "selector", "selector_optim"}
    assert weightset_bytes(sent) > 0
    assert not any(k.startswith("personal/") for k in state)


def test_last_round_answer_must_carry_the_personalized_model(tiny_training):
    from engine.fl.methods import FedSM, SiteUpdate
    from engine.tasks import FUNDUS

    method = FedSM(FUNDUS, ["a", "b"], tiny_training, seed=0, rounds=1, lam=0.5, personalization="apfl")
    state = method.initial_state()
    metrics = {"val_dice_global": 0.5, "val_dice_personal": 0.6}
    with pytest.raises(ConfigError, match="lacks its personalized model"):
        method.validate_update(state, "a", SiteUpdate({}, 4, metrics))
    bad = {k: v[..., :1] if v.dim() else v for k, v in state["global"].items()}
    with pytest.raises(Exception, match="personalized model from a"):
        method.validate_update(state, "a", SiteUpdate({"personal": bad}, 4, metrics))
    method.validate_update(state, "a", SiteUpdate({"personal": state["global"]}, 4, metrics))


def test_unknown_personalization_is_rejected(tiny_training):
    from engine.fl.methods import FedSM
    from engine.tasks import FUNDUS

    with pytest.raises(ConfigError, match="personalization"):
        FedSM(FUNDUS, ["a", "b"], tiny_training, lam=0.5, personalization="magic")


# --- the bench: every rule paired with FedAvg and Centralized, and the rule the evidence favours ------
def _avg(value: float, own: float = 0.5) -> dict:
    return {"client_average": {"mean": value}, "best_round": 7,
            "extra": {"routing": {"site1": {"global": 1 - own, "site1": own}}}}


def _bench_results(fundus: dict[str, list[float]], prostate: dict[str, list[float]]) -> dict:
    from engine.bench.cache import JobKey

    out = {}
    for task, table in (("fundus", fundus), ("prostate", prostate)):
        for method, values in table.items():
            analysis = "main" if method in ("fedavg", "centralized", "fedsm") else "personalization"
            for seed, v in enumerate(values):
                out[JobKey(task, analysis, method, seed)] = _avg(v)
    return out


def test_rule_rows_pair_each_rule_with_fedavg_and_centralized_per_seed():
    from engine.bench.tables import rule_paired_rows

    results = _bench_results({"fedavg": [0.50, 0.60], "centralized": [0.55, 0.58], "fedsm": [0.52, 0.59],
                              "fedsm-apfl": [0.70, 0.61]}, {})
    rows = {r["rule"]: r for r in rule_paired_rows(results, "fundus", ["apfl", "pfedme"])}
    assert rows["softpull"]["vs_fedavg"] == pytest.approx({0: 0.02, 1: -0.01})
    assert rows["apfl"]["vs_fedavg"] == pytest.approx({0: 0.20, 1: 0.01})
    assert rows["apfl"]["vs_centralized"] == pytest.approx({0: 0.15, 1: 0.03})
    assert rows["pfedme"]["seeds"] == [] and rows["pfedme"]["vs_fedavg"] == {}
    assert rows["apfl"]["best_round"] == {0: 7, 1: 7} and rows["apfl"]["own_share"][0] == pytest.approx(0.5)


def test_the_rule_chosen_is_the_best_paired_over_both_tasks_and_only_complete_rules_rank():
    from engine.bench.tables import choose_rule

    results = _bench_results(
        {"fedavg": [0.50, 0.60, 0.55], "fedsm": [0.51, 0.59, 0.56], "fedsm-apfl": [0.60, 0.65, 0.60],
         "fedsm-pfedme": [0.70, 0.70]},  # pfedme misses seed 2: not ranked
        {"fedavg": [0.80, 0.82, 0.81], "fedsm": [0.80, 0.82, 0.81], "fedsm-apfl": [0.79, 0.82, 0.80],
         "fedsm-pfedme": [0.9, 0.9, 0.9]})
    choice = choose_rule(results, ["fundus", "prostate"], ["apfl", "pfedme"])
    assert [r["rule"] for r in choice["ranked"]] == ["apfl", "softpull"] and choice["best"] == "apfl"
    apfl, softpull = choice["ranked"]
    assert apfl["per_task"]["fundus"] == pytest.approx(0.0667, abs=1e-4)
    assert apfl["per_task"]["prostate"] == pytest.approx(-0.0067, abs=1e-4)
    assert apfl["meets"] is False  # prostate seed 0 is 0.01 below FedAvg (the margin is 0.005)
    assert softpull["meets"] is False  # fundus seed 1 below FedAvg


def test_cpu_converged_gives_each_seed_its_own_data_and_runs_every_rule_on_the_main_seeds():
    from engine.bench.cache import JobKey
    from engine.bench.jobs import job_settings
    from engine.bench.plan import plan_jobs
    from engine.bench.presets import get_preset

    preset = get_preset("cpu-converged")
    assert [preset.data_seed_for(s) for s in (0, 1, 2)] == [0, 1, 2]
    jobs = plan_jobs(preset)
    for task in ("fundus", "prostate"):
        for rule in preset.personalizations:
            assert {k.seed for k in jobs if k.task == task and k.method == f"fedsm-{rule}"} == {0, 1, 2}
    tp = preset.task("fundus")
    assert job_settings(preset, tp, JobKey("fundus", "main", "fedavg", 2), "cpu")["data_seed"] == 2
    assert get_preset("cpu-small").data_seed_for(2) == 0  # the other presets keep one draw of the data


def test_a_rule_other_than_softpull_trains_after_selector_warmup_rounds_with_the_gate(tiny_training):
    """Warm-up answers (selector, its Adam state, style sums) are not mistaken for last-round answers."""
    from engine.federation.inprocess import run_rounds
    from engine.fl.methods import FedSM, SiteRuntime
    from engine.tasks import FUNDUS

    sites = [SiteRuntime("a", 0, random_split(4, seed=1), validation=random_split(2, seed=3)),
             SiteRuntime("b", 1, random_split(4, seed=2, shift=0.4), validation=random_split(2, seed=4, shift=0.4))]
    method = FedSM(FUNDUS, ["a", "b"], tiny_training, seed=0, rounds=1, lam=0.5, personalization="finetune",
                   selector_warmup=1, style_gate=0.95)
    state, records = run_rounds(method, sites, method.total_rounds)
    assert method.total_rounds == 3 and all(not r.failed for r in records), [r.failed for r in records]
    assert {"personal/a", "personal/b"} <= set(state)
