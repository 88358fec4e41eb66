"""Speed, traffic and memory of FedSM, each as a ratio measured in one run.

1. **Site-step throughput**: images per second of the engine's FedSM site round
   (:func:`engine.fl.local_training.train_fedsm_round`) against a minimal hand-written loop that
   trains the same three networks on the same batches with the same losses and optimizers
   (target >= 0.95). The two alternate, and the median of the repeats counts, so load changes on
   a shared machine hit both alike.
2. **Routed inference**: :class:`~engine.inference.predictor.SuperModelPredictor` (selector, then
   each image through one U-Net) against running the selector and all K+1 U-Nets on every image.
3. **Traffic**: raw tensor bytes per site per round, taken from the methods' real payloads:
   FedSM against FedAvg, and the pooled selector head against VGG-11's classic 25088-4096-4096
   head (with the parameter count of the classic head, not an allocation of it).
4. **Peak memory** of one site during one round, in a fresh subprocess each: the peak resident
   set during the round (the kernel's high-water mark, reset just before the round) and its
   increase over the resident set before the round, plus peak Python-heap allocations during the
   round (``tracemalloc``; numpy arrays are traced, torch tensors are not), for FedSM, FedAvg and
   a baseline that trains nothing.
5. **CUDA with mixed precision**: the throughput ratio and peak GPU memory, only when a GPU is
   present; otherwise reported as "not measured: no GPU".

Run alone with ``python -m engine.bench.perf [--size 64] [--device auto]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from monai.losses import DiceLoss

from engine.bench.cache import code_version
from engine.bench.jobs import resolved_device
from engine.bundle import BundleMetadata, SuperModelBundle
from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH
from engine.data.site_data import SplitArrays
from engine.device import resolve_device
from engine.federation.inprocess import weightset_bytes
from engine.fl.evaluation import segment_with, selector_probabilities
from engine.fl.local_training import (
    Device,
    LocalTrainingConfig,
    RoundContext,
    train_fedsm_round,
    train_segmentation_round,
)
from engine.fl.methods import OPTIM_PART, FedAvg, FedSM, FedSMExtra
from engine.fl.weights import model_weights
from engine.fl.wire_precision import encode_down, encode_up
from engine.inference.predictor import SuperModelPredictor
from engine.models import build_segmentation_net, build_selector
from engine.models.selector import head_parameter_count, width_of
from engine.tasks import FUNDUS

log = logging.getLogger(__name__)

PERF_VERSION = 3
PERF_SITES = 6
PERF_BATCHES = 6
PERF_REPEATS = 3
PERF_INFERENCE_IMAGES = 32


def perf_settings(preset: Any, device: str) -> dict[str, Any]:
    """Settings the perf figures depend on (a cached perf result must match them).

    The device is recorded resolved (``"auto"`` becomes ``"cpu"`` or ``"cuda"``), and the code
    version (:func:`engine.bench.cache.code_version`) is included as for the training jobs.
    """
    settings = {"version": PERF_VERSION, "image_size": preset.perf_image_size, "batch_size": preset.batch_size,
                "selector_size": preset.selector_size, "sites": PERF_SITES, "batches": preset.perf_batches,
                "repeats": preset.perf_repeats, "device": resolved_device(device), "code": code_version()}
    if not preset.perf_memory:
        settings["memory"] = False
    return settings


def _random_split(n: int, channels: int, labels: int, size: int, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    return SplitArrays(rng.random((n, channels, size, size), dtype=np.float32),
                       (rng.random((n, labels, size, size)) > 0.6).astype(np.float32), np.arange(n))


def _sync(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# 1. throughput
# --------------------------------------------------------------------------------------------
def hand_written_fedsm_round(task: Any, unet: dict[str, Any], selector: dict[str, Any], site_index: int,
                             num_sites: int, data: Any, batch_size: int, selector_size: int, lr: float,
                             selector_lr: float, device: Any, amp: bool,
                             fused_adam: bool = False) -> list[dict[str, Any]]:
    """The same work as a FedSM site round, written as the shortest plain PyTorch loop.

    Two U-Nets and the selector, each with Adam, one step each per batch (Dice loss for the
    U-Nets, cross entropy with the site's label for the selector on downscaled images); weights
    loaded at the start and copied back to the CPU at the end, like any real round must. It
    leaves out what the engine adds: seeded batch order, progress events, cancel checks, and
    the selector's BatchNorm running on tracked federation statistics (here: plain train mode).
    ``fused_adam`` switches Adam to its fused kernel as the engine uses it; the default is what a
    minimal loop writes (``torch.optim.Adam`` with its defaults).
    """
    nets = [build_segmentation_net(task.in_channels, task.out_channels) for _ in range(2)]
    for net in nets:
        net.load_state_dict(unet)
    sel = build_selector(task.in_channels, num_sites, width=width_of(selector))
    sel.load_state_dict(selector)
    models = [m.to(device).train() for m in [*nets, sel]]
    fused = {"fused": True} if fused_adam else {}
    opts = [torch.optim.Adam(m.parameters(), lr=lr, **fused) for m in models[:2]]
    opts.append(torch.optim.Adam(sel.parameters(), lr=selector_lr, **fused))
    dice = DiceLoss(sigmoid=True, batch=True)
    small = F.interpolate(torch.from_numpy(data.images), size=(selector_size, selector_size), mode="bilinear",
                          align_corners=False, antialias=True)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    perm = torch.randperm(len(data.images))
    for start in range(0, len(perm), batch_size):
        idx = perm[start:start + batch_size]
        x = torch.from_numpy(data.images[idx.numpy()]).to(device)
        y = torch.from_numpy(data.masks[idx.numpy()]).to(device)
        xs = small[idx].to(device)
        label = torch.full((len(idx),), site_index, dtype=torch.long, device=device)
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=amp):
                loss = F.cross_entropy(m(xs), label) if m is sel else dice(m(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    return [{k: v.detach().cpu().clone() for k, v in m.state_dict().items()} for m in models]


def measure_throughput(size: int, batch_size: int, selector_size: int, device_name: str = "cpu",
                       batches: int = PERF_BATCHES, repeats: int = PERF_REPEATS) -> dict[str, Any]:
    """Images/s of the engine's FedSM site round and of the hand-written loop; their ratio."""
    dev = Device.resolve(device_name)
    cfg = LocalTrainingConfig(batch_size=batch_size, selector_size=selector_size, device=device_name)
    data = _random_split(batch_size * batches, 3, 2, size)
    unet = model_weights(build_segmentation_net(3, 2))
    selector = model_weights(build_selector(3, PERF_SITES, width=DEFAULT_SELECTOR_WIDTH))
    ctx = RoundContext("perf", 1, "site1")

    def engine_round(r: int) -> None:
        train_fedsm_round(FUNDUS, unet, unet, selector, 0, PERF_SITES, data, cfg, r, ctx)

    def hand_round(r: int, fused_adam: bool = False) -> None:
        hand_written_fedsm_round(FUNDUS, unet, selector, 0, PERF_SITES, data, batch_size, selector_size, cfg.lr,
                                 cfg.selector_lr, dev.torch_device, dev.amp, fused_adam)

    def hand_fused_round(r: int) -> None:
        hand_round(r, fused_adam=True)

    variants = {"engine": engine_round, "hand": hand_round, "hand_fused": hand_fused_round}
    for fn in variants.values():  # warm-up of every path (allocator, MONAI imports, cuDNN autotuning)
        fn(0)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(repeats):
        # Rotate the order each repeat so a load change on a shared machine hits every path alike.
        for name in order[r % len(order):] + order[:r % len(order)]:
            _sync(dev.torch_device)
            t0 = time.perf_counter()
            variants[name](r + 1)
            _sync(dev.torch_device)
            times[name].append(time.perf_counter() - t0)
    n = len(data.images)
    rate = {name: n / float(np.median(t)) for name, t in times.items()}
    return {"image_size": size, "batch_size": batch_size, "images": n, "device": str(dev.torch_device),
            "mixed_precision": dev.amp, "engine_images_per_s": rate["engine"], "hand_images_per_s": rate["hand"],
            "hand_fused_images_per_s": rate["hand_fused"], "ratio": rate["engine"] / rate["hand"],
            "ratio_vs_fused_hand": rate["engine"] / rate["hand_fused"], "engine_s": times["engine"],
            "hand_s": times["hand"], "hand_fused_s": times["hand_fused"]}


# --------------------------------------------------------------------------------------------
# 2. routed inference
# --------------------------------------------------------------------------------------------
def _random_bundle(size: int, selector_size: int) -> Any:
    torch.manual_seed(0)
    names = [f"site{k + 1}" for k in range(PERF_SITES)]
    meta = BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=size,
                          selector_size=selector_size, site_names=names, normalisation="rgb/255", gamma=0.5,
                          selector_width=DEFAULT_SELECTOR_WIDTH)
    return SuperModelBundle(meta, model_weights(build_segmentation_net(3, 2)),
                            {n: model_weights(build_segmentation_net(3, 2)) for n in names},
                            model_weights(build_selector(3, PERF_SITES, width=DEFAULT_SELECTOR_WIDTH)))


