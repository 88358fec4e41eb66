"""BlackFed: SPSA-GC, the round-robin dialogue, v2's server table, and what crosses the wire."""

import math

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError, WeightsError
from engine.federation.inprocess import run_exchange_rounds
from engine.fl.blackfed import CLIENT_KEY, BlackFed, BlackFedConfig
from engine.fl.blackfed_nets import SpsaGc, SpsaSettings, rademacher, split_loss, spsa_gradient
from engine.fl.exchange import Reply, Request
from engine.fl.methods import SiteRuntime
from engine.tasks import FUNDUS

SIZE = 32
CFG = BlackFedConfig(client_epochs=1, server_epochs=1, batch_size=4, perturbations=2, image_size=SIZE)


def runtimes(n=2):
    return [SiteRuntime(f"site{k + 1}", k, random_split(5 + k, seed=k, shift=0.2 * k, size=SIZE)) for k in range(n)]


def run(variant="v1", rounds=1, sites=None, recorder=None, config=CFG):
    sites = sites or runtimes()
    method = BlackFed(FUNDUS, [s.name for s in sites], seed=3, rounds=rounds, variant=variant, config=config)
    state, records = run_exchange_rounds(method, sites, rounds, recorder=recorder)
    return method, sites, state, records


@pytest.fixture(scope="module")
def trained():
    """One round of v1 and of v2 on the same two sites (shared by the tests that only read them)."""
    return {"v1": run("v1"), "v2": run("v2")}


