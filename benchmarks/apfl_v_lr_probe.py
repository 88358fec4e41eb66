"""APFL private-model optimizer probe (the numbers behind ``PersonalizationConfig.apfl_v_lr``).

FedSM + APFL on the synthetic fundus federation (6 sites, 64 px, data seed 0, training seed 0),
8 training rounds, 1 local epoch, batch 8, Adam lr 1e-3 for the global model and the selector;
prints the mean personal loss and alpha per round and the validation Dice (client average) of the
personalized mixtures and of the global model::

    OMP_NUM_THREADS=1 python benchmarks/apfl_v_lr_probe.py sgd 3.0 --data /tmp/conv/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("optimizer", choices=["sgd", "adam"])
    p.add_argument("v_lr", type=float, nargs="?", default=3.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--data", default="/tmp/conv/data")
    a = p.parse_args()
    torch.set_num_threads(1)

    from engine.bench.jobs import load_task_sites
    from engine.bench.presets import BenchPreset, TaskPreset
    from engine.federation.inprocess import run_rounds
    from engine.fl.evaluation import dice_per_case, segment_with
    from engine.fl.local_training import LocalTrainingConfig
    from engine.fl.methods import FedSMPersonalized, SiteRuntime
    from engine.fl.personalization import PersonalizationConfig
    from engine.tasks import FUNDUS

    tp = TaskPreset("fundus", sites=6, image_size=64, rounds=a.rounds)
    sites = load_task_sites(BenchPreset(name="probe", tasks=(tp,)), tp, Path(a.data))
    pcfg = PersonalizationConfig(apfl_v_optimizer=a.optimizer, apfl_v_lr=a.v_lr)
    method = FedSMPersonalized(FUNDUS, [s.name for s in sites], LocalTrainingConfig(device="cpu"), 0, a.rounds,
                               personalization="apfl", personalization_config=pcfg)
    runtimes = [SiteRuntime(s.name, i, s.train) for i, s in enumerate(sites)]
    state, records = run_rounds(method, runtimes, method.total_rounds)

    def val(weights_for) -> float:
        return float(np.mean([dice_per_case(segment_with(FUNDUS, weights_for(s), s.validation.images, "cpu"),
                                            s.validation.masks, s.validation.case_ids).mean() for s in sites]))

    training = records[:-1]  # the last round is the calibration round
    print(json.dumps({
        "optimizer": a.optimizer, "v_lr": a.v_lr,
        "loss_personal": [round(float(np.mean([m["loss_personal"] for m in r.metrics.values()])), 4) for r in training],
        "alpha": [round(float(np.mean([m["apfl_alpha"] for m in r.metrics.values()])), 3) for r in training],
        "val_personal": round(val(lambda s: state[f"personal/{s.name}"]), 4),
        "val_global": round(val(lambda s: state["global"]), 4)}))


if __name__ == "__main__":
    main()
