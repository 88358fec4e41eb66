"""Dialogue methods through the in-process transport: exchanges, failures as data, declared tensors."""

from typing import ClassVar

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import WeightsError
from engine.federation.inprocess import run_exchange_rounds
from engine.fl.exchange import ExchangeMethod, Failure, Reply, Request
from engine.fl.methods import SiteRuntime
from engine.tasks import FUNDUS


class FederatedVariance(ExchangeMethod):
    """Two exchanges per round: the sites' sums give the mean, then squared deviations give the variance."""

    name = "variance"
    REQUEST_CONTENTS: ClassVar = {"mean": "the federation's mean intensity"}
    REPLY_CONTENTS: ClassVar = {"sum": "sum of the site's pixel values", "sq": "sum of squared deviations"}

    def initial_state(self):
        return {"stats": {"mean": torch.zeros(()), "var": torch.zeros(())}}

    def dialogue(self, state, rnd):
        answers = yield {s: Request("sum") for s in self.site_names}
        ok = {s: a for s, a in answers.items() if not isinstance(a, Failure)}
        total = sum(float(a.tensors["sum"]) for a in ok.values())
        count = sum(a.num_samples for a in ok.values())
        mean = torch.tensor(total / count, dtype=torch.float64)
        answers = yield {s: Request("deviation", {"mean": mean}) for s in ok}
        sq = sum(float(a.tensors["sq"]) for a in answers.values() if not isinstance(a, Failure))
        return {"stats": {"mean": mean, "var": torch.tensor(sq / count, dtype=torch.float64)}}

    def answer(self, request, site, progress=None, cancel=None):
        values = torch.from_numpy(site.train.images.astype(np.float64))
        if request.action == "sum":
            return Reply({"sum": values.sum()}, {"pixels": float(values.numel())}, values.numel())
        return Reply({"sq": ((values - request.tensors["mean"]) ** 2).sum()}, {}, values.numel())

    def segmenter(self, state, sites, device="auto"):
        return lambda k, images: np.zeros((len(images), 2, *images.shape[2:]), np.float32)


def runtimes(n=3):
    return [SiteRuntime(f"site{k + 1}", k, random_split(2 + k, seed=k, shift=0.2 * k, size=8)) for k in range(n)]


def test_dialogue_computes_what_pooled_data_gives():
    # Prepare
    sites = runtimes()
    pooled = np.concatenate([s.train.images.astype(np.float64).ravel() for s in sites])
    seen = []
    # Execute
    state, records = run_exchange_rounds(FederatedVariance(FUNDUS, [s.name for s in sites]), sites, 1,
                                         recorder=seen.append)
    # Assert
    assert float(state["stats"]["mean"]) == pytest.approx(pooled.mean(), rel=1e-12)
    assert float(state["stats"]["var"]) == pytest.approx(pooled.var(), rel=1e-10)
    assert [r.action for r in seen] == ["sum"] * 3 + ["deviation"] * 3
    assert records[0].answered == ["site1", "site2", "site3"]
    assert records[0].metrics["site1"]["exchanges"] == 2.0
    assert records[0].bytes_to_site["site1"] == 8  # one float64 mean; the "sum" request carries nothing
    assert records[0].bytes_from_site["site2"] == 16


def test_a_failing_site_reaches_the_dialogue_as_data():
    sites = runtimes()

    class Flaky(FederatedVariance):
        def answer(self, request, site, progress=None, cancel=None):
            if site.name == "site2":
                raise RuntimeError("disk unplugged")
            return super().answer(request, site, progress, cancel)

    events = []
    state, records = run_exchange_rounds(Flaky(FUNDUS, [s.name for s in sites]), sites, 1, progress=events.append)
    rest = np.concatenate([s.train.images.astype(np.float64).ravel() for s in sites if s.name != "site2"])
    assert float(state["stats"]["mean"]) == pytest.approx(rest.mean(), rel=1e-12)
    assert "site2" in records[0].failed and records[0].answered == ["site1", "site3"]
    assert any(e["event"] == "error" and e["site"] == "site2" for e in events)


def test_undeclared_or_non_finite_reply_tensors_are_refused():
    method = FederatedVariance(FUNDUS, ["a"])
    request = Request("sum")
    with pytest.raises(WeightsError, match="undeclared"):
        method.validate_reply(request, "a", Reply({"weights": torch.zeros(3)}))
    with pytest.raises(WeightsError, match="NaN or Inf"):
        method.validate_reply(request, "a", Reply({"sum": torch.tensor(float("nan"))}))
    with pytest.raises(WeightsError, match="undeclared"):
        method.check_request(Request("sum", {"gradient": torch.zeros(2)}))
