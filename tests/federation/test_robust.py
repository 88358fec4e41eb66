"""A modified site cannot take over or crash the coordinator (engine.fl.robust, the ServerApp's checks).

# Prepare: three synthetic sites with the real ClientApp over FakeGrid (messages serialised as on
#          the wire); site2's replies are altered after its honest training.
# Execute: a FedSM run (one training round + calibration).
# Assert: site2 is left out of the altered round with an error event, the round completes with
#         site1 and site3, the coordinator does not raise, and the final state equals the run in
#         which site2 simply did not answer that round (so every Dice is unchanged: difference 0).
"""

from __future__ import annotations

import json

import pytest
import torch
from fakegrid import FakeGrid, workers_for
from test_server_app import SITES, assert_same_state, node_of, runner, spec

from engine.errors import ConfigError
from engine.federation.flower import records
from engine.fl.methods import SiteUpdate
from engine.fl.robust import RobustSettings, UpdateRejected, UpdateScreen, coordinate_wise


def _alter(kind):
    def alter(reply):
        content = reply.content
        site, rnd = content["fedsm"]["site"], content["fedsm"]["round"]
        if rnd != 1:
            return reply  # the calibration round is honest
        update = records.decode_update(content, site, rnd)
        if kind == "scale":  # x1e6 update
            update = SiteUpdate({p: {k: v * 1e6 if v.dtype.is_floating_point else v for k, v in w.items()}
                                 for p, w in update.weights.items()}, update.num_samples, update.metrics)
        elif kind == "count":  # 10^12 samples with zero weights: would replace the global model
            update = SiteUpdate({p: {k: torch.zeros_like(v) for k, v in w.items()} for p, w in update.weights.items()},
                                10**12, update.metrics)
        elif kind == "stats_only":  # a FedSM reply holding only selector statistics, in a training round
            from engine.fl.selector_calibration import STAT_KEYS

            k = len(SITES)
            stats = {key: torch.zeros(k, 3) if key != "count" else torch.ones(k) for key in STAT_KEYS}
            update = SiteUpdate({"selector_stats": stats}, update.num_samples, {})
        encoded = records.encode_update(update, site=site, rnd=rnd)
        if kind == "layout":  # a crafted layout shape [2^32, 2^32]
            layouts = encoded.config_records[records.LAYOUT]
            layout = json.loads(layouts["global"])
            layout[0][2] = [2**32, 2**32]
            layouts["global"] = json.dumps(layout)
        reply.content = encoded
        return reply
    return alter


def _run(datalists, tmp_path, events, tamper=None, silent_in_round_1=False):
    workers = workers_for(datalists, tmp_path)
    bad = node_of(FakeGrid(workers), "site2")
    grid = FakeGrid(workers, tamper=None if tamper is None else (lambda node, r: tamper(r) if node == bad else r))
    if silent_in_round_1:
        grid.silent = {bad}
        original = grid.push_messages

        def push(messages):
            ids = original(messages)
            grid.silent = set()  # answers again from round 2 (calibration) on
            return ids

        grid.push_messages = push
    return runner(spec("fedsm", rounds=1), grid, tmp_path, events, min_sites=2, timeout=2.0).run(grid)


@pytest.fixture(scope="module")
def datalists(tmp_path_factory):
    from engine.data.synth import generate_federation

    return generate_federation("fundus", 3, tmp_path_factory.mktemp("data"), image_size=32, seed=0)


@pytest.fixture(scope="module")
def without_site2(datalists, tmp_path_factory):
    """The reference: site2 does not answer round 1."""
    return _run(datalists, tmp_path_factory.mktemp("ref"), [], silent_in_round_1=True)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "reason"), [
    ("scale", "times its norm, above [robust] max_relative_update"),
    ("count", "claims 1000000000000 training samples"),
    ("layout", "update rejected"),
    ("stats_only", "cannot use it"),
])
def test_modified_site_is_left_out_and_the_round_completes(datalists, without_site2, tmp_path, kind, reason):
    events: list[dict] = []
    state = _run(datalists, tmp_path, events, tamper=_alter(kind))  # never raises: the coordinator goes on
    first = next(e for e in events if e["event"] == "round_end" and e["round"] == 1)
    assert first["answered"] == ["site1", "site3"], first
    assert reason in first["left_out"]["site2"], first["left_out"]
    assert any(e["event"] == "error" and e["site"] == "site2" and reason in e["message"] for e in events)
    last = [e for e in events if e["event"] == "round_end"][-1]
    assert last["answered"] == list(SITES)  # site2 is back, honest, in the calibration round
    assert_same_state(state, without_site2)  # hence the same global model and Dice as without site2
    if kind == "scale":
        from engine.data.site_data import load_site
        from engine.tasks import get_task

        task = get_task("fundus")
        val = load_site(datalists[0], task, 32, name="site1").validation
        dice = _dice(task, state["global"], val)
        assert abs(dice - _dice(task, without_site2["global"], val)) <= 0.01


