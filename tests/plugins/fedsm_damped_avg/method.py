"""The plugin's method: FedAvg whose coordinator moves only halfway towards the sites' average."""

from __future__ import annotations

from collections.abc import Mapping

from engine.fl.methods import FedAvg, SiteUpdate, WeightSet
from fedsm_damped_avg import NAME


class DampedAvg(FedAvg):
    """FedAvg whose server moves only halfway from the old global model towards the sites' average."""

    name = NAME

    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        new = super().aggregate(state, rnd, updates)
        new["global"] = {k: 0.5 * state["global"][k] + 0.5 * v if v.is_floating_point() else v
                         for k, v in new["global"].items()}
        return new
