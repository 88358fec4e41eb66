"""What the engine knows about its weight methods by name, without torch.

The first piece of one method catalogue (issue 31): the method lists and the defaults that
several layers read (the simulation, the network run spec, the signed spec a site checks) live
here, below all of them, instead of in :mod:`engine.simulate`, which the network layer must not
import. Importing this module costs no torch: a SuperNode checking a run against its site's
``[bounds]`` stays a small Flower process.
"""

from __future__ import annotations

#: Every weight method ``fedsm simulate --methods`` accepts, in the order the report lists them.
ALL_METHODS = ("centralized", "local", "fedavg", "fedprox", "scaffold", "fedsm", "fedsm-extra")
#: Weight methods a federation can run over the network.
FEDERATION_METHODS = ("fedavg", "fedprox", "scaffold", "fedsm", "fedsm-extra", "local")
#: SoftPull lam per task when none is given (the paper's best values).
DEFAULT_LAM = {"fundus": 0.7, "prostate": 0.3}


def extra_rounds_default(rounds: int) -> int:
    """FedSM-extra's selector rounds when none are given: half the training rounds, rounded up (paper: 100 + 50)."""
    return max(1, -(-int(rounds) // 2))