def _dice(task, weights, split):
    from engine.fl.evaluation import dice_per_case, segment_with

    return float(dice_per_case(segment_with(task, weights, split.images, "cpu"), split.masks > 0.5,
                               split.case_ids).mean())


def test_settings_are_checked():
    assert RobustSettings.from_dict({}) == RobustSettings()
    s = RobustSettings.from_dict({"max_relative_update": 2, "norm_action": "clip", "num_examples": {"site1": 10},
                                  "aggregation": "median"})
    assert (s.max_relative_update, s.norm_action, s.num_examples, s.aggregation) == (2.0, "clip", {"site1": 10},
                                                                                   "median")
    for bad, match in [({"norm_action": "ignore"}, "norm_action"), ({"max_relative_update": -1}, "max_relative"),
                       ({"num_examples": {"site1": 0}}, "num_examples"), ({"aggregation": "mode"}, "aggregation"),
                       ({"trim": 0.5}, "trim"), ({"bogus": 1}, "unknown key")]:
        with pytest.raises(ConfigError, match=match):
            RobustSettings.from_dict(bad)


class _Method:
    name = "fedavg"

    def __init__(self, ref):
        self.ref = ref

    def expected_update_shapes(self, state, site):
        return {"global": self.ref}


def test_screen_bounds_counts_and_clips():
    ref = {"w": torch.ones(100), "steps": torch.tensor(3)}
    method = _Method(ref)
    errors: list[tuple[str, str]] = []
    screen = UpdateScreen(RobustSettings(max_relative_update=0.5, norm_action="clip",
                                         num_examples={"site1": 50}), lambda s, m: errors.append((s, m)))
    ok = SiteUpdate({"global": {"w": torch.full((100,), 1.1), "steps": torch.tensor(3)}}, 50)
    assert screen.screen(method, {}, "site1", ok) is ok  # 10 % change, declared count
    with pytest.raises(UpdateRejected, match="claims 51"):
        screen.screen(method, {}, "site1", SiteUpdate(ok.weights, 51))
    # site2 declared nothing: its first count is its bound
    screen.screen(method, {}, "site2", SiteUpdate(ok.weights, 20))
    with pytest.raises(UpdateRejected, match="claims 21"):
        screen.screen(method, {}, "site2", SiteUpdate(ok.weights, 21))
    big = SiteUpdate({"global": {"w": torch.full((100,), 3.0), "steps": torch.tensor(3)}}, 20)  # change 2x norm
    clipped = screen.screen(method, {}, "site2", big)
    change = torch.linalg.vector_norm(clipped.weights["global"]["w"] - 1) / torch.linalg.vector_norm(ref["w"])
    assert float(change) == pytest.approx(0.5, rel=1e-5) and errors and "clipped" in errors[0][1]
    rejecting = UpdateScreen(RobustSettings(max_relative_update=0.5))
    with pytest.raises(UpdateRejected, match="times its norm"):
        rejecting.screen(method, {}, "site2", big)


def test_coordinate_wise_median_and_trimmed_mean():
    parts = [{"w": torch.tensor([1.0, 10.0])}, {"w": torch.tensor([2.0, 20.0])}, {"w": torch.tensor([1e6, -1e6])},
             {"w": torch.tensor([3.0, 30.0])}, {"w": torch.tensor([4.0, 40.0])}]
    assert torch.equal(coordinate_wise(parts, "median")["w"], torch.tensor([3.0, 20.0]))
    assert torch.allclose(coordinate_wise(parts, "trimmed_mean", 0.2)["w"], torch.tensor([3.0, 20.0]))
    assert torch.equal(coordinate_wise(parts[:2], "median")["w"], torch.tensor([1.5, 15.0]))
