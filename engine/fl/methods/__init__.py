"""Federated weight methods, by family (the catalogue, :mod:`engine.catalogue`, names them).

- :mod:`.contract`: the server half / site half every method keeps, and the payload types;
- :mod:`.averaging`: FedAvg (Centralized is FedAvg over one pooled site), FedProx, Scaffold, Local;
- :mod:`.fedsm`: FedSM and FedSM-extra.

The names below are re-exported so callers import them from one place.
"""

from engine.fl.methods.averaging import FedAvg, FedProx, LocalOnly, Scaffold
from engine.fl.methods.contract import (
    OPTIM_PART,
    FederatedMethod,
    SiteInstructions,
    SiteRuntime,
    SiteUpdate,
    WeightSet,
    derived_seed,
)
from engine.fl.methods.fedsm import (
    GAMMA_PART,
    LAST_ROUND_PARTS,
    TEMPERATURE_PART,
    VALIDATION_METRICS,
    FedSM,
    FedSMExtra,
    check_statistics,
    check_validation_metrics,
    empirical_log_priors,
    selector_statistics,
    site_validation_dice,
)

__all__ = [
    "GAMMA_PART", "LAST_ROUND_PARTS", "OPTIM_PART", "TEMPERATURE_PART", "VALIDATION_METRICS", "FedAvg", "FedProx",
    "FedSM", "FedSMExtra", "FederatedMethod", "LocalOnly", "Scaffold", "SiteInstructions", "SiteRuntime",
    "SiteUpdate", "WeightSet", "check_statistics", "check_validation_metrics", "derived_seed",
    "empirical_log_priors", "selector_statistics", "site_validation_dice",
]
