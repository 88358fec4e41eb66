"""The BlackFed table of ``fedsm bench``: rows from cached results, compute counts, job planning."""

from engine.bench.cache import JobKey
from engine.bench.plan import plan_jobs
from engine.bench.presets import get_preset
from engine.bench.split_table import split_compute, split_rows, split_section
from engine.fl.blackfed_nets import client_flops_per_image
from engine.tasks import FUNDUS


def _result(local, ood):
    return {"extra": {"local_ood": {"site1": {"local": local, "ood": ood}, "site2": {"local": local + 0.1,
                                                                                    "ood": ood - 0.1}}}}


def test_rows_average_seeds_and_sites():
    results = {JobKey("fundus", "blackfed", "blackfed-v1", 0): _result(0.5, 0.3),
               JobKey("fundus", "blackfed", "blackfed-v1", 1): _result(0.7, 0.5),
               JobKey("fundus", "main", "fedavg", 0): _result(0.9, 0.9)}
    sites, rows = split_rows(results, "fundus", ("blackfed-v1", "fedavg"))
    assert sites == ["site1", "site2"]
    v1, fedavg = rows
    assert v1["seeds"] == 2 and abs(v1["site1/local"] - 0.6) < 1e-12 and abs(v1["site2/ood"] - 0.3) < 1e-12
    assert abs(v1["mean/local"] - 0.65) < 1e-12 and abs(v1["mean/ood"] - 0.35) < 1e-12
    assert fedavg["seeds"] == 0  # a main-comparison job is not part of this table
    text = "\n".join(split_section(results, get_preset("blackfed"), "fundus"))
    assert "| BlackFed v1 | 0.6000 | 0.4000 | 0.7000 | 0.3000 | **0.6500** | **0.3500** |" in text
    assert "| FedAvg | — |" in text


def test_client_compute_matches_the_count_by_hand():
    compute = split_compute(FUNDUS, 32)
    assert compute["client"] == client_flops_per_image(3, 16, 32)
    # MONAI's U-Net downsamples in its first (strided) convolution, so two full-resolution
    # convolutions are not negligible next to it: about a quarter at 16 channels
    assert 0.1 * compute["unet"] < compute["client"] < 0.5 * compute["unet"]


def test_only_presets_with_split_seeds_plan_blackfed_jobs():
    assert not [k for k in plan_jobs(get_preset("tiny")) if k.analysis == "blackfed"]
    planned = [k.method for k in plan_jobs(get_preset("blackfed"))]
    assert planned == ["local", "blackfed-v1", "blackfed-v2", "split-whitebox", "fedavg", "centralized"]
