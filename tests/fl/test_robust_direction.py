"""A site whose change of a shared model points against the other sites' is left out of the round
(engine.fl.robust.opposed_sites, ``[robust] min_cosine``: its cosine with the sites' coordinate-wise
median change), in the simulation as over the network."""

import pytest
import torch
from test_robust_clip import _sites

from engine.federation.inprocess import run_rounds
from engine.fl.methods import FedAvg, SiteUpdate
from engine.fl.robust import RobustSettings, aggregate_leaving_out, opposed_sites
from engine.tasks import FUNDUS

NAMES = [f"site{k + 1}" for k in range(5)]


def _updates(state, signs, counts=(10, 10, 10, 10, 10), shared=1.0, scale=1.0):
    """Each site's change: a direction all sites share (``shared`` of it) plus its own noise of the same size,
    all times ``scale``."""
    generator = torch.Generator().manual_seed(0)
    common = {k: torch.randn(v.shape, generator=generator) * 1e-3 for k, v in state["global"].items()
              if v.dtype.is_floating_point}
    out = {}
    for site, sign, count in zip(NAMES, signs, counts, strict=True):
        weights = {}
        for k, v in state["global"].items():
            if k in common:
                own = torch.randn(v.shape, generator=generator) * 1e-3
                weights[k] = v + sign * scale * (shared * common[k] + own)
            else:
                weights[k] = v
        out[site] = SiteUpdate({"global": weights}, count, {})
    return out


def test_a_large_site_that_flips_its_change_is_left_out_and_the_others_are_kept(tiny_training):
    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    # site5 holds most of the data (FedAvg gives it 60 % of the weight) and sends its change reversed
    updates = _updates(state, [1, 1, 1, 1, -1], counts=(10, 10, 10, 10, 60))
    reasons = opposed_sites(method, state, updates, RobustSettings().min_cosine)
    assert list(reasons) == ["site5"]
    assert "points against the other sites'" in reasons["site5"] and "min_cosine = -0.07" in reasons["site5"]
    cosine = float(reasons["site5"].split("(cosine ")[1].split(" ")[0])
    # -1/sqrt(2) against a pure consensus; the median keeps some of the noise: about -0.6
    assert -0.75 < cosine < -0.5

    # the round goes on without it: the same model as the honest four alone, the reason returned
    aggregated, left_out = aggregate_leaving_out(method, state, 1, updates, RobustSettings())
    honest = {s: u for s, u in updates.items() if s != "site5"}
    expected, none_left_out = aggregate_leaving_out(method, state, 1, honest, RobustSettings())
    assert left_out == reasons and none_left_out == {}
    assert all(torch.equal(aggregated["global"][k], expected["global"][k]) for k in expected["global"])


def test_honest_sites_that_barely_agree_are_kept_and_the_check_needs_four_sites(tiny_training):
    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    # changes that are mostly each site's own (a shared part of 0.2 of the noise): cosines near +0.1, none opposed
    weak = _updates(state, [1, 1, 1, 1, 1], shared=0.2)
    assert opposed_sites(method, state, weak, -0.07) == {}
    flipped = _updates(state, [1, 1, 1, 1, -1])
    assert opposed_sites(method, state, flipped, -1.0) == {}  # -1: off
    three = {s: flipped[s] for s in ("site1", "site2", "site5")}
    assert opposed_sites(method, state, three, -0.07) == {}  # three sites: each is a third of the median
    assert RobustSettings().min_cosine == -0.07
    with pytest.raises(Exception, match="min_cosine"):
        RobustSettings.from_dict({"min_cosine": 1.5})


class SyntheticChanges:
    """Wraps a method: each site answers with :func:`_updates`' change for it (a shared direction, its own noise,
    ``signs``), made from the model it was sent instead of by training. (Local Adam steps on the tests' tiny
    random sites are too noisy to share a direction: their honest cosines are ~0.005.)"""

    def __init__(self, method, signs):
        self._method, self._signs = method, signs

    def __getattr__(self, name):
        return getattr(self._method, name)

    def train_at_site(self, instructions, site, progress=None, cancel=None):
        return _updates({"global": instructions.weights["global"]}, self._signs)[site.name]


