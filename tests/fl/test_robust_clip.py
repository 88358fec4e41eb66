"""Each part's change clipped to a multiple of the round's median (engine.fl.robust.clip_to_median), and the
simulation screening and aggregating as a network coordinator does (run_rounds with ``robust``)."""

import math

import pytest
import torch
from testsupport import random_split

from engine.federation.inprocess import run_rounds
from engine.fl.methods import FedAvg, SiteRuntime, SiteUpdate
from engine.fl.robust import RobustSettings, _change_norm, clip_to_median
from engine.tasks import FUNDUS

NAMES = [f"site{k + 1}" for k in range(5)]


def _updates(method, state, scales):
    torch.manual_seed(0)
    out = {}
    for site, scale in zip(NAMES, scales, strict=True):
        step = {k: torch.randn_like(v) * 1e-3 if v.dtype.is_floating_point else v for k, v in state["global"].items()}
        out[site] = SiteUpdate({"global": {k: state["global"][k] + scale * step[k] if v.dtype.is_floating_point
                                           else v for k, v in step.items()}}, 10, {})
    return out


def test_the_outlier_is_clipped_to_the_median_and_the_rest_untouched(tiny_training):
    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    updates = _updates(method, state, [1.0, 1.1, 0.9, 1.05, 5.0])
    norms = {s: _change_norm(u.weights["global"], state["global"]) for s, u in updates.items()}
    clipped = clip_to_median(method, state, updates, 1.0)
    median = sorted(norms.values())[2]
    after = {s: _change_norm(u.weights["global"], state["global"]) for s, u in clipped.items()}
    assert after["site5"] == pytest.approx(median, rel=1e-4) and norms["site5"] > 4 * median
    for site in ("site1", "site3"):  # at or below the median: the same objects, not copies
        assert clipped[site] is updates[site]
    # with 2x the median the honest spread passes untouched and the x5 site is still cut
    loose = clip_to_median(method, state, updates, 2.0)
    assert all(loose[s] is updates[s] for s in NAMES[:4])
    assert _change_norm(loose["site5"].weights["global"], state["global"]) == pytest.approx(2 * median, rel=1e-4)


def test_a_large_honest_site_is_judged_for_its_size_and_still_clipped_when_it_pushes(tiny_training):
    # a site with 16x the samples walks ~4x (sqrt) as far: 2.9x the raw median on cpu-small's prostate
    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    counts = [10, 10, 10, 10, 160]
    honest = _updates(method, state, [1.0, 1.1, 0.9, 1.05, 4.0])
    honest = {s: SiteUpdate(u.weights, n, {}) for (s, u), n in zip(honest.items(), counts, strict=True)}
    assert clip_to_median(method, state, honest, 2.0)["site5"] is honest["site5"]  # left alone
    pushed = _updates(method, state, [1.0, 1.1, 0.9, 1.05, 20.0])  # the same site, x5
    pushed = {s: SiteUpdate(u.weights, n, {}) for (s, u), n in zip(pushed.items(), counts, strict=True)}
    reports = []
    clipped = clip_to_median(method, state, pushed, 2.0, lambda site, message: reports.append((site, message)))
    norm = {s: _change_norm(u.weights["global"], state["global"]) for s, u in pushed.items()}
    after = _change_norm(clipped["site5"].weights["global"], state["global"])
    # held to 2x the median per sqrt(n), times its own sqrt(16) = 4: 8x the small sites' median change
    assert after == pytest.approx(2 * 4 * sorted(norm.values())[2], rel=1e-4)
    assert [site for site, _ in reports] == ["site5"] and "for its sample count" in reports[0][1]


def test_a_sign_flip_keeps_its_size_and_too_few_sites_are_not_judged(tiny_training):
    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    updates = _updates(method, state, [1.0, 1.0, 1.0, 1.0, -1.0])
    assert clip_to_median(method, state, updates, 1.0)["site5"] is updates["site5"]  # norm clipping alone
    two = {s: updates[s] for s in NAMES[:2]}
    assert clip_to_median(method, state, two, 1.0) == two


class ScaledSite:
    """Wraps a method so that one site's answer is its honest change times ``factor`` (x5, or -1: sign flip)."""

    def __init__(self, method, site, factor):
        self._method, self._site, self._factor = method, site, factor

    def __getattr__(self, name):
        return getattr(self._method, name)

    def train_at_site(self, instructions, site, progress=None, cancel=None):
        update = self._method.train_at_site(instructions, site, progress, cancel)
        if site.name != self._site:
            return update
        ref = instructions.weights["global"]
        w = update.weights["global"]
        scaled = {k: ref[k] + self._factor * (w[k] - ref[k]) if w[k].dtype.is_floating_point else w[k] for k in w}
        return SiteUpdate({**update.weights, "global": scaled}, update.num_samples, update.metrics)


def _sites():
    return [SiteRuntime(n, k, random_split(6, seed=k, shift=0.2 * k)) for k, n in enumerate(NAMES)]


def test_the_simulation_screens_and_clips_as_the_coordinator_does(tiny_training):
    honest, _ = run_rounds(FedAvg(FUNDUS, NAMES, tiny_training, seed=2), _sites(), 1,
                           robust=RobustSettings(clip=1.0))
    attacked_method = ScaledSite(FedAvg(FUNDUS, NAMES, tiny_training, seed=2), "site5", 5.0)
    plain, _ = run_rounds(attacked_method, _sites(), 1)
    guarded, _ = run_rounds(attacked_method, _sites(), 1, robust=RobustSettings(clip=1.0))
    initial = FedAvg(FUNDUS, NAMES, tiny_training, seed=2).initial_state()["global"]

    def moved(state):
        return _change_norm(state["global"], initial)

    # unguarded the x5 site drags the average about twice as far as the honest round; clipped, about as far
    assert moved(plain) > 1.5 * moved(honest)
    assert moved(guarded) < 1.15 * moved(honest)
    # a site beyond max_relative_update is left out of the round, as over the network
    huge = ScaledSite(FedAvg(FUNDUS, NAMES, tiny_training, seed=2), "site5", 1e6)
    _, records = run_rounds(huge, _sites(), 1, robust=RobustSettings())
    assert "site5" in records[0].failed and "max_relative_update" in records[0].failed["site5"]
    assert records[0].answered == NAMES[:4]
    assert math.isfinite(moved(guarded))
