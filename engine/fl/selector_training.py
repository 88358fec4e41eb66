"""The FedSM model selector trained as the paper's public reference trains it, plus its calibration.

Reference scheme (NVFlare ``research/fed-sm``, the code behind Xu et al., CVPR 2022):

- each round a site runs ONE pass over its training images with label = its site index,
  accumulates the cross-entropy gradients of all batches, and takes ONE Adam step (lr 1e-3,
  betas 0.9/0.999) at the end of the pass;
- the selector's Adam moments (``exp_avg``, ``exp_avg_sq``) and step count travel with its
  weights and are averaged on the server exactly like them, so the next round's step at every
  site continues one federation-wide Adam.

Because every site contributes one step from its own-label gradient and the server averages
the K steps (and the moments), the result is close to one Adam step on the balanced
multi-site objective: the selector does not drift toward "always my site" as a freely trained
local selector does.

One deliberate difference from the reference: the pass's gradient is the MEAN of the batches'
gradients, not their sum. A site's own Adam step does not care (Adam divides the scale away),
but the averaged moments do: summed, a site's share of the federation's first moment grows
with its sample weight times its batch count (n_k^2, not n_k) and of the second moment with
n_k^3, so the largest site steers every site's next step. Measured on the desktop app's demo
federation (3 fundus sites with 4, 6 and 10 training images, batch 2, site1 watched): with
sums site1's selector loss went 1.77 -> 2.05 -> 2.78 over three rounds (past -ln(0.2) = 1.61,
the loss of a selector that knows only the sites' sizes), and after 14 one-step rounds the
selector still sent site1's images to site3; with means 1.77 -> 2.05 -> 1.89, and after 14
rounds it named every training and validation image of all three sites. Sites with equal batch
counts train exactly as before (the common factor cancels in Adam).

Optional calibration after the last round (``selector_calibration="temperature"``): each site
sends, for a fixed grid of temperatures, the SUM of the selector's negative log-likelihood over
its validation images (label = its site index) and its image count, never a per-image value;
the server picks the temperature with the smallest total NLL and folds it into the selector's
last layer (``softmax(z / T)`` = softmax of a layer whose weight and bias are divided by ``T``),
so inference and the bundle format need nothing new.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from engine import models
from engine.errors import ConfigError, WeightsError
from engine.fl.local_training import Device, _to_device, batch_order, freeze_batchnorm_statistics, selector_inputs
from engine.fl.weights import Weights, all_finite, clone_weights

if TYPE_CHECKING:
    from engine.fl.local_training import LocalTrainingConfig, RoundContext
    from engine.tasks import TaskSpec

#: Adam hyper-parameters of the reference (torch defaults).
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
#: Key of the step count in a selector optimizer-state dict.
STEP_KEY = "step"
#: Temperatures a site evaluates the selector's NLL at (log-spaced, 1.0 included).
TEMPERATURE_GRID = tuple(float(t) for t in np.round(np.logspace(-1.0, 1.5, 51), 6))
#: Keys of a site's temperature statistics.
TEMPERATURE_KEYS = ("nll", "count")


# --- Adam state as a weight dict ------------------------------------------------------------
def initial_optimizer_state(net: torch.nn.Module) -> Weights:
    """Zero Adam moments for every trainable parameter of ``net`` and step 0.

    Keys are ``exp_avg.<param>``, ``exp_avg_sq.<param>`` and ``step`` (float32, shape ``(1,)``),
    so the state travels and averages like any weight dict.
    """
    out: Weights = {STEP_KEY: torch.zeros(1, dtype=torch.float32)}
    for name, p in net.named_parameters():
        if p.requires_grad:
            out[f"exp_avg.{name}"] = torch.zeros_like(p, dtype=torch.float32, device="cpu")
            out[f"exp_avg_sq.{name}"] = torch.zeros_like(p, dtype=torch.float32, device="cpu")
    return out


def adam_step_from_state(net: torch.nn.Module, state: Mapping[str, torch.Tensor], lr: float) -> Weights:
    """Take one Adam step on ``net`` with the gradients it holds, starting from ``state``.

    ``state`` is an :func:`initial_optimizer_state`-style dict (moments and step count). The
    gradients in ``p.grad`` are used as they are (the reference sums them over the local pass).
    Parameters without a gradient keep their value and moments.

    Returns
    -------
    dict
        The new optimizer state (CPU, float32), step count increased by one.
    """
    step = float(state[STEP_KEY].reshape(-1)[0])
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    missing = [f"exp_avg.{n}" for n, _ in named if f"exp_avg.{n}" not in state]
    if missing:
        raise WeightsError(f"selector optimizer state lacks {missing[:3]}; it does not belong to this selector")
    with_grad = [(n, p) for n, p in named if p.grad is not None]
    opt = torch.optim.Adam([p for _, p in with_grad], lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, foreach=False)
    if step > 0:
        for name, p in with_grad:
            opt.state[p] = {"step": torch.tensor(step, dtype=torch.float32),
                            "exp_avg": state[f"exp_avg.{name}"].to(p.device, torch.float32).clone(),
                            "exp_avg_sq": state[f"exp_avg_sq.{name}"].to(p.device, torch.float32).clone()}
    if with_grad:
        opt.step()
    out: Weights = {STEP_KEY: torch.full((1,), step + 1.0, dtype=torch.float32)}
    for name, p in named:
        st = opt.state.get(p)
        if st:
            out[f"exp_avg.{name}"] = st["exp_avg"].detach().to("cpu", torch.float32).clone()
            out[f"exp_avg_sq.{name}"] = st["exp_avg_sq"].detach().to("cpu", torch.float32).clone()
        else:
            out[f"exp_avg.{name}"] = state[f"exp_avg.{name}"].detach().to("cpu", torch.float32).clone()
            out[f"exp_avg_sq.{name}"] = state[f"exp_avg_sq.{name}"].detach().to("cpu", torch.float32).clone()
    return out


def refresh_batchnorm_statistics(net: torch.nn.Module) -> None:
    """Make ``net``'s BatchNorm layers re-estimate their running statistics over the coming pass.

    Running mean and variance are reset and then accumulated as a cumulative average of the
    batches' statistics (``momentum=None``), so after the pass they describe this selector on
    this site's images, not an exponential average dominated by earlier rounds' values.
    """
    for m in net.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.reset_running_stats()
            m.momentum = None


# --- the site's round -------------------------------------------------------------------------
def reference_selector_round(
    task: TaskSpec,
    selector_weights: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, torch.Tensor],
    labels: np.ndarray,
    num_classes: int,
    images: np.ndarray,
    cfg: LocalTrainingConfig,
    seed: int,
    ctx: RoundContext,
) -> tuple[Weights, Weights, dict[str, float]]:
    """One site's selector round: summed gradient over one pass, one Adam step (per ``cfg.selector_epochs``).

    Parameters
    ----------
    labels
        Per-image class (FedSM: the site index for every image).
    images
        The site's training images at segmentation size; downscaled to ``cfg.selector_size``.

    Returns
    -------
    weights, optimizer_state, metrics
        New selector weights and Adam state (CPU) and ``loss_selector`` (mean batch loss of the
        first pass, at the received weights), ``selector_accuracy`` (training images classified
        as their label, before the step). The step follows the mean of the pass's batch
        gradients (module docstring: why not their sum).
    """
    device = Device.resolve(cfg.device)
    torch.manual_seed(seed)
    net = models.build_selector(task.in_channels, num_classes, cfg.selector_head,  # type: ignore[arg-type]
                                cfg.selector_width)
    net.load_state_dict(selector_weights)
    net.to(device.torch_device).train()
    if cfg.selector_bn == "running" or len(images) < 2:  # one image has no batch statistics
        freeze_batchnorm_statistics(net)
    elif cfg.selector_bn == "fresh":
        refresh_batchnorm_statistics(net)
    # "batch" (default): the reference's train mode, BatchNorm normalises with each single-site batch's
    # statistics and updates the running ones, which FedAvg then averages across sites
    small = selector_inputs(images, cfg.selector_size)
    targets = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    state: Weights = dict(optimizer_state)
    total = correct = 0.0
    steps = 0
    for epoch in range(cfg.selector_epochs):
        batches = batch_order(len(small), cfg.batch_size, 1, seed + epoch)
        if len(batches) > 1 and len(batches[-1]) == 1:
            # a lone last image has no batch statistics (VGG's last maps are 1x1): it joins the batch before
            batches = [*batches[:-2], np.concatenate(batches[-2:])]
        net.zero_grad(set_to_none=True)
        for i, idx in enumerate(batches, start=1):
            ctx.check_cancel()
            xs = _to_device(small, idx, device)
            y = targets[idx].to(device.torch_device)
            logits = net(xs)  # float32: the selector is small, and summed fp16 gradients would underflow
            loss = F.cross_entropy(logits, y)
            (loss / len(batches)).backward()  # gradients add up to the pass's mean batch gradient
            if epoch == 0:
                total += float(loss.detach())
                correct += float((logits.detach().argmax(1) == y).sum())
                steps = len(batches)
            ctx.report(i, len(batches), {"selector": float(loss.detach())})
        state = adam_step_from_state(net, state, cfg.selector_lr)  # one step per pass
    new_state = state
    metrics = {"loss_selector": total / max(steps, 1),
               "selector_accuracy": correct / max(len(small), 1)}
    return clone_weights(net.state_dict()), new_state, metrics


# --- temperature scaling ------------------------------------------------------------------------
def selector_logits(task: TaskSpec, selector_weights: Mapping[str, torch.Tensor], num_classes: int,
                    images: np.ndarray, cfg: LocalTrainingConfig, batch_size: int = 64) -> torch.Tensor:
    """Selector logits ``float64 (N, C)`` of ``images`` (eval mode, running BatchNorm statistics)."""
    device = Device.resolve(cfg.device)
    net = models.build_selector(task.in_channels, num_classes, cfg.selector_head,  # type: ignore[arg-type]
                                cfg.selector_width)
    net.load_state_dict(selector_weights)
    net.to(device.torch_device).eval()
    small = torch.from_numpy(selector_inputs(images, cfg.selector_size))
    out = []
    with torch.inference_mode():
        for start in range(0, len(small), batch_size):
            out.append(net(small[start:start + batch_size].to(device.torch_device)).double().cpu())
    return torch.cat(out) if out else torch.zeros((0, num_classes), dtype=torch.float64)


def temperature_statistics(logits: torch.Tensor, labels: np.ndarray,
                           grid: Sequence[float] = TEMPERATURE_GRID) -> Weights:
    """Summed NLL of ``softmax(logits / T)`` per grid temperature, and the image count.

    Only these ``len(grid) + 1`` numbers leave a site: no per-image value.
    """
    lab = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    z = logits.to(torch.float64)
    nll = torch.stack([F.cross_entropy(z / t, lab, reduction="sum") if len(z) else torch.zeros((), dtype=torch.float64)
                       for t in grid])
    return {"nll": nll, "count": torch.tensor([float(len(z))], dtype=torch.float64)}


def check_temperature_statistics(stats: Mapping[str, torch.Tensor], what: str,
                                 grid: Sequence[float] = TEMPERATURE_GRID) -> None:
    """Reject statistics with wrong keys, shapes, NaN/Inf or negative values."""
    if set(stats) != set(TEMPERATURE_KEYS):
        raise WeightsError(f"{what}: keys {sorted(stats)}, expected {list(TEMPERATURE_KEYS)}")
    if tuple(stats["nll"].shape) != (len(grid),) or tuple(stats["count"].shape) != (1,):
        raise WeightsError(f"{what}: shapes nll {tuple(stats['nll'].shape)}, count {tuple(stats['count'].shape)}; "
                           f"expected ({len(grid)},) and (1,)")
    for key in TEMPERATURE_KEYS:
        if not all_finite(stats[key]) or bool((stats[key] < 0).any()):
            raise WeightsError(f"{what}: {key} contains NaN, Inf or negative values")


def fit_temperature(stats: Sequence[Mapping[str, torch.Tensor]],
                    grid: Sequence[float] = TEMPERATURE_GRID) -> float:
    """The grid temperature with the smallest NLL summed over all sites (1.0 when no images)."""
    if not stats:
        raise WeightsError("no temperature statistics arrived; at least one site must answer the calibration round")
    nll = sum((s["nll"].to(torch.float64) for s in stats), torch.zeros(len(grid), dtype=torch.float64))
    count = float(sum(float(s["count"].sum()) for s in stats))
    if count <= 0:
        return 1.0
    return float(grid[int(torch.argmin(nll))])


def apply_temperature(selector_weights: Mapping[str, torch.Tensor], weight_key: str, bias_key: str,
                      temperature: float) -> Weights:
    """Copy of ``selector_weights`` whose last layer computes ``logits / temperature``."""
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    out = dict(selector_weights)
    out[weight_key] = selector_weights[weight_key] / temperature
    out[bias_key] = selector_weights[bias_key] / temperature
    return out


# --- calibration measures -----------------------------------------------------------------------
def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error of top-1 confidence (equal-width bins, Guo et al. 2017).

    ``sum_b |B_b|/N * |accuracy(B_b) - mean confidence(B_b)|``; NaN when there are no images.
    """
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if p.ndim != 2 or len(p) != len(y):
        raise ConfigError(f"probabilities {p.shape} and labels {y.shape} do not match")
    if len(p) == 0:
        return float("nan")
    conf = p.max(1)
    hit = (p.argmax(1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1], right=True), 0, bins - 1)
    ece = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            ece += sel.mean() * abs(hit[sel].mean() - conf[sel].mean())
    return float(ece)


def confidence_summary(conf: np.ndarray, bins: int = 10) -> dict[str, Any]:
    """Quantiles and a histogram (``bins`` equal bins on [0, 1]) of selector confidences."""
    c = np.asarray(conf, dtype=np.float64)
    if len(c) == 0:
        return {"n": 0}
    q = np.quantile(c, [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
    hist, _ = np.histogram(c, bins=bins, range=(0.0, 1.0))
    return {"n": len(c), "mean": float(c.mean()),
            "quantiles": {k: float(v) for k, v in zip(("min", "p10", "p25", "median", "p75", "p90", "max"), q,
                                                       strict=True)},
            "histogram": {"edges": [round(float(e), 3) for e in np.linspace(0, 1, bins + 1)],
                          "counts": [int(h) for h in hist]}}
