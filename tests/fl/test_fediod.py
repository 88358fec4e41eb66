"""FedIOD: the loss terms against hand-computed values, the DP step, the site's answers, a tiny run."""

import math

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError, FedSMError, WeightsError
from engine.federation.inprocess import run_exchange_rounds
from engine.fl import fediod_losses as L
from engine.fl.fediod import FedIOD, FedIODConfig, build_fediod
from engine.fl.fediod_privacy import PrivacySetting, clip_and_noise, epsilon_spent
from engine.fl.fediod_site import STATE_KEY, answer_gradient, answer_query
from engine.fl.methods import SiteRuntime
from engine.tasks import FUNDUS

LN2 = math.log(2.0)
H01 = -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))  # entropy of Bernoulli(0.1) = 0.325083...
LOGIT01 = math.log(0.1 / 0.9)


def const(value, shape=(1, 1, 2, 2, 2)):
    return torch.full(shape, value, dtype=torch.float64)


# --- loss terms -------------------------------------------------------------------------------
def test_entropy_matches_hand_values_and_is_stable_for_large_logits():
    assert float(L.bernoulli_entropy(torch.tensor(0.5, dtype=torch.float64))) == pytest.approx(LN2, abs=1e-12)
    assert float(L.bernoulli_entropy(torch.tensor(0.1, dtype=torch.float64))) == pytest.approx(H01, abs=1e-12)
    assert float(L.bernoulli_entropy_from_logits(torch.tensor(LOGIT01, dtype=torch.float64))) == pytest.approx(
        H01, abs=1e-12)
    big = L.bernoulli_entropy_from_logits(torch.tensor([60.0, -60.0]))
    assert torch.isfinite(big).all() and float(big.max()) < 1e-20


def test_consensus_is_the_site_weighted_mean_entropy():
    logits = torch.cat([const(0.0), const(LOGIT01)])  # site 1 undecided, site 2 at q = 0.1
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    assert float(L.consensus_loss(logits, w)) == pytest.approx(0.25 * LN2 + 0.75 * H01, abs=1e-12)
    with pytest.raises(WeightsError, match="site weights"):
        L.consensus_loss(logits, torch.ones(3))


def test_jensen_shannon_by_hand_and_as_mean_kl_to_the_mixture():
    q = torch.cat([const(0.1), const(0.9)])
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    expected = LN2 - H01  # H(mixture 0.5) - mean H(0.1), H(0.9) = 0.368064
    assert float(L.jensen_shannon(q, w)) == pytest.approx(expected, abs=1e-10)
    kl = 0.1 * math.log(0.1 / 0.5) + 0.9 * math.log(0.9 / 0.5)
    assert float(L.jensen_shannon(q, w)) == pytest.approx(kl, abs=1e-10)
    assert float(L.jensen_shannon(torch.cat([const(0.3), const(0.3)]), w)) == pytest.approx(0.0, abs=1e-12)


def test_class_weights_share_each_labels_pixels_among_sites():
    n = torch.tensor([10.0, 30.0])
    f = torch.tensor([[0.2, 0.0], [0.1, 0.0]])  # label 2 has no foreground anywhere
    fg, bg = L.class_weights(n, f)
    assert fg[:, 0].tolist() == pytest.approx([2 / 5, 3 / 5])
    assert bg[:, 0].tolist() == pytest.approx([8 / 35, 27 / 35])
    assert fg[:, 1].tolist() == pytest.approx([0.25, 0.75])  # falls back to the site sizes
    assert bg[:, 1].tolist() == pytest.approx([0.25, 0.75])
    with pytest.raises(WeightsError):
        L.class_weights(n, torch.tensor([[1.5, 0.0], [0.1, 0.0]]))