def measure_routed_inference(size: int, selector_size: int, device_name: str = "cpu",
                             images: int = PERF_INFERENCE_IMAGES,
                             repeats: int = PERF_REPEATS) -> dict[str, Any]:
    """Seconds per image of routed inference and of running all K+1 U-Nets plus the selector.

    The result names the device both ran on resolved (``"cpu"``, ``"cuda"``), never ``"auto"``.
    """
    dev, amp = resolve_device(device_name)
    device_name = str(dev)
    bundle = _random_bundle(size, selector_size)
    predictor = SuperModelPredictor(bundle, device_name)
    x = _random_split(images, 3, 2, size, seed=1).images
    weights = [bundle.global_weights, *bundle.personal_weights.values()]

    def routed() -> None:
        predictor.predict(x)

    def all_models() -> None:
        selector_probabilities(FUNDUS, bundle.selector_weights, PERF_SITES, x, selector_size, device=device_name)
        for w in weights:
            segment_with(FUNDUS, w, x, device_name)

    routed()
    all_models()
    routed_s, all_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        routed()
        routed_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        all_models()
        all_s.append(time.perf_counter() - t0)
    r, a = float(np.median(routed_s)), float(np.median(all_s))
    return {"images": images, "image_size": size, "models": PERF_SITES + 1, "device": device_name,
            "mixed_precision": amp, "routed_s_per_image": r / images,
            "all_models_s_per_image": a / images, "ratio": r / a,
            "note": "all_models builds each U-Net per call (as segment_with does); the routed predictor "
                    "holds its networks, so the ratio slightly favours routing by construction cost"}


