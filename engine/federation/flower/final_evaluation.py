"""The network run's last step: every site measures the final models on its own validation and test images.

After the last round the coordinator sends each connected site a ``query`` message with action
``"evaluate"`` that holds the final models that site may see: the global model and, for FedSM,
its own personalized model (never another site's). The site segments its datalist's
``validation`` and ``testing`` sections with each and answers with Dice numbers only (mean over
cases, overall and per structure): no image, mask or path leaves the site. The coordinator stores
them in the bundle: ``val_dice[site]`` is the validation Dice of the model that site's images
would use by default (FedSM: its personalized model; FedAvg/FedProx/Scaffold: the global model),
and ``extra["site_dice"]`` holds every number; ``summary.json`` repeats them.

Metric names in the answer: ``"<split>/<model>"`` and ``"<split>/<model>/<structure>"``, e.g.
``"testing/personalized/cup"``; splits without images are absent.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import ConfigError, WeightsError
from engine.federation.flower import records
from engine.federation.flower.grid_exchange import QUERY, exchange

if TYPE_CHECKING:
    from flwr.app import Grid, RecordDict

    from engine.federation.flower.client_app import SiteWorker
    from engine.federation.flower.server_app import FederationRunner
    from engine.fl.methods import WeightSet

log = logging.getLogger(__name__)

ACTION = "evaluate"
SPLITS = ("validation", "testing")
#: Which received model a site's default figure is for.
DEFAULT_MODEL = {"fedsm": "personalized", "fedsm-extra": "personalized"}


def site_weights(state: WeightSet, site: str) -> dict[str, Any]:
    """The final models ``site`` may see: the global one and its own personalized one."""
    weights: dict[str, Any] = {"global": state["global"]}
    if f"personal/{site}" in state:
        weights["personal"] = state[f"personal/{site}"]
    return weights


def evaluate_request(runner: FederationRunner, state: WeightSet, site: str) -> RecordDict:
    """The content of the ``evaluate`` query for ``site``."""
    from engine.fl.methods import SiteInstructions

    total = runner.method.total_rounds
    content = records.encode_instructions(SiteInstructions(total, site_weights(state, site), {"phase": ACTION}),
                                          rounds=total, method=runner.method.name, spec_json=runner.spec_json,
                                          session=runner.session, site=site)
    content.config_records[records.INFO]["action"] = ACTION
    return content


def evaluate_at_site(worker: SiteWorker, content: RecordDict) -> RecordDict:
    """The site half: Dice of the received final models on the site's validation and testing sections."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    from engine.fl.evaluation import dice_per_case, segment_with

    ins = records.decode_instructions(content)
    if ins.site != worker.cfg.name:
        raise ConfigError(f"the coordinator addressed this evaluation to site {ins.site!r}, but this is "
                          f"{worker.cfg.name!r}")
    method, spec = worker.method(ins.spec_json)
    values: dict[str, float] = {}
    if worker.validate:
        data = worker.data(spec.task, spec.image_size, spec.fundus_crop)
        names = {"global": "global", "personal": "personalized"}
        labels = list(method.task.label_names)
        for split_name, split in (("validation", data.validation), ("testing", data.test)):
            if not len(split.images):
                continue
            for key, weights in ins.instructions.weights.items():
                masks = segment_with(method.task, weights, split.images, worker.cfg.device)
                dice = dice_per_case(masks, split.masks, split.case_ids)
                model = names.get(key, key)
                values[f"{split_name}/{model}"] = float(np.mean(dice))
                for i, label in enumerate(labels):
                    values[f"{split_name}/{model}/{label}"] = float(np.mean(dice[:, i]))
        def means(split: str) -> dict[str, float]:
            return {k.split("/")[1]: round(v, 4) for k, v in values.items() if k.startswith(split + "/")
                    and k.count("/") == 1}

        worker.events.emit("metrics", round=ins.rounds, loss={}, dice=means("validation"),
                           test_dice=means("testing"), final=True)
    # the same two settings every reply carries (site, round): a site's answers have one shape
    return RecordDict({records.INFO: ConfigRecord({"site": worker.cfg.name, "round": int(ins.rounds)}),
                       records.METRICS: MetricRecord(values)})


def decode_evaluation(content: RecordDict, site: str) -> dict[str, dict[str, float]]:
    """``{split: {model or model/structure: Dice}}`` from a site's answer (:class:`WeightsError` if malformed)."""
    metrics = content.metric_records.get(records.METRICS)
    if metrics is None:
        raise WeightsError(f"the evaluation answer of {site} has no metrics record")
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        split, _, name = str(key).partition("/")
        v = float(value)  # type: ignore[arg-type]
        if split not in SPLITS or not name or not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise WeightsError(f"the evaluation answer of {site} holds {key!r} = {value!r}; expected "
                               "'validation/...' or 'testing/...' Dice values in [0, 1]")
        out.setdefault(split, {})[name] = v
    return out


def evaluate_final(runner: FederationRunner, grid: Grid, state: WeightSet) -> dict[str, dict[str, dict[str, float]]]:
    """Ask every connected site for the final models' Dice; return ``{site: {split: {model: Dice}}}``.

    Sites that are offline, do not answer within ``round_timeout`` or answer badly are left out
    (an ``error`` event says why); the run's result does not depend on them.
    """
    from flwr.app import Message

    if "global" not in state or runner.method.name == "local":
        return {}  # dialogue methods and local training: no shared final model to send
    online = runner.online_sites(grid)
    messages = {site: Message(evaluate_request(runner, state, site), dst_node_id=node, message_type=QUERY,
                              ttl=runner.settings.round_timeout)
                for site, node in online.items() if site in runner.sites}
    if not messages:
        return {}
    runner.events.status(f"final evaluation at {len(messages)} site(s): validation and testing Dice of the final "
                         "models")
    results: dict[str, dict[str, dict[str, float]]] = {}

    def on_reply(site: str, reply: Message) -> None:
        if reply.has_error():
            runner.events.error(f"final evaluation failed at the site: {reply.error.reason}", site=site)
            return
        try:
            results[site] = decode_evaluation(reply.content, site)
        except WeightsError as exc:
            runner.events.error(str(exc), site=site)

    _, missing = exchange(grid, messages, runner.settings.round_timeout, runner.settings.poll_interval,
                          runner._check_cancel_flag, on_reply)
    for site, reason in missing.items():
        runner.events.error(f"no final evaluation: {reason}", site=site)
    return {site: results[site] for site in runner.sites if site in results}


def bundle_val_dice(method: str, site_names: list[str], site_dice: dict[str, dict[str, dict[str, float]]] | None
                    ) -> dict[str, float | None]:
    """``val_dice`` for the bundle: each site's validation Dice of its default model (``None`` where unknown)."""
    model = DEFAULT_MODEL.get(method, "global")
    out: dict[str, float | None] = {}
    for site in site_names:
        value = (site_dice or {}).get(site, {}).get("validation", {}).get(model)
        out[site] = None if value is None else float(value)
    return out
