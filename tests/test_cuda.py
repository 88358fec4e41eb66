"""The CUDA paths: training, routed inference and the bundle a GPU run writes, checked against the CPU.

Every test here skips on a machine without a CUDA GPU (CI has none); they run where one is lent
(docs/results.md, "GPU check", says when and on which card).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.bundle import load_bundle
from engine.inference.predictor import SuperModelPredictor
from engine.simulate import Simulation, SimulationConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A short FedSM federation trained on the GPU: its report and the folder it wrote."""
    out = tmp_path_factory.mktemp("cuda-run")
    cfg = SimulationConfig(task="fundus", sites=3, image_size=32, rounds=3, methods=("fedavg", "fedsm"),
                           selector_warmup=2, device="cuda", seed=0)
    report = Simulation(cfg, out).run()
    return {"report": report, "out": out}


def test_training_runs_on_the_gpu_with_mixed_precision(gpu_run: dict) -> None:
    machine = gpu_run["report"]["machine"]
    assert machine["device"].startswith("cuda") and machine["mixed_precision"] is True
    assert machine["gpu"] == torch.cuda.get_device_name(0)
    for name in ("fedavg", "fedsm"):
        dice = gpu_run["report"]["methods"][name]["dice"]
        assert set(dice) == {"site1", "site2", "site3"}
        assert all(np.isfinite(v["mean"]) and 0.0 <= v["mean"] <= 1.0 for v in dice.values())
    rounds = gpu_run["report"]["methods"]["fedsm"]["rounds"]
    losses = [v for r in rounds for site in r["metrics"].values() for k, v in site.items() if "loss" in k]
    assert len(losses) >= 3 * 3 and np.isfinite(losses).all()  # global, personal and selector losses


def test_a_gpu_bundle_loads_and_routes_the_same_on_cpu_and_gpu(gpu_run: dict) -> None:
    # the bundle a GPU run writes holds plain CPU tensors: it loads on a machine without a GPU
    bundle = load_bundle(gpu_run["out"] / "supermodel.safetensors")
    images = np.random.default_rng(1).random((6, 3, 40, 56), dtype=np.float32)
    cpu = SuperModelPredictor(bundle, device="cpu").predict(images)
    gpu = SuperModelPredictor(bundle, device="cuda").predict(images)
    # float16 autocast moves the selector's softmax by well under 1e-2 ...
    np.testing.assert_allclose(gpu.probabilities, cpu.probabilities, atol=1e-2)
    # ... so every image the CPU routes clear of gamma goes to the same model on the GPU
    clear = np.abs(cpu.confidence - bundle.metadata.gamma) > 1e-2
    np.testing.assert_array_equal(gpu.routed[clear], cpu.routed[clear])
    np.testing.assert_array_equal(gpu.unlike_sites, cpu.unlike_sites)
    same = gpu.routed == cpu.routed
    agreement = float((gpu.masks[same] == cpu.masks[same]).mean())
    assert agreement >= 0.99, f"GPU and CPU masks agree on {agreement:.4f} of pixels"


def test_the_report_file_names_the_gpu(gpu_run: dict) -> None:
    written = json.loads((gpu_run["out"] / "report.json").read_text())
    assert written["machine"]["gpu"] == torch.cuda.get_device_name(0)