def test_importance_weights_and_ensemble_by_hand():
    n = torch.tensor([10.0, 30.0], dtype=torch.float64)
    fg, bg = L.class_weights(n, torch.tensor([[0.2], [0.1]], dtype=torch.float64))
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    q = torch.cat([const(0.1, (1, 1, 1, 2, 2)), const(0.9, (1, 1, 1, 2, 2))])
    pi = L.importance_weights(q, w, fg, bg)
    qbar = 0.25 * 0.1 + 0.75 * 0.9  # 0.7
    pi1 = qbar * 0.4 + (1 - qbar) * 8 / 35
    pi2 = qbar * 0.6 + (1 - qbar) * 27 / 35
    assert float(pi[0, 0, 0, 0, 0]) == pytest.approx(pi1, abs=1e-12)
    assert float(pi[1, 0, 0, 0, 0]) == pytest.approx(pi2, abs=1e-12)
    assert torch.allclose(pi.sum(0), torch.ones_like(pi[0]))
    z = torch.cat([const(-2.0, (1, 1, 1, 2, 2)), const(3.0, (1, 1, 1, 2, 2))])
    a = L.ensemble_logits(z, pi)
    assert float(a[0, 0, 0, 0]) == pytest.approx(-2.0 * pi1 + 3.0 * pi2, abs=1e-12)
    assert float(L.mimic_loss(a + 0.5, a)) == pytest.approx(0.25)


def test_balance_and_adversarial_terms_by_hand():
    p = torch.full((2, 1, 4, 4), 0.5, dtype=torch.float64)
    kl = 0.1 * math.log(0.1 / 0.5) + 0.9 * math.log(0.9 / 0.5)
    assert float(L.balance_loss(p, torch.tensor([0.1], dtype=torch.float64))) == pytest.approx(kl, abs=1e-10)
    scores = [torch.zeros(2, 1, 2, 2), torch.full((2, 1, 2, 2), 30.0)]  # undecided / sure it is real
    gan = L.generator_gan_loss(scores, torch.tensor([0.25, 0.75]))
    assert float(gan) == pytest.approx(0.25 * LN2, abs=1e-6)
    assert float(L.discriminator_loss(torch.zeros(3), torch.zeros(3))) == pytest.approx(LN2, abs=1e-6)


# --- the DP step ------------------------------------------------------------------------------
def test_dp_step_clips_to_the_norm_keeps_direction_and_leaves_small_gradients():
    g = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 10
    released, norm = clip_and_noise(g, clip_norm=1.0, noise_multiplier=0.0)
    assert norm == pytest.approx(float(g.norm()), rel=1e-6)
    assert float(released.norm()) == pytest.approx(1.0, rel=1e-6)
    assert torch.allclose(released, g / g.norm(), atol=1e-7)
    small = g / g.norm() * 0.3
    assert torch.allclose(clip_and_noise(small, 1.0, 0.0)[0], small)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded (simulation)", "secure (network site)"])
def test_dp_step_adds_gaussian_noise_of_the_stated_scale(seeded):
    # Prepare: a huge gradient (clipped to C) plus noise sigma * C per element; a seeded generator (a
    # simulation) or none (a network site: the operating system's secure generator)
    clip, sigma = 0.5, 2.0
    g = torch.ones(200_000) * 100.0
    # Execute
    released, _ = clip_and_noise(g, clip, sigma, torch.Generator().manual_seed(123) if seeded else None)
    noise = released - g / g.norm() * clip
    # Assert: mean 0 and std sigma * C = 1.0 within a few standard errors (n = 2e5)
    assert released.dtype == torch.float32 and released.shape == g.shape
    assert abs(float(noise.mean())) < 5 * sigma * clip / math.sqrt(noise.numel())
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.01)
    kurtosis = float(((noise / noise.std()) ** 4).mean())
    assert kurtosis == pytest.approx(3.0, abs=0.1)  # Gaussian, not uniform (1.8) or Laplace (6)


def test_epsilon_grows_with_releases_shrinks_with_noise_and_meets_a_target():
    assert epsilon_spent(0.0, 10) == math.inf and epsilon_spent(1.0, 0) == 0.0
    assert epsilon_spent(4.0, 50) < epsilon_spent(4.0, 100)
    assert epsilon_spent(8.0, 100) < epsilon_spent(4.0, 100)
    setting = PrivacySetting(epsilon=8.0)
    sigma = setting.resolved_noise(100)
    assert epsilon_spent(sigma, 100) <= 8.0 * 1.01
    assert epsilon_spent(sigma * 0.9, 100) > 8.0  # the smallest such noise, not any noise
    with pytest.raises(ConfigError, match="not both"):
        PrivacySetting(noise_multiplier=1.0, epsilon=3.0)
    with pytest.raises(ConfigError, match="clip_norm"):
        PrivacySetting(clip_norm=0.0)