def test_spsa_estimate_on_a_quadratic_is_the_true_gradient_in_expectation():
    # L(x) = 1/2 x'Ax + b'x: the central difference is exact for a quadratic, so each estimate
    # is d d' grad L and E[d d'] = I makes it unbiased. Component i of one estimate has variance
    # sum_{j != i} grad_j^2, so the mean of M estimates lies within 5 standard errors of the true
    # gradient with probability > 1 - 1e-5 per component (the seed fixes the draw anyway).
    gen = torch.Generator().manual_seed(0)
    n, draws, c = 6, 20000, 0.05
    q = torch.randn(n, n, generator=gen, dtype=torch.float64)
    a, b = q @ q.T + torch.eye(n, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    x = torch.randn(n, generator=gen, dtype=torch.float64)

    def loss(v):  # rows of v are points
        return 0.5 * ((v @ a) * v).sum(1) + v @ b

    true = a @ x + b
    deltas = torch.stack([rademacher(n, gen) for _ in range(draws)]).to(torch.float64)
    losses = torch.stack([loss(x + c * deltas), loss(x - c * deltas)], 1).reshape(-1)
    estimate = spsa_gradient(losses, deltas, c).to(torch.float64)
    stderr = torch.sqrt((true.pow(2).sum() - true.pow(2)) / draws)
    assert torch.all((estimate - true).abs() <= 5 * stderr), (estimate, true, stderr)
    # a single perturbation's estimate is not the gradient (this is a real estimator, not a copy of it)
    one = spsa_gradient(losses[:2], deltas[:1], c).to(torch.float64)
    assert not torch.allclose(one, true, atol=1e-3)


def test_spsa_gc_descends_a_quadratic():
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(20, generator=gen)
    opt = SpsaGc(torch.zeros(20), SpsaSettings(lr=0.005, c=0.01, perturbations=4, momentum=0.9))

    def loss(v):
        return float(((v - target) ** 2).sum())

    start = loss(opt.theta)
    for _ in range(300):
        opt.step(loss, gen)
    assert loss(opt.theta) < 0.05 * start


def test_v2_table_holds_each_sites_own_server_weights_and_v1_trains_the_same(trained):
    m1, _, s1, _ = trained["v1"]
    m2, sites, s2, _ = trained["v2"]
    assert sorted(s1) == ["server"]
    assert sorted(s2) == ["server", "server/site1", "server/site2"]
    # training is identical: v1's shared g is v2's last g, which is also the last site's entry
    for key in s1["server"]:
        assert torch.equal(s1["server"][key], s2["server"][key])
        assert torch.equal(s2["server/site2"][key], s2["server"][key])
    assert any(not torch.equal(s2["server/site1"][k], s2["server/site2"][k]) for k in s2["server"])
    assert m2.server_for(s2, "site1") is s2["server/site1"] and m2.server_for(s2, "site2") is s2["server/site2"]
    assert m1.server_for(s1, "site1") is s1["server"]
    # each site segments with its own client net and its own server entry
    images = sites[0].train.images[:2]
    bundle = m2.report_extra(s2, sites)["bundle"]
    assert bundle.metadata.server == "per-site"
    for s in sites:
        assert all(torch.equal(bundle.server_for(s.name)[key], s2[f"server/{s.name}"][key]) for key in s2["server"])
    assert np.array_equal(m2.segmenter(s2, sites, "cpu")(0, images),
                          _split_masks(sites[0].state[CLIENT_KEY], s2["server/site1"], images))


def _split_masks(client, server, images):
    from engine.fl.blackfed_segment import split_logits

    return (split_logits(FUNDUS, CFG.channels, client, server, images, "cpu") > 0).astype(np.uint8)


def test_no_gradient_or_weight_is_ever_sent_to_a_site():
    sent = []
    method = BlackFed(FUNDUS, ["site1", "site2"], seed=3, rounds=1, variant="v2", config=CFG)
    answer = method.answer

    def spy(request, site, progress=None, cancel=None):
        sent.append((request, {k: v.clone() for k, v in request.tensors.items()}))
        return answer(request, site, progress, cancel)

    method.answer = spy
    sites = runtimes()
    records = []
    run_exchange_rounds(method, sites, 1, recorder=records.append)
    client_params = {tuple(p.shape) for p in method.client_net().parameters()}
    server_params = {tuple(p.shape) for p in method.server_net().parameters()}
    assert sent and all(set(t) <= {"losses"} for _, t in sent)
    carried = [t["losses"] for _, t in sent if "losses" in t]
    assert len(carried) == 2 * 2  # per site: the second client probe and the first server batch carry losses
    for losses in carried:
        # loss scalars: one per perturbed forward pass, never shaped like a parameter or activation
        assert losses.dim() == 1 and losses.numel() == 2 * CFG.perturbations
        assert tuple(losses.shape) not in client_params | server_params
        assert bool((losses > 0).all()) and bool((losses < 3).all())  # BCE + Dice values
    # uploads are activations and masks, never a weight
    for r in records:
        assert set(r.reply_tensors) == {"activations", "masks"}
        assert r.reply_tensors["activations"][1] == CFG.channels
        assert r.bytes_to_site in (0, 8 * 2 * CFG.perturbations)


def test_losses_sent_back_are_the_coordinators_losses_of_the_uploaded_activations():
    method = BlackFed(FUNDUS, ["site1"], seed=3, variant="v1", config=CFG)
    site = runtimes(1)[0]
    reply = method.answer(Request("client_probe", {}, {"round": 1, "step": 0}), site)
    method.validate_reply(Request("client_probe"), "site1", reply)
    g = method.server_net(method.initial_state()["server"])
    losses = method.probe_losses(g, reply)
    b = reply.tensors["masks"].shape[0]
    with torch.no_grad():
        manual = split_loss(g(reply.tensors["activations"][:b]), reply.tensors["masks"].float())
    assert float(losses[0]) == pytest.approx(float(manual), rel=1e-6)
    before = method.client_net(site.state.get(CLIENT_KEY) or method._initial_client("site1"))
    method.answer(Request("server_batch", {"losses": losses}, {"round": 1, "step": 0}), site)
    after = site.state[CLIENT_KEY]
    assert any(not torch.equal(p, after[k]) for k, p in before.state_dict().items())


def test_runs_are_deterministic(trained):
    _, sites_a, a, _ = trained["v1"]
    _, sites_b, b, _ = run("v1")
    assert all(torch.equal(a["server"][k], b["server"][k]) for k in a["server"])
    assert all(torch.equal(sites_a[0].state[CLIENT_KEY][k], sites_b[0].state[CLIENT_KEY][k])
               for k in sites_a[0].state[CLIENT_KEY])


def test_bad_replies_and_settings_are_refused():
    method = BlackFed(FUNDUS, ["a"], config=CFG)
    good = method.answer(Request("server_batch", {}, {"round": 1, "step": 0}), runtimes(1)[0])
    method.validate_reply(Request("server_batch"), "a", good)
    acts, masks = good.tensors["activations"], good.tensors["masks"]
    with pytest.raises(WeightsError, match="masks must be uint8"):
        method.validate_reply(Request("server_batch"), "a", Reply({"activations": acts, "masks": masks.float()}, {}, 5))
    with pytest.raises(WeightsError, match="activations must be"):
        method.validate_reply(Request("client_probe"), "a", Reply({"activations": acts, "masks": masks}, {}, 5))
    with pytest.raises(WeightsError, match="undeclared"):
        method.validate_reply(Request("server_batch"), "a", Reply({"weights": acts}, {}, 5))
    # finite but absurd activations, and a NaN or non-numeric metric: refused with the reason
    huge = torch.full_like(acts, 1e30)
    with pytest.raises(WeightsError, match="activations up to 1e\\+30 exceed"):
        method.validate_reply(Request("server_batch"), "a", Reply({"activations": huge, "masks": masks}, {}, 5))
    for metric in (float("nan"), float("inf"), "0.5", True):
        with pytest.raises(WeightsError, match=r"metric 'loss' is .*not a finite number"):
            method.validate_reply(Request("server_batch"), "a",
                                  Reply({"activations": acts, "masks": masks}, {"loss": metric}, 5))
    method.validate_reply(Request("server_batch"), "a", Reply({"activations": acts, "masks": masks}, {"loss": 0.3}, 5))
    with pytest.raises(ConfigError, match="variant"):
        BlackFed(FUNDUS, ["a"], variant="v3")
    with pytest.raises(ConfigError, match="server_epochs"):
        BlackFedConfig(server_epochs=0)
    with pytest.raises(ConfigError, match="without a pending"):
        method.answer(Request("server_batch", {"losses": torch.zeros(4)}, {"round": 1, "step": 0}), runtimes(1)[0])


def test_exchange_count_follows_the_sites_data(trained):
    _, sites, _, records = trained["v1"]
    for s in sites:
        batches = math.ceil(len(s.train.images) / CFG.batch_size)
        assert records[0].metrics[s.name]["exchanges"] == batches * (CFG.client_epochs + CFG.server_epochs)


def test_split_bundle_round_trips(trained, tmp_path):
    from engine.bundle.split import is_split_bundle, load_split_bundle, save_split_bundle

    method, sites, state, _ = trained["v2"]
    bundle = method.report_extra(state, sites)["bundle"]
    path = tmp_path / "bf.safetensors"
    save_split_bundle(path, bundle)
    assert is_split_bundle(path)
    loaded = load_split_bundle(path)
    assert loaded.metadata.method == "blackfed-v2" and loaded.metadata.site_names == ["site1", "site2"]
    assert sorted(loaded.table) == ["site1", "site2"]
    for site in ("site1", "site2"):
        assert all(torch.equal(loaded.clients[site][k], v) for k, v in bundle.clients[site].items())
        assert all(torch.equal(loaded.server_for(site)[k], v) for k, v in state[f"server/{site}"].items())


def test_white_box_split_sends_activation_gradients_and_descends():
    from engine.fl.split_whitebox import SplitWhiteBox

    sites = runtimes()
    cfg = BlackFedConfig(client_epochs=2, server_epochs=1, batch_size=4, image_size=SIZE)
    method = SplitWhiteBox(FUNDUS, [s.name for s in sites], seed=3, config=cfg)
    seen = []
    state, _ = run_exchange_rounds(method, sites, 1, recorder=seen.append)
    grads = [r for r in seen if "activation_grad" in r.request_tensors]
    assert grads and all(r.request_tensors["activation_grad"][1] == cfg.channels for r in grads)
    # the first-order step moves the client net along -dL/dtheta: the loss of the next probe of the
    # same batch is lower than before the step
    site = runtimes(1)[0]
    one = SplitWhiteBox(FUNDUS, ["site1"], seed=3, config=cfg)
    g = one.server_net(state["server"])
    first = one.answer(Request("client_grad", {}, {"round": 1, "step": 0}), site)
    grad = one.client_feedback(g, first)
    with torch.no_grad():
        before = float(split_loss(g(first.tensors["activations"]), first.tensors["masks"].float()))
    one.answer(Request("server_batch", {"activation_grad": grad}, {"round": 1, "step": 0}), site)
    after_net = one.client_net(site.state[CLIENT_KEY])
    idx = one._batch(site, 1, "client", 0)
    with torch.no_grad():
        acts = after_net(torch.from_numpy(site.train.images[idx]))
        after = float(split_loss(g(acts), first.tensors["masks"].float()))
    assert after < before
