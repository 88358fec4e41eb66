"""FedSM's global model is FedAvg's, bit for bit: it trains on FedAvg's batches with FedAvg's optimizer,
whatever the personalization rule (engine.fl.methods.contract.FederatedMethod._fedavg_seed), so a paired
comparison of FedSM with FedAvg measures only what the personalized models and the routing add."""

import pytest
import torch
from test_robust_clip import NAMES, _sites

from engine.federation.inprocess import run_rounds
from engine.fl.methods import FedAvg
from engine.fl.methods.fedsm import FedSM, FedSMExtra
from engine.fl.robust import RobustSettings
from engine.tasks import FUNDUS

ROUNDS = 1


@pytest.fixture(scope="module")
def fedavg_global(tiny_training_module):
    state, _ = run_rounds(FedAvg(FUNDUS, NAMES, tiny_training_module, seed=3, rounds=ROUNDS), _sites(), ROUNDS,
                          robust=RobustSettings())
    return state["global"]


@pytest.fixture(scope="module")
def tiny_training_module():
    from engine.fl.local_training import LocalTrainingConfig

    return LocalTrainingConfig(epochs=1, batch_size=4, lr=1e-3, selector_lr=1e-4, selector_size=32, device="cpu",
                               selector_width=8)  # a narrow selector: only the global model is compared


@pytest.mark.parametrize("rule", ["softpull", "apfl", "finetune", "perfedavg", "pfedme", "fedsm-extra"])
def test_fedsms_global_model_equals_fedavgs_round_for_round(rule, fedavg_global, tiny_training_module):
    if rule == "fedsm-extra":
        method = FedSMExtra(FUNDUS, NAMES, tiny_training_module, seed=3, rounds=ROUNDS)
    else:
        method = FedSM(FUNDUS, NAMES, tiny_training_module, seed=3, rounds=ROUNDS, personalization=rule)
    state, records = run_rounds(method, _sites(), ROUNDS, robust=RobustSettings())  # the training rounds
    assert all(r.answered == NAMES for r in records)
    initial = FedAvg(FUNDUS, NAMES, tiny_training_module, seed=3).initial_state()["global"]
    assert any(not torch.equal(fedavg_global[k], initial[k]) for k in initial)  # it trained
    assert all(torch.equal(state["global"][k], fedavg_global[k]) for k in fedavg_global), rule