# --- the site half ----------------------------------------------------------------------------
def tiny_sites(n=2, size=32):
    sites = []
    for k in range(n):
        site = SiteRuntime(f"site{k + 1}", k, random_split(4 + 2 * k, seed=k, shift=0.2 * k, size=size),
                           validation=random_split(2, seed=10 + k, size=size))
        torch.manual_seed(k)
        site.state["teacher_factory"] = lambda: torch.nn.Conv2d(3, 2, 3, padding=1)  # any architecture
        sites.append(site)
    return sites


def tiny_method(sites, privacy=None, steps=2, rounds=1):
    config = FedIODConfig(image_size=32, steps=steps, batch=2, teacher_epochs=1, teacher_patience=1, device="cpu")
    return FedIOD(FUNDUS, [s.name for s in sites], seed=3, rounds=rounds, config=config, privacy=privacy)


def test_site_returns_exactly_the_input_gradient_of_its_answers_without_dp():
    # Prepare
    site = tiny_sites(1)[0]
    method = tiny_method([site])
    from engine.fl.exchange import Request

    method.answer(Request("setup", config={**method._setup_config(), "seed": 1}), site)
    state = site.state[STATE_KEY]
    x = torch.rand(2, 3, 32, 32)
    logits, scores, _ = answer_query(state, site.train, x, step=0)
    gz, gd = torch.randn_like(logits), torch.randn_like(scores)
    # Execute
    released = answer_gradient(state, 0, gz, gd)
    # Assert: equals d/dx [<gz, T(x)> + <gd, D(x)>] computed directly
    xr = x.clone().requires_grad_(True)
    ((state.teacher(xr) * gz).sum() + (state.discriminator(xr) * gd).sum()).backward()
    assert torch.allclose(released, xr.grad, atol=1e-6)
    assert state.releases == 1
    with pytest.raises(FedSMError, match="query first"):
        answer_gradient(state, 0, gz, gd)


def test_a_run_sends_only_declared_answers_and_reports_epsilon_per_site():
    # Prepare
    sites = tiny_sites(2)
    sites[1].state["privacy"] = PrivacySetting(noise_multiplier=2.0, clip_norm=0.1)  # site 2's own setting
    method = tiny_method(sites, PrivacySetting())
    seen = []
    # Execute
    state, records = run_exchange_rounds(method, sites, 1, recorder=seen.append)
    # Assert
    sent = {name for r in seen for name in r.reply_tensors}
    assert sent == {"label_frequency", "logits", "scores", "input_grad"}
    assert [r.action for r in seen[:2]] == ["setup", "setup"]
    assert sum(r.action == "gradient" for r in seen) == 2 * 2
    assert records[0].failed == {}
    eps = method.epsilons(state)
    assert eps["site1"] is None  # no noise: no guarantee claimed
    assert eps["site2"] == pytest.approx(epsilon_spent(2.0, 2), rel=1e-9)
    extra = method.report_extra(state, sites)
    assert extra["releases"] == {"site1": 2, "site2": 2}
    from engine.federation.exchange_ledger import ledger_entry

    entry = ledger_entry(method, next(r for r in seen if r.action == "gradient"))
    assert list(entry["sent"]) == ["input_grad"] and entry["sent"]["input_grad"]["shape"] == [2, 3, 32, 32]
    assert "w.r.t. the generated images only" in entry["sent"]["input_grad"]["what"]
    assert entry["bytes_sent"] == 2 * 3 * 32 * 32 * 4
    assert entry["step"] == 0 and entry["action"] == "gradient"
    largest = max(sum(4 * math.prod(shape) for shape in r.reply_tensors.values()) for r in seen)
    assert largest == method.max_reply_bytes()  # what the network transport sizes its upload limit from
    masks = method.segmenter(state, sites, "cpu")(0, sites[0].train.images)
    assert masks.shape == sites[0].train.masks.shape and set(np.unique(masks)) <= {0, 1}