# --------------------------------------------------------------------------------------------
# 3. traffic
# --------------------------------------------------------------------------------------------
def measure_traffic(sites: int = PERF_SITES) -> dict[str, Any]:
    """Bytes per site per round from the methods' real payloads as they travel (fundus U-Net, pooled
    selector head, the default selector width and wire precision: :mod:`engine.fl.wire_precision`)."""
    names = [f"site{k + 1}" for k in range(sites)]
    cfg = LocalTrainingConfig(device="cpu")
    fedavg = FedAvg(FUNDUS, names, cfg, 0, 1)
    fedsm = FedSM(FUNDUS, names, cfg, 0, 1, lam=0.7)
    extra = FedSMExtra(FUNDUS, names, cfg, 0, 1, lam=0.7, extra_rounds=1)

    def down(method: Any, state: Any, rnd: int) -> int:
        return weightset_bytes(encode_down(method.site_instructions(state, rnd, names[0]).weights,
                                           method.wire_parts(rnd)))

    avg_down = down(fedavg, fedavg.initial_state(), 1)
    state = fedsm.initial_state()
    sm_down = down(fedsm, state, 1)
    wire = fedsm.wire_parts(1)
    # the update carries the same three networks back (shapes checked by validate_update), as differences
    expected = fedsm.expected_update_shapes(state, names[0])
    sm_up = weightset_bytes(encode_up(expected, expected, wire))
    value_bytes = 2 if wire else 4
    head_delta = value_bytes * (head_parameter_count("classic", sites) - head_parameter_count("gap", sites))
    # the reference-trained selector travels with its two Adam moments, each the size of its parameters
    moments = 2 if OPTIM_PART in state else 0
    classic = sm_down + head_delta * (1 + moments)
    sent = encode_down(state, wire)
    return {
        "sites": sites,
        "fedavg_bytes_each_way": avg_down,
        "fedsm_bytes_each_way": sm_down,
        "fedsm_bytes_up": sm_up,
        "fedsm_over_fedavg": sm_down / avg_down,
        "fedsm_classic_head_bytes_each_way": classic,
        "gap_over_classic": sm_down / classic,
        "selector_gap_bytes": weightset_bytes({"s": sent["selector"]}),
        "selector_optimizer_bytes": weightset_bytes({"o": sent[OPTIM_PART]}) if moments else 0,
        "selector_classic_bytes": weightset_bytes({"s": sent["selector"]}) + head_delta,
        "fedsm_extra_selector_round_bytes_down": down(extra, extra.initial_state(), 2),
        "wire_precision": fedsm.wire_precision,
        "selector_width": cfg.selector_width,
        "note": "raw tensor bytes of a training round as they travel (no framing or compression); the same "
                "numbers every run",
    }


