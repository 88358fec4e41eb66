"""The ServerApp's round loop with the real ClientApp, over a Grid without a network.

# Prepare: synthetic sites written to real files, one SiteWorker (the site half) per site.
# Execute: FederationRunner rounds through FakeGrid (messages serialised as on the wire).
# Assert: weights, who answered, who was left out and why, events, checkpoints.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from fakegrid import FakeGrid, workers_for

from engine.data.site_data import load_site
from engine.errors import FedSMError
from engine.federation.checkpoint import Checkpoint
from engine.federation.events import EventWriter
from engine.federation.flower import records
from engine.federation.flower.server_app import FederationRunner, RegisteredSites, RoundSettings, SelfNamedSites
from engine.federation.inprocess import run_rounds
from engine.federation.spec import MethodSpec, build_method
from engine.fl.methods import SiteRuntime, SiteUpdate
from engine.fl.wire_precision import decode_up
from engine.tasks import get_task

SITES = ("site1", "site2", "site3")


@pytest.fixture(scope="module")
def datalists(tmp_path_factory):
    from engine.data.synth import generate_federation

    return generate_federation("fundus", 3, tmp_path_factory.mktemp("data"), image_size=32, seed=0)


def spec(method="fedavg", rounds=1, **kw):
    # a 16-wide selector: the same parts and messages at 1/16 of the paper's selector parameters
    if method == "fedsm":
        kw.setdefault("personalization", "softpull")  # the server holds SoftPull's personalized models
    return MethodSpec(method=method, task="fundus", site_names=SITES, rounds=rounds, image_size=32, batch_size=4,
                      selector_lr=1e-4, selector_width=16, **kw)


def runner(spec_, grid, tmp_path, events, min_sites=1, timeout=5.0, attempts=1, cancel=None):
    directory = RegisteredSites({w.cfg.name: node for node, w in grid.workers.items()})
    return FederationRunner(build_method(spec_, "cpu"), spec_,
                            RoundSettings(min_sites=min_sites, round_timeout=timeout, start_timeout=2.0,
                                          round_attempts=attempts, poll_interval=0.01),
                            directory, EventWriter("server", listener=events.append), tmp_path / "ckpt.safetensors",
                            "session1", "sha256:" + "0" * 64, cancel=cancel)


def simulated(spec_, datalists):
    method = build_method(spec_, "cpu")
    loaded = [load_site(dl, get_task("fundus"), 32, name=name) for name, dl in zip(SITES, datalists, strict=True)]
    sites = [SiteRuntime(s.name, k, s.train, validation=s.validation) for k, s in enumerate(loaded)]
    state, _ = run_rounds(method, sites, method.total_rounds)
    return state


def assert_same_state(a, b, exact=True):
    assert set(a) == set(b)
    for part in a:
        for key in a[part]:
            if exact:
                assert torch.equal(a[part][key], b[part][key]), (part, key)
            else:
                assert torch.allclose(a[part][key], b[part][key], atol=1e-6), (part, key)


def node_of(grid, site):
    return next(n for n, w in grid.workers.items() if w.cfg.name == site)


def test_fedsm_over_the_grid_equals_the_in_process_simulation(datalists, tmp_path):
    s = spec("fedsm", rounds=1)
    events: list[dict] = []
    grid = FakeGrid(workers_for(datalists, tmp_path, events=events))
    state = runner(s, grid, tmp_path, events).run(grid)
    assert_same_state(state, simulated(s, datalists))
    ends = [e for e in events if e["event"] == "round_end" and e["source"] == "server"]
    assert [e["answered"] for e in ends] == [list(SITES)] * 2 and all(e["left_out"] == {} for e in ends)
    # every site got its own personalized model: the message to site2 carried site2's part
    received = [e for e in events if e["event"] == "received" and e["source"] == "site" and e["round"] == 1]
    assert {e["site"] for e in received} == set(SITES)
    from engine.fl.selector_training import initial_optimizer_state
    from engine.models import build_selector

    moments = len(initial_optimizer_state(build_selector(3, 3, "gap", 16)))  # exp_avg, exp_avg_sq per parameter, step
    assert all(e["contents"] == {"global": 63, "personal": 63, "selector": 60, "selector_optim": moments}
               for e in received)
    assert Checkpoint.load(tmp_path / "ckpt.safetensors").round == 2


def test_silent_site_is_left_out_keeps_its_model_and_returns(datalists, tmp_path):
    s = spec("fedsm", rounds=1)
    events: list[dict] = []
    grid = FakeGrid(workers_for(datalists, tmp_path, events=events))
    run = runner(s, grid, tmp_path, events, min_sites=2, timeout=0.3)
    initial = run.method.initial_state()
    grid.silent = {node_of(grid, "site3")}
    after_round_1 = run._round(grid, initial, 1, _NoWriter())
    end = [e for e in events if e["event"] == "round_end"][-1]
    assert end["answered"] == ["site1", "site2"] and "no answer within 0.3 s" in end["left_out"]["site3"]
    for key, value in initial["personal/site3"].items():
        assert torch.equal(after_round_1["personal/site3"][key], value)  # kept its personalized model
    assert not torch.equal(after_round_1["personal/site1"]["model.0.conv.unit0.conv.weight"],
                           initial["personal/site1"]["model.0.conv.unit0.conv.weight"])
    grid.silent = set()  # back next round
    run._round(grid, after_round_1, 2, _NoWriter())
    assert [e for e in events if e["event"] == "round_end"][-1]["answered"] == list(SITES)


class _NoWriter:
    def submit(self, checkpoint, path):
        pass


def tamper_with(kind):
    def tamper(node, reply):
        update = records.decode_update(reply.content, reply.content["fedsm"]["site"], reply.content["fedsm"]["round"])
        w = update.weights["global"]
        key = "model.0.conv.unit0.conv.weight"
        if kind == "nan":
            w[key] = w[key].clone()
            w[key].view(-1)[3] = math.nan
        elif kind == "inf":
            w[key] = torch.full_like(w[key], math.inf)
        elif kind == "shape":
            w[key] = w[key][:1]
        elif kind == "dtype":
            w[key] = w[key].double()
        elif kind == "keys":
            w["extra.weight"] = torch.zeros(1)
        elif kind == "parts":
            update.weights["selector"] = w
        reply.content = records.encode_update(update, site=reply.content["fedsm"]["site"], rnd=1)
        return reply
    return tamper


@pytest.mark.parametrize(("kind", "reason"), [
    ("nan", "contains NaN or Inf"), ("inf", "contains NaN or Inf"), ("shape", "has shape"),
    ("dtype", "has dtype torch.float64"), ("keys", "unexpected keys ['extra.weight']"),
    ("parts", "has parts ['global', 'selector']"),
])
def test_bad_update_is_rejected_and_not_aggregated(datalists, tmp_path, kind, reason):
    s = spec("fedavg", rounds=1)
    events: list[dict] = []
    workers = workers_for(datalists, tmp_path)
    bad = node_of(FakeGrid(workers), "site2")
    grid = FakeGrid(workers, tamper=lambda node, reply: tamper_with(kind)(node, reply) if node == bad else reply)
    run = runner(s, grid, tmp_path, events)
    state = run.run(grid)
    end = [e for e in events if e["event"] == "round_end"][-1]
    assert end["answered"] == ["site1", "site3"]
    assert end["left_out"]["site2"].startswith("update rejected") and reason in end["left_out"]["site2"]
    assert any(e["event"] == "error" and e["site"] == "site2" and reason in e["message"] for e in events)
    # the aggregate is exactly FedAvg over the two good sites
    method = build_method(s, "cpu")
    initial = method.initial_state()
    good = {}
    for u in grid.sent:
        site = u.content["fedsm"]["site"]
        if site != "site2":  # each reply's 16-bit differences, added to what the coordinator sent that site
            reply = records.decode_update(u.content, site, 1)
            sent = method.site_instructions(initial, 1, site).weights
            good[site] = SiteUpdate(decode_up(reply.weights, sent, method.wire_parts(1)), reply.num_samples,
                                    reply.metrics)
    expected = method.aggregate(initial, 1, {k: good[k] for k in ("site1", "site3")})
    assert_same_state(state, expected)


def test_too_few_answers_repeat_the_round_then_stop(datalists, tmp_path):
    events: list[dict] = []
    grid = FakeGrid(workers_for(datalists, tmp_path))
    grid.silent = {node_of(grid, "site2"), node_of(grid, "site3")}
    with pytest.raises(FedSMError, match=r"fewer than min_sites = 2 .* 'fedsm server --resume'"):
        runner(spec(), grid, tmp_path, events, min_sites=2, timeout=0.2, attempts=2).run(grid)
    errors = [e["message"] for e in events if e["event"] == "error" and e["site"] is None]
    assert [m.split("(")[1] for m in errors] == ["attempt 1 of 2)", "attempt 2 of 2)"]
    assert not (tmp_path / "ckpt.safetensors").exists()


def test_offline_site_is_not_sent_anything(datalists, tmp_path):
    events: list[dict] = []
    grid = FakeGrid(workers_for(datalists, tmp_path))
    grid.offline = {node_of(grid, "site1")}
    run = runner(spec(), grid, tmp_path, events, min_sites=2)
    run.run(grid)
    end = [e for e in events if e["event"] == "round_end"][-1]
    assert end["left_out"] == {"site1": "not connected"}
    assert not any(e["event"] == "sent" and e["site"] == "site1" for e in events)


def test_site_that_disconnects_mid_round_is_given_up_before_the_timeout(datalists, tmp_path):
    events: list[dict] = []
    grid = FakeGrid(workers_for(datalists, tmp_path))
    grid.dies_on_receipt = {node_of(grid, "site2")}
    run = runner(spec(), grid, tmp_path, events, min_sites=2, timeout=120.0)
    started = time.monotonic()
    run.run(grid)
    assert time.monotonic() - started < 60  # not the 120 s timeout
    end = [e for e in events if e["event"] == "round_end"][-1]
    assert end["answered"] == ["site1", "site3"]
    assert end["left_out"] == {"site2": "disconnected while the coordinator waited for its answer"}


@pytest.mark.parametrize("method, rounds", [
    ("scaffold", 3),  # Scaffold: the sites' private control variates must survive too
    # FedSM: personalized models, the selector and its optimizer moments, then calibration (~20 s of CPU)
    pytest.param("fedsm", 2, marks=pytest.mark.slow),
])
def test_resume_after_a_crash_equals_an_uninterrupted_run(datalists, tmp_path, method, rounds):
    s = spec(method, rounds=rounds)
    total = s.total_rounds  # FedSM: + its calibration round
    whole = runner(s, FakeGrid(workers_for(datalists, tmp_path / "a")), tmp_path / "a", []).run(
        FakeGrid(workers_for(datalists, tmp_path / "a")))
    stop_after = {"round": 0}

    def cancel():
        return stop_after["round"] >= 2

    events: list[dict] = []
    grid = FakeGrid(workers_for(datalists, tmp_path / "b"), tamper=lambda n, r: _count(stop_after, r))
    with pytest.raises(FedSMError):
        runner(s, grid, tmp_path / "b", events, cancel=cancel).run(grid)
    checkpoint = Checkpoint.load(tmp_path / "b" / "ckpt.safetensors")
    assert checkpoint.round in (1, 2)
    events = []
    resumed_grid = FakeGrid(workers_for(datalists, tmp_path / "b"))  # new site processes, same work folders
    resumed = runner(s, resumed_grid, tmp_path / "b", events).run(resumed_grid, checkpoint)
    assert [e["round"] for e in events if e["event"] == "round_start"] == list(range(checkpoint.round + 1, total + 1))
    assert_same_state(resumed, whole)


def _count(counter, reply):
    counter["round"] = max(counter["round"], int(reply.content["fedsm"]["round"]))
    return reply


def test_insecure_mode_asks_nodes_their_names(datalists, tmp_path):
    grid = FakeGrid(workers_for(datalists, tmp_path))
    directory = SelfNamedSites(SITES, poll_interval=0.01, timeout=2.0)
    online = directory.online(grid)
    assert online == {w.cfg.name: node for node, w in grid.workers.items()}