def test_the_simulation_leaves_a_flipping_site_out_as_the_coordinator_does(tiny_training):
    flipping = SyntheticChanges(FedAvg(FUNDUS, NAMES, tiny_training, seed=2), [1, 1, 1, 1, -1])
    initial = flipping.initial_state()
    off, off_records = run_rounds(flipping, _sites(), 1, robust=RobustSettings(min_cosine=-1.0))
    guarded, records = run_rounds(flipping, _sites(), 1, robust=RobustSettings())
    assert off_records[0].answered == NAMES
    assert records[0].answered == NAMES[:4] and "min_cosine" in records[0].failed["site5"]
    honest = {s: u for s, u in _updates(initial, [1, 1, 1, 1, -1]).items() if s != "site5"}
    expected, _ = aggregate_leaving_out(flipping, initial, 1, honest, RobustSettings())
    # the changes travel as 16-bit differences (wire_precision): equal to their rounding (~4e-6 of 1e-3 steps)
    worst = {k: float((guarded["global"][k] - expected["global"][k]).abs().max()) for k in expected["global"]}
    assert max(worst.values()) < 2e-5, max(worst.values())
    flipped_in = max(float((off["global"][k] - expected["global"][k]).abs().max()) for k in expected["global"])
    assert flipped_in > 1e-4  # kept, the flipped site moves the model by far more than the rounding


