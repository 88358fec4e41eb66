"""A modified site for loopback tests: ``fedsm site`` whose training replies are tampered with, round by round.

Run as ``python tests/federation/modified_site.py --config SITE.toml --json`` with
``FEDSM_TEST_ATTACKS="1=scale,2=count,..."``: the site trains honestly, then its reply in each
listed round is altered as a hostile site would (rounds not listed, queries and the
calibration round are answered honestly). Test-only: nothing in the product imports it.

Attacks (what issue 16 tried against the coordinator):

- ``scale``: every floating-point weight times 1e6;
- ``count``: zero weights claimed as 10^12 training samples (would replace the global model);
- ``layout``: the global part's first tensor declared as shape ``[2^32, 2^32]``;
- ``stats_only``: a FedSM reply holding only selector statistics (valid shapes) in a training round;
- ``oversize``: an extra part holding ``FEDSM_TEST_OVERSIZE_MB`` MiB of random float32 values beside the
  honest weights: a reply larger than the coordinator's per-reply limit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "FEDSM_TEST_ATTACKS"
OVERSIZE_ENV = "FEDSM_TEST_OVERSIZE_MB"


def planned_attacks() -> dict[int, str]:
    """``{round: attack}`` from :data:`ENV`."""
    plan = {}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        rnd, kind = item.split("=")
        plan[int(rnd)] = kind.strip()
    return plan


def tamper(content, kind: str, n_sites: int):
    """The reply record ``content`` of an honest training round, altered by ``kind``."""
    import torch

    from engine.federation.flower import records
    from engine.fl.methods import SiteUpdate

    site, rnd = content["fedsm"]["site"], content["fedsm"]["round"]
    update = records.decode_update(content, site, rnd)
    weights, count, metrics = update.weights, update.num_samples, update.metrics
    # the attacks alter the models; FedSM's style-gate sums (part "style_stats") stay consistent with
    # the claimed sample count, so that the coordinator's robust bounds are what must catch them
    style = {p: w for p, w in weights.items() if p == "style_stats"}
    models = {p: w for p, w in weights.items() if p != "style_stats"}
    if kind == "scale":
        weights = {**{p: {k: v * 1e6 if v.dtype.is_floating_point else v for k, v in w.items()}
                      for p, w in models.items()}, **style}
    elif kind == "count":
        weights = {p: {k: torch.zeros_like(v) for k, v in w.items()} for p, w in models.items()}
        weights |= {p: {**w, "count": torch.tensor([1e12], dtype=torch.float64)} for p, w in style.items()}
        count = 10**12
    elif kind == "stats_only":
        weights = {"selector_stats": {"count": torch.ones(n_sites), "sum": torch.zeros(n_sites, 3),
                                      "outer": torch.zeros(3, 3)}}
        metrics = {}
    elif kind == "oversize":
        mib = float(os.environ.get(OVERSIZE_ENV, "600"))
        # random values: Flower stores objects by content hash, so 5 MiB chunks of zeros would travel once
        noise = torch.randn(int(mib * 2**20) // 4, generator=torch.Generator().manual_seed(rnd), dtype=torch.float32)
        weights = {**weights, "padding": {"noise": noise}}
    elif kind != "layout":
        raise ValueError(f"unknown attack {kind!r}")
    encoded = records.encode_update(SiteUpdate(weights, count, metrics), site=site, rnd=rnd)
    if kind == "layout":
        layouts = encoded.config_records[records.LAYOUT]
        layout = json.loads(layouts["global"])
        layout[0][2] = [2**32, 2**32]
        layouts["global"] = json.dumps(layout)
    return encoded


def install(plan: dict[int, str]) -> None:
    """Make ``run_site`` build a ClientApp whose training replies follow ``plan``."""
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from engine.federation.flower import client_app

    honest_build = client_app.build_client_app

    def build(worker):
        honest = honest_build(worker)
        app = ClientApp()

        @app.train()
        def train(msg, context):
            reply = honest(message=msg, context=context)
            rnd = int(msg.content["fedsm"]["round"]) if "fedsm" in msg.content else 0
            if reply.has_error() or rnd not in plan:
                return reply
            spec = json.loads(msg.content["fedsm"]["spec"])
            worker.events.status(f"modified site: attack {plan[rnd]!r} in round {rnd}")
            return Message(tamper(reply.content, plan[rnd], len(spec["site_names"])), reply_to=msg)

        @app.query()
        def query(msg, context):
            return honest(message=msg, context=context)

        return app

    client_app.build_client_app = build


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    install(planned_attacks())
    from engine.cli.main import main as fedsm

    return fedsm(["site", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