def test_same_seed_gives_the_same_student_and_a_bad_reply_is_refused():
    sites_a, sites_b = tiny_sites(2), tiny_sites(2)
    state_a, _ = run_exchange_rounds(tiny_method(sites_a, steps=1), sites_a, 1)
    state_b, _ = run_exchange_rounds(tiny_method(sites_b, steps=1), sites_b, 1)
    for key, value in state_a["student"].items():
        assert torch.equal(value, state_b["student"][key]), key
    from engine.fl.exchange import Reply, Request

    method = tiny_method(sites_a)
    with pytest.raises(WeightsError, match="shape"):
        method.validate_reply(Request("query"), "site1", Reply({"logits": torch.zeros(2, 2, 8, 8),
                                                                "scores": torch.zeros(2, 1, 4, 4)}))
    with pytest.raises(WeightsError, match="undeclared"):
        method.validate_reply(Request("query"), "site1", Reply({"weights": torch.zeros(1)}))


def test_factory_reads_the_simulation_settings():
    method = build_fediod("fediod", FUNDUS, ["a", "b"], {"image_size": 32, "fediod_steps": 7, "dp_epsilon": 5.0,
                                                         "rounds": 2, "seed": 4, "dp_clip": 0.5})
    assert method.config.steps == 7 and method.rounds == 2 and method.seed == 4
    assert method.privacy.epsilon == 5.0 and method.privacy.clip_norm == 0.5
    with pytest.raises(ConfigError):
        build_fediod("fediod", FUNDUS, ["a"], {"image_size": 30})


def _site_after_one_query(noise_seed=None):
    """A site set up with DP on and asked one query; ``noise_seed``: a simulation's repeatable noise."""
    from engine.fl.exchange import Request
    from engine.fl.methods.contract import NOISE_SEED_KEY

    site = tiny_sites(1)[0]
    site.state["privacy"] = PrivacySetting(noise_multiplier=1.0)
    if noise_seed is not None:
        site.state[NOISE_SEED_KEY] = noise_seed
    method = tiny_method([site])
    method.answer(Request("setup", config={**method._setup_config(), "seed": 1}), site)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    method.answer(Request("query", {"images": x}, {"step": 0}), site)
    return site, method


def _twin(site):
    """``site`` rebuilt from the weight dicts a transport keeps (and the simulation's noise seed)."""
    from engine.fl.methods.contract import NOISE_SEED_KEY

    kept = {k: v for k, v in site.state.items() if isinstance(v, dict)}
    if NOISE_SEED_KEY in site.state:
        kept[NOISE_SEED_KEY] = site.state[NOISE_SEED_KEY]
    return SiteRuntime(site.name, 0, site.train, {**kept, "teacher_factory": site.state["teacher_factory"]})


def test_a_site_rebuilt_from_its_weight_dicts_answers_as_before():
    # Prepare: a simulated site (repeatable noise) and its twin rebuilt from what save_site_state keeps
    from engine.fl.exchange import Request

    site, method = _site_after_one_query(noise_seed=11)
    twin = _twin(site)
    gz, gd = torch.randn(2, 2, 32, 32), torch.randn(2, 1, 4, 4)
    # Execute
    original = method.answer(Request("gradient", {"logit_grad": gz, "score_grad": gd}, {"step": 0}), site)
    rebuilt = method.answer(Request("gradient", {"logit_grad": gz, "score_grad": gd}, {"step": 0}), twin)
    # Assert: same gradient, same noise draw, same release count
    assert torch.equal(original.tensors["input_grad"], rebuilt.tensors["input_grad"])
    assert twin.state[STATE_KEY].releases == site.state[STATE_KEY].releases == 1


def test_a_network_site_keeps_no_noise_state_and_a_rebuilt_one_still_draws_secure_noise():
    # Prepare: a network site (no noise seed of its own) and its twin rebuilt from its weight dicts
    from engine.fl.exchange import Request
    from engine.fl.fediod_site import mirror_state

    site, method = _site_after_one_query()
    mirror_state(site, site.state[STATE_KEY], teacher=False)
    twin = _twin(site)
    gz, gd = torch.randn(2, 2, 32, 32), torch.randn(2, 1, 4, 4)
    # Execute
    original = method.answer(Request("gradient", {"logit_grad": gz, "score_grad": gd}, {"step": 0}), site)
    rebuilt = method.answer(Request("gradient", {"logit_grad": gz, "score_grad": gd}, {"step": 0}), twin)
    # Assert: nothing of the noise is kept (there is no generator state to leak or restore) ...
    assert site.state[STATE_KEY].noise_rng is None and twin.state[STATE_KEY].noise_rng is None
    assert "noise_rng" not in site.state["fediod/site"]
    # ... the twin answers with the same clipped gradient plus its own fresh noise (std 1.0 per element)
    difference = original.tensors["input_grad"] - rebuilt.tensors["input_grad"]
    assert float(difference.std()) == pytest.approx(math.sqrt(2.0), rel=0.05)
    assert twin.state[STATE_KEY].releases == site.state[STATE_KEY].releases == 1