def test_each_sites_median_of_the_others_comes_from_one_sort():
    from engine.fl.robust import _leave_one_out_medians

    for k in (4, 5, 6, 7):
        rows = torch.randn(k, 1000, generator=torch.Generator().manual_seed(k))
        for i, median in enumerate(_leave_one_out_medians(rows)):
            others = torch.cat([rows[:i], rows[i + 1:]])
            assert torch.equal(median, others.sort(dim=0).values[(k - 2) // 2])  # the lower middle value


def test_direction_evidence_is_a_moving_average_of_each_sites_cosines_replayed_in_round_order():
    from engine.fl.robust import DirectionMemory

    memory = DirectionMemory(0.8)
    assert memory.observe(1, {"global": {"a": 0.3, "b": -0.2}}) == {"global": {"a": 0.3, "b": -0.2}}  # first: itself
    assert memory.observe(2, {"global": {"a": -0.3}}) == {"global": {"a": pytest.approx(0.8 * 0.3 + 0.2 * -0.3)}}
    # a repeated attempt of round 2 replaces its reading instead of counting twice
    assert memory.observe(2, {"global": {"a": 0.1}})["global"]["a"] == pytest.approx(0.8 * 0.3 + 0.2 * 0.1)
    assert memory.evidence(2)["global"]["b"] == -0.2  # b was not judged in round 2: unchanged
    # a resumed coordinator rebuilds the same evidence from its checkpoint's round records
    history = [{"round": r, "answered": [], "direction": c} for r, c in sorted(memory.cosines.items())]
    history.insert(1, {"round": 9, "answered": []})  # a record without cosines (fewer than four sites) is skipped
    assert DirectionMemory.from_history(0.8, history).evidence(2) == memory.evidence(2)
    assert DirectionMemory(0.0).observe(1, {"global": {"a": 0.5}})["global"]["a"] == 0.5
    assert RobustSettings().direction_memory == 0.8
    with pytest.raises(Exception, match="direction_memory"):
        RobustSettings.from_dict({"direction_memory": 1.0})


def test_a_site_that_dips_after_agreeing_is_kept_but_a_site_that_keeps_flipping_is_left_out(tiny_training):
    from engine.fl.robust import DirectionMemory

    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    honest, flipped = _updates(state, [1, 1, 1, 1, 1]), _updates(state, [1, 1, 1, 1, -1])
    memory = DirectionMemory(0.8)
    assert opposed_sites(method, state, honest, -0.07, 1, memory) == {}
    assert memory.cosines[1]["global"]["site5"] > 0.4  # agreed in round 1
    # round 2: site5 points against the others (cosine ~ -0.6); one round of it after agreeing is not enough ...
    assert opposed_sites(method, state, flipped, -0.07, 2, memory) == {}
    # ... where this round's cosine alone (memory 0, the old rule) leaves it out
    assert list(opposed_sites(method, state, flipped, -0.07, 2, DirectionMemory(0.0))) == ["site5"]
    # flipping on, it is left out within a few rounds, the reason naming both the round's and the run's figure
    left_out_at = next(rnd for rnd in range(3, 10) if opposed_sites(method, state, flipped, -0.07, rnd, memory))
    # evidence 0.8^k * 0.66 - (1 - 0.8^k) * 0.6 falls below -0.07 at the fourth flipped round (round 5)
    assert left_out_at <= 5, left_out_at
    reason = opposed_sites(method, state, flipped, -0.07, left_out_at, memory)["site5"]
    assert "over the rounds so far" in reason and "min_cosine = -0.07" in reason
    # a repeated attempt of the round with too few sites to read leaves no reading of it behind (site5's evidence
    # before it was above the bound) ...
    three = {s: flipped[s] for s in ("site1", "site2", "site5")}
    assert opposed_sites(method, state, three, -0.07, left_out_at, memory) == {} and left_out_at not in memory.cosines
    # ... and once its evidence is below, site5 stays out of rounds that cannot be read: too few sites, or no
    # shared part (FedSM's last round, whose statistics set the routing for every site)
    assert list(opposed_sites(method, state, flipped, -0.07, left_out_at, memory)) == ["site5"]
    standing = opposed_sites(method, state, three, -0.07, left_out_at + 1, memory)
    assert list(standing) == ["site5"] and "over the run" in standing["site5"]
    statistics_only = {s: SiteUpdate({}, 10, {}) for s in NAMES}
    assert list(opposed_sites(method, state, statistics_only, -0.07, left_out_at + 1, memory)) == ["site5"]
    assert opposed_sites(method, state, statistics_only, -0.07, left_out_at + 1) == {}  # no run evidence: no verdict
    # a site flipping from its first judged round is left out of that round
    assert list(opposed_sites(method, state, flipped, -0.07, 1, DirectionMemory(0.8))) == ["site5"]


def test_rounds_of_small_changes_leave_the_evidence_as_it_was(tiny_training):
    """Near convergence honest changes shrink and stop sharing a direction: such rounds are read and kept in
    the record, but do not count, so an honest site is not left out on their noise and a site left out stays out."""
    from engine.fl.robust import DirectionMemory

    method = FedAvg(FUNDUS, NAMES, tiny_training, seed=0)
    state = method.initial_state()
    memory = DirectionMemory(0.8, 0.25)
    assert list(opposed_sites(method, state, _updates(state, [1, 1, 1, 1, -1]), -0.07, 1, memory)) == ["site5"]
    before = memory.evidence(1)
    # round 2: every change a tenth of round 1's; site1 now points against the others, site5 with them
    small = _updates(state, [-1, 1, 1, 1, 1], scale=0.1)
    reasons = opposed_sites(method, state, small, -0.07, 2, memory)
    assert list(reasons) == ["site5"] and "direction_min_change" in reasons["site5"]
    assert memory.cosines[2]["global"]["site1"] < -0.5  # read, and kept in the round's record ...
    assert memory.evidence(2) == before  # ... but not counted: site1 kept, site5 still out
    record = memory.round_record(2)
    assert record["direction_judged"] == {"global": False}
    assert record["direction_size"]["global"] == pytest.approx(0.1 * memory.sizes[1]["global"], rel=1e-4)
    assert memory.round_record(1)["direction_judged"] == {"global": True}
    # a quarter of the largest change so far counts again (and so does a round read without its size)
    assert list(opposed_sites(method, state, _updates(state, [-1, 1, 1, 1, 1], scale=0.3), -0.07, 3, memory)) \
        == ["site5"] and memory.judged(3)[3] == {"global": True}
    assert memory.evidence(3)["global"]["site1"] < before["global"]["site1"]
    # a resumed coordinator judges on the same evidence, from the rounds' records
    history = [{"round": r, **memory.round_record(r)} for r in (1, 2, 3)]
    assert DirectionMemory.from_history(0.8, history, 0.25).evidence(3) == memory.evidence(3)
    # 0: every round counts (the rule before sizes were read): site1 and site5 swap places in round 2
    every = DirectionMemory(0.0, 0.0)
    opposed_sites(method, state, _updates(state, [1, 1, 1, 1, -1]), -0.07, 1, every)
    assert list(opposed_sites(method, state, small, -0.07, 2, every)) == ["site1"]
    assert RobustSettings().direction_min_change == 0.4


def test_a_round_whose_sites_share_no_direction_does_not_count():
    from engine.fl.robust import DirectionMemory

    memory = DirectionMemory(0.8, 0.4)
    agree = {"global": {"a": 0.3, "b": 0.2, "c": 0.25, "d": -0.5}}
    assert memory.observe(1, agree, {"global": 1.0})["global"]["d"] == -0.5
    # round 2, as large: most cosines at or below 0 (a median of -0.05), nothing the sites share to oppose
    assert memory.observe(2, {"global": {"a": -0.3, "b": -0.1, "c": 0.05, "d": 0.4}}, {"global": 1.0}) == agree
    assert memory.judged(2)[2] == {"global": False}
    assert memory.observe(3, agree, {"global": 0.9})["global"]["a"] == pytest.approx(0.3)  # shared again: counts
    # a round read before sizes were kept (an older checkpoint's record) counts as it did then
    assert DirectionMemory.from_history(0.8, [{"round": 1, "direction": {"global": {"a": -0.2, "b": -0.1}}}]
                                        ).judged(1) == {1: {"global": True}}
    assert RobustSettings.from_dict({"direction_min_change": 0}).direction_memory_for_run().min_change == 0.0
    with pytest.raises(Exception, match="direction_min_change"):
        RobustSettings.from_dict({"direction_min_change": 1.5})


def test_opposed_selector_changes_leave_no_fedsm_site_out(tiny_training):
    """FedSM's selector is trained at each site on one label, its own: honest sites' selector changes
    oppose each other (cpu-converged prostate: the two largest sites were left out of most rounds
    while the selector was judged). Only the segmentation model's direction is judged."""
    from engine.fl.methods import FedSM
    from engine.fl.robust import direction_readings

    method = FedSM(FUNDUS, NAMES, tiny_training, seed=0, rounds=1, lam=0.5)
    state = method.initial_state()
    agreeing = _updates(state, [1, 1, 1, 1, 1], counts=(10, 10, 10, 10, 60))
    generator = torch.Generator().manual_seed(1)
    common = {k: torch.randn(v.shape, generator=generator) * 1e-3 for k, v in state["selector"].items()
              if v.dtype.is_floating_point}
    updates = {}
    for site, sign in zip(NAMES, [1, 1, 1, 1, -1], strict=True):
        selector = {k: v + sign * common[k] if k in common else v for k, v in state["selector"].items()}
        updates[site] = SiteUpdate({"global": agreeing[site].weights["global"], "selector": selector},
                                   agreeing[site].num_samples, {})
    cosines, _ = direction_readings(method, state, updates)
    assert set(cosines) == {"global"} and min(cosines["global"].values()) > 0
    assert opposed_sites(method, state, updates, RobustSettings().min_cosine) == {}
    # the same reversal in the segmentation model is still left out
    flipped = {**updates, "site5": SiteUpdate({**updates["site5"].weights,
                                                "global": _updates(state, [1, 1, 1, 1, -1])["site5"].weights["global"]},
                                               60, {})}
    assert list(opposed_sites(method, state, flipped, RobustSettings().min_cosine)) == ["site5"]
