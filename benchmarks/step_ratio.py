"""Cost of a FedSM site step relative to a FedAvg site step, measured in one run.

A FedAvg site step is one Adam step of the U-Net; a FedSM site step (Algorithm 1) is one step
of the global U-Net, one of the personalized U-Net and one of the selector on a downscaled
copy of the batch. Both are timed through the real local trainers on the same batches.

    python benchmarks/step_ratio.py [--sizes 64 128 256] [--selector-size 32] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engine.data.site_data import SplitArrays
from engine.fl.local_training import (
    LocalTrainingConfig,
    RoundContext,
    train_fedsm_round,
    train_segmentation_round,
)
from engine.fl.weights import model_weights
from engine.models import build_segmentation_net, build_selector
from engine.tasks import FUNDUS


def _data(n: int, size: int) -> SplitArrays:
    rng = np.random.default_rng(0)
    return SplitArrays(rng.random((n, 3, size, size), dtype=np.float32),
                       (rng.random((n, 2, size, size)) > 0.5).astype(np.float32), np.arange(n))


def measure(size: int, selector_size: int, batch_size: int, batches: int, repeats: int) -> tuple[float, float]:
    cfg = LocalTrainingConfig(batch_size=batch_size, selector_size=selector_size, device="cpu")
    data = _data(batch_size * batches, size)
    unet = model_weights(build_segmentation_net(3, 2))
    selector = model_weights(build_selector(3, 3))
    ctx = RoundContext("bench", 1, "site1")
    fedavg_times, fedsm_times = [], []
    train_segmentation_round(FUNDUS, unet, data, cfg, 0, ctx)  # warm-up
    for r in range(repeats):  # interleaved, so load changes hit both alike
        t0 = time.perf_counter()
        train_segmentation_round(FUNDUS, unet, data, cfg, r, ctx)
        fedavg_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        train_fedsm_round(FUNDUS, unet, unet, selector, 0, 3, data, cfg, r, ctx)
        fedsm_times.append(time.perf_counter() - t0)
    return float(np.median(fedavg_times)) / batches, float(np.median(fedsm_times)) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--selector-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, batch {args.batch_size}, "
          f"selector input {args.selector_size} px")
    print(f"{'image px':>9} {'FedAvg step s':>14} {'FedSM step s':>13} {'ratio':>6}")
    for size in args.sizes:
        fedavg, fedsm = measure(size, args.selector_size, args.batch_size, args.batches, args.repeats)
        print(f"{size:>9} {fedavg:>14.4f} {fedsm:>13.4f} {fedsm / fedavg:>6.2f}")


if __name__ == "__main__":
    main()