def test_a_sites_dp_noise_is_its_own_secret_not_a_function_of_what_the_coordinator_sent():
    # Prepare: two runs of one site with the same data, teacher and coordinator messages (seed included),
    # DP on; as a network site, neither holds a noise seed of its own
    from engine.fl.exchange import Request

    def released(noise_seed=None):
        site, method = _site_after_one_query(noise_seed)
        gz = torch.randn(2, 2, 32, 32, generator=torch.Generator().manual_seed(6))
        gd = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(7))
        return method.answer(Request("gradient", {"logit_grad": gz, "score_grad": gd}, {"step": 0}), site)

    # Execute
    first, second = released(), released()
    # Assert: different noise, so the coordinator cannot regenerate it from the seed it sent and subtract it
    # (noise std 1.0 x clip 1.0 per element: two draws never agree)
    assert not torch.allclose(first.tensors["input_grad"], second.tensors["input_grad"])
    # ... while a simulation, which sets each site's noise seed from the run's, repeats exactly
    assert torch.equal(released(11).tensors["input_grad"], released(11).tensors["input_grad"])


def test_the_sites_input_gradients_sum_to_the_generator_loss_gradient_of_one_graph():
    # Prepare: drive one distillation step by hand, as a transport would
    from engine.fl.exchange import Reply

    sites = tiny_sites(2)
    method = tiny_method(sites, steps=1)
    state = method.initial_state()
    dialogue = method.dialogue(state, 1)
    by_name = {s.name: s for s in sites}

    def answer_all(requests):
        return {name: method.answer(request, by_name[name]) for name, request in requests.items()}

    queries = dialogue.send(answer_all(next(dialogue)))  # setup, then the step's query
    images = next(iter(queries.values())).tensors["images"]
    gradient_requests = dialogue.send(answer_all(queries))
    # Execute: the sites' answers (no DP: exact vector-Jacobian products)
    replies = answer_all(gradient_requests)
    site_part = sum(r.tensors["input_grad"] for r in replies.values()) / method.config.batch
    # Assert: equals d(generator loss)/dx through the teachers and discriminators, computed in one graph
    from engine.fl.fediod_site import label_frequency

    stats = {"num_samples": torch.tensor([float(len(by_name[s].train.images)) for s in method.site_names],
                                         dtype=torch.float64),
             "label_frequency": torch.stack([torch.from_numpy(label_frequency(by_name[s].train.masks))
                                             for s in method.site_names])}
    x = images.clone().requires_grad_(True)
    logits = torch.stack([by_name[s].state[STATE_KEY].teacher(x).float() for s in method.site_names])
    scores = [by_name[s].state[STATE_KEY].discriminator(x).float() for s in method.site_names]
    student = method._student()
    student.load_state_dict(state["student"])
    w = stats["num_samples"] / stats["num_samples"].sum()
    fg, bg = L.class_weights(stats["num_samples"], stats["label_frequency"])
    freq = (w.view(-1, 1) * stats["label_frequency"]).sum(0)
    terms = FedIOD._generator_terms(logits, scores, student(x.detach()), w.float(), fg, bg, freq)
    c = method.config
    loss = (c.w_gan * terms["gan"] + c.w_consensus * terms["consensus"] + c.w_uniqueness * terms["uniqueness"]
            + c.w_balance * terms["balance"] - c.w_adv * terms["adv"])
    (expected,) = torch.autograd.grad(loss, x)
    assert torch.allclose(site_part, expected, rtol=1e-4, atol=1e-7)
    assert all(isinstance(r, Reply) for r in replies.values())