# --------------------------------------------------------------------------------------------
# 4. peak memory (each measurement in its own process)
# --------------------------------------------------------------------------------------------
def _memory_child(kind: str, size: int, batch_size: int, selector_size: int, images: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        return _measure_round_memory(kind, size, batch_size, selector_size, images)
    finally:
        # Left on, tracemalloc slows every later allocation of the process ~100x (a caller
        # running this in-process, such as a test, would pay it for the rest of its life).
        if not was_tracing:
            tracemalloc.stop()


def _measure_round_memory(kind: str, size: int, batch_size: int, selector_size: int, images: int) -> dict[str, Any]:
    cfg = LocalTrainingConfig(batch_size=batch_size, selector_size=selector_size, device="cpu")
    data = _random_split(images, 3, 2, size)
    unet = model_weights(build_segmentation_net(3, 2))
    selector = model_weights(build_selector(3, PERF_SITES, width=DEFAULT_SELECTOR_WIDTH))
    ctx = RoundContext("perf", 1, "site1")
    # Load up front what a round loads on first use (MONAI's losses, the optimizers' compile
    # machinery, device probing), so the round's figure is the round's memory, not imports'.
    DiceLoss(sigmoid=True)
    Device.resolve("cpu")
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    # Imports alone peak above a small round, so the process-lifetime peak says little: reset
    # the kernel's high-water mark (Linux, /proc/self/clear_refs "5") and read it after the round.
    before_mib = _proc_status_mib("VmRSS")
    reset = _reset_peak_rss()
    tracemalloc.reset_peak()
    traced_before = tracemalloc.get_traced_memory()[0]
    if kind == "fedsm":
        train_fedsm_round(FUNDUS, unet, unet, selector, 0, PERF_SITES, data, cfg, 1, ctx)
    elif kind == "fedavg":
        train_segmentation_round(FUNDUS, unet, data, cfg, 1, ctx)
    _, peak = tracemalloc.get_traced_memory()
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    round_peak = _proc_status_mib("VmHWM") if reset else None
    return {"kind": kind, "process_peak_rss_mib": rss_kib / 1024, "rss_before_round_mib": before_mib,
            "round_peak_rss_mib": round_peak,
            "round_rss_increase_mib": None if round_peak is None or before_mib is None else round_peak - before_mib,
            "round_tracemalloc_increase_mib": (peak - traced_before) / 2**20}


def _proc_status_mib(field: str) -> float | None:
    """A ``kB`` field of ``/proc/self/status`` in MiB (``None`` off Linux)."""
    try:
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_memory(size: int, batch_size: int, selector_size: int, images: int = 48) -> dict[str, Any]:
    """Peak memory of one site round of FedSM and of FedAvg, and of a baseline, in subprocesses."""
    out: dict[str, Any] = {"image_size": size, "batch_size": batch_size, "images": images}
    for kind in ("baseline", "fedavg", "fedsm"):
        cmd = [sys.executable, "-m", "engine.bench.perf", "--memory-child", kind, "--size", str(size),
               "--batch-size", str(batch_size), "--selector-size", str(selector_size), "--images", str(images)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            out[kind] = {"error": done.stderr.strip().splitlines()[-1:] or ["no output"]}
            continue
        out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    try:
        out["fedsm_over_fedavg_round_peak_rss"] = (out["fedsm"]["round_peak_rss_mib"]
                                                   / out["fedavg"]["round_peak_rss_mib"])
        out["fedsm_over_fedavg_round_increase"] = (out["fedsm"]["round_rss_increase_mib"]
                                                   / out["fedavg"]["round_rss_increase_mib"])
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    return out


# --------------------------------------------------------------------------------------------
# 5. CUDA
# --------------------------------------------------------------------------------------------
def measure_cuda(size: int, batch_size: int, selector_size: int) -> dict[str, Any]:
    """Throughput ratio and peak GPU memory with mixed precision, or why it was not measured."""
    if not torch.cuda.is_available():
        return {"measured": False, "reason": "not measured: no GPU"}
    out: dict[str, Any] = {"measured": True, "gpu": torch.cuda.get_device_name(0)}
    out["throughput"] = measure_throughput(size, batch_size, selector_size, "cuda")
    cfg = LocalTrainingConfig(batch_size=batch_size, selector_size=selector_size, device="cuda")
    data = _random_split(batch_size * PERF_BATCHES, 3, 2, size)
    unet = model_weights(build_segmentation_net(3, 2))
    selector = model_weights(build_selector(3, PERF_SITES, width=DEFAULT_SELECTOR_WIDTH))
    ctx = RoundContext("perf", 1, "site1")
    for kind in ("fedavg", "fedsm"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if kind == "fedsm":
            train_fedsm_round(FUNDUS, unet, unet, selector, 0, PERF_SITES, data, cfg, 1, ctx)
        else:
            train_segmentation_round(FUNDUS, unet, data, cfg, 1, ctx)
        torch.cuda.synchronize()
        out[kind] = {"round_s": time.perf_counter() - t0,
                     "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20}
    out["fedsm_over_fedavg_gpu_memory"] = out["fedsm"]["peak_gpu_mib"] / out["fedavg"]["peak_gpu_mib"]
    return out


def measure_all(preset: Any, device: str = "auto") -> dict[str, Any]:
    """Every figure above for a preset's ``perf_image_size`` and batch size."""
    size, bs, sel = preset.perf_image_size, preset.batch_size, preset.selector_size
    batches, repeats = preset.perf_batches, preset.perf_repeats
    return {
        "throughput_cpu": measure_throughput(size, bs, sel, "cpu", batches, repeats),
        "routed_inference_cpu": measure_routed_inference(size, sel, "cpu", bs * batches, repeats),
        "traffic": measure_traffic(),
        "memory_cpu": measure_memory(size, bs, sel, bs * batches) if getattr(preset, "perf_memory", True) else
        {"measured": False, "reason": "not measured: the preset skips it (one fresh process per figure)"},
        "cuda": measure_cuda(size, bs, sel) if device != "cpu" else
        {"measured": False, "reason": "not measured: --device cpu"},
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.bench.perf``: print the figures as JSON (or run one memory child)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--selector-size", type=int, default=32)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--memory-child", choices=["baseline", "fedavg", "fedsm"], default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(_memory_child(args.memory_child, args.size, args.batch_size, args.selector_size,
                                       args.images)))
        return 0
    torch.set_num_threads(1)

    class _Preset:
        perf_image_size, batch_size, selector_size = args.size, args.batch_size, args.selector_size
        perf_batches, perf_repeats = PERF_BATCHES, PERF_REPEATS

    print(json.dumps(measure_all(_Preset(), args.device), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
