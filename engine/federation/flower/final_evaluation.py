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

This module is the exchange's contract (action, splits, what a site may see, how an answer reads);
each side's half lives with that side: :func:`.server_app.evaluate_final` (the coordinator asks) and
:func:`.client_app.evaluate_at_site` (the site answers), so neither side's module is needed here.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from engine.errors import WeightsError
from engine.federation.flower import records

if TYPE_CHECKING:
    from flwr.app import RecordDict

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


def bundle_val_dice(method: str, site_names: list[str], site_dice: dict[str, dict[str, dict[str, float]]] | None
                    ) -> dict[str, float | None]:
    """``val_dice`` for the bundle: each site's validation Dice of its default model (``None`` where unknown)."""
    model = DEFAULT_MODEL.get(method, "global")
    out: dict[str, float | None] = {}
    for site in site_names:
        value = (site_dice or {}).get(site, {}).get("validation", {}).get(model)
        out[site] = None if value is None else float(value)
    return out
