"""Local training at one site for one round.

:func:`train_fedsm_round` is the FedSM paper's Algorithm 1, lines 6-11: every batch updates
the site's copy of the global model, its personalized model, and the model selector (label =
site index). The other functions train a single segmentation network (FedAvg, FedProx,
Scaffold, Local, Centralized) or the FedSM-extra selector.

Choices that matter:

- A fresh Adam (0.9, 0.999) per network and round: a round is a pure function of the
  received weights, the site's data and the seed, so a resumed or re-sent round gives the same
  result in the simulation and over the network. Adam runs its fused kernel on CPU and CUDA.
- The selector sees images downscaled to ``selector_size`` (default 32 px): it only has to
  recognise a site's acquisition style (colour, brightness, contrast, field of view), and a
  VGG-11 step at full resolution would cost ~8x a U-Net step.
- Single-label drift: each site's selector data carries one label, so a selector trained
  freely at one site learns "always my site". By default FedSM trains it as the paper's
  reference does (:mod:`engine.fl.selector_training`: one Adam step per round from the
  gradient summed over the local pass, Adam moments averaged on the server). The older
  per-batch scheme (``--selector-calibration lda``) takes a step per batch at a 100x smaller
  step size and calibrates the last layer in closed form afterwards
  (:mod:`engine.fl.selector_calibration`). The per-batch scheme's BatchNorm layers normalise
  with their running statistics during local training instead of the single-site batch
  statistics; the reference scheme uses batch statistics as the reference does
  (``selector_bn``; measured to keep the selector unsure of sites it has not seen).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH
from engine.data.preprocess import resize_images
from engine.device import resolve_device
from engine.errors import CancelledError, ConfigError
from engine.fl.aggregation import proximal_penalty
from engine.fl.selector_schemes import default_selector_lr
from engine.fl.training_options import LR_SCHEDULES, SEGMENTATION_LOSSES, SELECTOR_BN_MODES
from engine.fl.weights import Weights, clone_weights
from engine.models import build_segmentation_net, build_selector
from engine.models.selector import SELECTOR_WIDTHS
from engine.tasks import TaskSpec

if TYPE_CHECKING:
    from engine.data.site_data import SplitArrays

ProgressFn = Callable[[dict[str, Any]], None]
CancelFn = Callable[[], bool]




def scheduled_lr(lr: float, schedule: str, rnd: int, rounds: int, min_ratio: float = 0.01) -> float:
    """The U-Nets' learning rate in training round ``rnd`` (1-based) of ``rounds``.

    ``constant`` returns ``lr``; ``cosine`` falls along a half cosine from ``lr`` (round 1) to
    ``lr * min_ratio`` (round ``rounds``); ``step`` multiplies ``lr`` by 0.1 from round
    ``ceil(rounds / 2) + 1`` and by 0.01 from ``ceil(3 rounds / 4) + 1``. Rounds past ``rounds``
    (FedSM-extra's selector rounds, calibration rounds) get the last training round's value.
    """
    if schedule not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr_schedule {schedule!r}; choose from {', '.join(LR_SCHEDULES)}")
    if rounds < 1 or rnd < 1:
        raise ConfigError(f"round {rnd} of {rounds}: both must be >= 1")
    r = min(rnd, rounds)
    if schedule == "cosine":
        if rounds == 1:
            return lr
        t = (r - 1) / (rounds - 1)
        return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))
    if schedule == "step":
        if r > math.ceil(3 * rounds / 4):
            return lr * 0.01
        if r > math.ceil(rounds / 2):
            return lr * 0.1
    return lr


def segmentation_loss(name: str = "dice") -> torch.nn.Module:
    """The segmentation loss ``name`` (one of :data:`SEGMENTATION_LOSSES`) on logits.

    Both reduce over the whole batch (``batch=True``): slices without the structure (common in
    prostate volumes) do not dominate the loss with 0/0 cases.
    """
    from monai.losses import DiceCELoss, DiceLoss

    if name == "dice":
        return DiceLoss(sigmoid=True, batch=True)
    if name == "dicece":
        return DiceCELoss(sigmoid=True, batch=True)
    raise ConfigError(f"unknown loss {name!r}; choose from {', '.join(SEGMENTATION_LOSSES)}")



@dataclass(frozen=True)
class LocalTrainingConfig:
    """Hyper-parameters of one site's local round.

    Attributes
    ----------
    epochs
        Local epochs per round.
    batch_size
        Images (or slices) per batch.
    lr
        Adam learning rate of the segmentation networks.
    selector_lr
        Adam learning rate of the model selector; ``None``: the reference scheme's default for
        ``selector_width`` (the paper's 1e-3 at width 64, 3e-3 narrower:
        :func:`engine.fl.selector_schemes.default_selector_lr`; runs from settings resolve it there,
        the per-batch ``lda`` scheme to 1e-5).
    selector_size
        Side in pixels of the images the selector sees.
    selector_head
        ``"gap"`` (default) or ``"classic"`` (VGG's 25088-4096-4096 head, comparison only).
    selector_width
        The selector backbone's first convolution width (:data:`DEFAULT_SELECTOR_WIDTH`, 16, by
        default; the paper's is 64; 8 and 32 also, :mod:`engine.models.selector`).
    selector_epochs
        Reference scheme: passes over the site's images per round, one Adam step after each
        (the reference's ``fedsm_select_epochs``, default 1: one step per round).
    selector_bn
        Reference scheme: ``"batch"`` (default) normalises the selector's BatchNorm layers with
        each batch's own statistics during local training, as the reference's ``train()`` mode
        does; ``"running"`` with their running (federation-averaged) statistics. Measured
        (docs/results.md, "Selector (leave-one-site-out)"): with ``"running"`` the selector is
        sure (confidence 1.000) of unseen images too; with ``"batch"`` it is not. ``"fresh"``:
        trains as ``"batch"``, but the running statistics a site sends are re-estimated over its
        pass (cumulative average) instead of an exponential average that mostly keeps the last
        round's values, so the federation-averaged statistics describe the current selector
        (``engine.fl.selector_training.reference_selector_round``). The per-batch ``lda`` scheme
        always uses the running statistics.
    prox_mu
        FedProx proximal coefficient (0 = off).
    lr_schedule
        How the U-Nets' learning rate changes over the training rounds: ``"constant"``,
        ``"cosine"`` (half cosine from ``lr`` in round 1 to ``lr * lr_min_ratio`` in the last
        training round) or ``"step"`` (``lr``, then x0.1 from 50% and x0.01 from 75% of the rounds).
        The server and every site compute the round's value from the round number alone
        (:func:`scheduled_lr`), so the schedule needs no extra message.
    lr_min_ratio
        Final learning rate of the cosine schedule as a fraction of ``lr``.
    loss
        Segmentation loss: ``"dice"`` (soft Dice over the batch) or ``"dicece"`` (soft Dice plus
        binary cross-entropy, equal weights).
    device
        ``"auto"`` (CUDA with mixed precision when present, else CPU), ``"cpu"`` or ``"cuda"``.
    """

    epochs: int = 1
    batch_size: int = 8
    lr: float = 1e-3
    selector_lr: float | None = None
    selector_size: int = 32
    selector_head: str = "gap"
    selector_width: int = DEFAULT_SELECTOR_WIDTH
    selector_optimizer: str = "adam"
    selector_epochs: int = 1
    selector_bn: str = "batch"
    prox_mu: float = 0.0
    device: str = "auto"
    lr_schedule: str = "constant"
    lr_min_ratio: float = 0.01
    loss: str = "dice"

    def __post_init__(self) -> None:
        if self.selector_width not in SELECTOR_WIDTHS:
            raise ConfigError(f"selector_width must be one of {SELECTOR_WIDTHS} (the paper's VGG-11 is 64), "
                              f"got {self.selector_width!r}")
        if self.selector_lr is None:
            object.__setattr__(self, "selector_lr", default_selector_lr("none", None, self.selector_width))
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown lr_schedule {self.lr_schedule!r}; choose from {', '.join(LR_SCHEDULES)}")
        if not 0.0 < self.lr_min_ratio <= 1.0:
            raise ConfigError(f"lr_min_ratio must lie in (0, 1], got {self.lr_min_ratio}")
        if self.loss not in SEGMENTATION_LOSSES:
            raise ConfigError(f"unknown loss {self.loss!r}; choose from {', '.join(SEGMENTATION_LOSSES)}")
        if self.selector_bn not in SELECTOR_BN_MODES:
            raise ConfigError(f"selector_bn must be one of {', '.join(SELECTOR_BN_MODES)}, got {self.selector_bn!r}")
        if self.selector_epochs < 1:
            raise ConfigError(f"selector_epochs must be >= 1, got {self.selector_epochs}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ConfigError(f"epochs and batch_size must be >= 1, got {self.epochs} and {self.batch_size}")
        if self.lr <= 0 or self.selector_lr <= 0:
            raise ConfigError(f"learning rates must be > 0, got lr={self.lr}, selector_lr={self.selector_lr}")
        if self.selector_size < 32 or self.selector_size % 32:
            raise ConfigError(f"selector_size must be a multiple of 32 (VGG pools 5 times), got {self.selector_size}")


@dataclass
class RoundContext:
    """Who is training what, for progress events and cancellation."""

    method: str
    round: int
    site: str
    progress: ProgressFn | None = None
    cancel: CancelFn | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel():
            raise CancelledError(f"{self.method}: training cancelled in round {self.round} at site {self.site}")

    def report(self, batch: int, batches: int, losses: Mapping[str, float]) -> None:
        if self.progress is not None:
            self.progress({
                "event": "batch", "method": self.method, "round": self.round, "site": self.site,
                "batch": batch, "batches": batches, "loss": {k: round(v, 5) for k, v in losses.items()},
            })


@dataclass
class Device:
    """Torch device plus whether mixed precision is used on it."""

    torch_device: torch.device
    amp: bool

    @classmethod
    def resolve(cls, name: str) -> Device:
        dev, amp = resolve_device(name)
        return cls(dev, amp)


def _seeded_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(int(seed) % (2**63))
    return gen


def batch_order(n: int, batch_size: int, epochs: int, seed: int) -> list[np.ndarray]:
    """Shuffled mini-batch indices for ``epochs`` passes over ``n`` samples (last batch may be short)."""
    gen = _seeded_generator(seed)
    batches: list[np.ndarray] = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen).numpy()
        batches += [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    return batches


def num_local_steps(n: int, cfg: LocalTrainingConfig) -> int:
    """Number of optimizer steps one local round takes on ``n`` samples."""
    return cfg.epochs * math.ceil(n / cfg.batch_size)


class _Learner:
    """One network with its optimizer, loss and (on CUDA) gradient scaler."""

    def __init__(self, net: torch.nn.Module, lr: float, device: Device, optimizer: str = "adam") -> None:
        self.net = net.to(device.torch_device)
        self.device = device
        self.opt: torch.optim.Optimizer
        if optimizer == "adam":
            # The fused kernel (CPU and CUDA) does one pass per parameter instead of ~8 separate
            # element-wise ops: the selector's Adam step drops from ~35 ms to ~8 ms on a CPU
            # core, with the same update up to float rounding (~1e-8).
            fused = device.torch_device.type in ("cpu", "cuda")
            self.opt = torch.optim.Adam(self.net.parameters(), lr=lr, betas=(0.9, 0.999), fused=fused)
        elif optimizer == "sgd":
            self.opt = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=0.9)
        else:
            raise ConfigError(f"unknown optimizer {optimizer!r}; use 'adam' or 'sgd'")
        self.scaler = torch.amp.GradScaler("cuda") if device.amp else None

    def step(self, loss_fn: Callable[[torch.nn.Module], torch.Tensor],
             grad_hook: Callable[[torch.nn.Module], None] | None = None) -> float:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", enabled=self.device.amp):
            loss = loss_fn(self.net)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        if grad_hook is not None:
            grad_hook(self.net)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        return float(loss.detach())


def _dice_loss(name: str = "dice") -> torch.nn.Module:
    return segmentation_loss(name)


def _segmentation_learner(task: TaskSpec, weights: Mapping[str, torch.Tensor], lr: float,
                          device: Device) -> _Learner:
    net = build_segmentation_net(task.in_channels, task.out_channels)
    net.load_state_dict(weights)
    net.train()
    return _Learner(net, lr, device)


def _selector_learner(task: TaskSpec, weights: Mapping[str, torch.Tensor], num_classes: int,
                      cfg: LocalTrainingConfig, device: Device) -> _Learner:
    net = build_selector(task.in_channels, num_classes, cfg.selector_head,  # type: ignore[arg-type]
                         cfg.selector_width)
    net.load_state_dict(weights)
    net.train()
    freeze_batchnorm_statistics(net)
    return _Learner(net, cfg.selector_lr, device, cfg.selector_optimizer)


def freeze_batchnorm_statistics(net: torch.nn.Module, momentum: float = 0.1) -> None:
    """Make BatchNorm layers normalise with their running statistics while still tracking them.

    Each layer is put in eval mode (running statistics normalise, not the batch's) and a
    forward pre-hook moves the running mean and variance toward the batch's with
    ``momentum``. FedAvg then averages the sites' statistics into federation-wide ones. A
    single-site batch's own statistics would subtract exactly the colour cast and brightness
    the selector has to see; federation-wide statistics keep them while still scaling the
    activations for fast training. The affine parameters train as usual.
    """
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
            module.register_forward_pre_hook(_make_stat_tracker(momentum))


def _make_stat_tracker(momentum: float) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
    def track(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].detach()
        if x.numel() // x.shape[1] <= 1:
            return  # one value per channel: no variance to learn from
        if x.dtype != module.running_mean.dtype:  # type: ignore[union-attr]
            x = x.to(module.running_mean.dtype)  # type: ignore[union-attr]
        # BatchNorm's own training-mode kernel updates the running statistics exactly as
        # ``(1 - m) * running + m * batch`` (unbiased batch variance), in one fused pass: about
        # 4x faster on a CPU than separate mean and variance reductions. Its output is discarded.
        with torch.no_grad():
            F.batch_norm(x, module.running_mean, module.running_var, None, None,  # type: ignore[arg-type]
                         training=True, momentum=momentum)
            module.num_batches_tracked.add_(1)  # type: ignore[union-attr]

    return track


def _to_device(array: np.ndarray, idx: np.ndarray, device: Device) -> torch.Tensor:
    return torch.from_numpy(array[idx]).to(device.torch_device, non_blocking=True)


def selector_inputs(images: np.ndarray, size: int) -> np.ndarray:
    """Images downscaled once per round to the selector's input size."""
    return resize_images(images, size)


class ScaffoldGradients:
    """Gradient hook of a Scaffold round: sums the uncorrected minibatch gradients, then corrects them.

    Called after ``backward`` (and after the gradient scaler's unscale on CUDA) and before the
    optimizer step: it first adds each parameter's gradient -- the gradient of the site's own
    loss on this minibatch, *before* correction -- to a running sum, then adds ``c - c_k`` to
    the gradient the optimizer sees. :func:`engine.fl.aggregation.scaffold_site_control` turns
    the sum into the site's new control variate (the mean gradient of the round).

    A step whose gradient has a NaN/Inf (mixed precision overflow; the gradient scaler skips
    that step) is left out of the sum and counted in :attr:`skipped`.

    Parameters
    ----------
    correction
        ``c - c_k`` per trainable parameter, on the training device.
    """

    def __init__(self, correction: Mapping[str, torch.Tensor]) -> None:
        self.correction = dict(correction)
        self.sum: dict[str, torch.Tensor] = {}
        self.batches = 0
        self.skipped = 0

    def __call__(self, net: torch.nn.Module) -> None:
        grads = {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads.values()]).all()) if grads else True
        if finite:
            for name, g in grads.items():
                if name not in self.correction:
                    continue
                acc = self.sum.get(name)
                if acc is None:
                    self.sum[name] = g.detach().float().clone()
                else:
                    acc.add_(g.detach())
            self.batches += 1
        else:
            self.skipped += 1
        for name, g in grads.items():
            if name in self.correction:
                g.add_(self.correction[name])

    def gradient_sum(self) -> Weights:
        """Sum of the uncorrected gradients per parameter (CPU; zero where there was none)."""
        return {k: (self.sum[k] if k in self.sum else torch.zeros_like(v, dtype=torch.float32)).detach().cpu()
                for k, v in self.correction.items()}


def train_segmentation_round(
    task: TaskSpec,
    weights: Mapping[str, torch.Tensor],
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    seed: int,
    ctx: RoundContext,
    *,
    prox_anchor: Mapping[str, torch.Tensor] | None = None,
    grad_hook: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[Weights, dict[str, float]]:
    """Train one segmentation network for one local round.

    Parameters
    ----------
    prox_anchor
        FedProx: the weights received this round; adds ``prox_mu/2 ||w - anchor||^2``.
    grad_hook
        Called with the network after every ``backward``, before the optimizer step (Scaffold:
        :class:`ScaffoldGradients`, see :func:`train_scaffold_round`).

    Returns
    -------
    weights, metrics
        Trained weights (CPU) and ``{"loss": mean loss, "steps": optimizer steps}``.
    """
    device = Device.resolve(cfg.device)
    torch.manual_seed(seed)
    learner = _segmentation_learner(task, weights, cfg.lr, device)
    loss_fn = _dice_loss(cfg.loss)
    anchor = None
    if prox_anchor is not None and cfg.prox_mu > 0:
        anchor = {k: v.to(device.torch_device) for k, v in prox_anchor.items()}

    batches = batch_order(len(data.images), cfg.batch_size, cfg.epochs, seed)
    total = 0.0
    for i, idx in enumerate(batches, start=1):
        ctx.check_cancel()
        x = _to_device(data.images, idx, device)
        y = _to_device(data.masks, idx, device)

        def objective(net: torch.nn.Module, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            loss = loss_fn(net(x), y)
            if anchor is not None:
                loss = loss + proximal_penalty(net, anchor, cfg.prox_mu)
            return loss

        loss = learner.step(objective, grad_hook)
        total += loss
        ctx.report(i, len(batches), {"seg": loss})
    return clone_weights(learner.net.state_dict()), {"loss": total / max(len(batches), 1),
                                                     "steps": float(len(batches))}


def train_scaffold_round(
    task: TaskSpec,
    weights: Mapping[str, torch.Tensor],
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    seed: int,
    ctx: RoundContext,
    correction: Mapping[str, torch.Tensor],
) -> tuple[Weights, ScaffoldGradients, dict[str, float]]:
    """One Scaffold round: every gradient gets ``correction = c - c_k`` added before the Adam step.

    Returns
    -------
    weights, gradients, metrics
        Trained weights (CPU), the :class:`ScaffoldGradients` of the round (sum and count of the
        uncorrected minibatch gradients) and the metrics of :func:`train_segmentation_round`.
    """
    device = Device.resolve(cfg.device)
    hook = ScaffoldGradients({k: v.to(device.torch_device) for k, v in correction.items()})
    trained, metrics = train_segmentation_round(task, weights, data, cfg, seed, ctx, grad_hook=hook)
    if hook.skipped:
        metrics["scaffold_skipped_steps"] = float(hook.skipped)
    return trained, hook, metrics


def train_fedsm_round(
    task: TaskSpec,
    global_weights: Mapping[str, torch.Tensor],
    personal_weights: Mapping[str, torch.Tensor],
    selector_weights: Mapping[str, torch.Tensor],
    site_index: int,
    num_sites: int,
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    seed: int,
    ctx: RoundContext,
    train_selector: bool = True,
) -> tuple[Weights, Weights, Weights, dict[str, float]]:
    """One FedSM local round (paper Algorithm 1, lines 6-11).

    Each batch takes one Adam step on the site's copy of the global model, one on its
    personalized model, and (``train_selector``, the per-batch scheme of ``--selector-calibration
    lda``) one on the selector with label ``site_index`` (0-based). With ``train_selector=False``
    the selector is returned unchanged: the reference scheme trains it separately
    (:func:`engine.fl.selector_training.reference_selector_round`).

    Returns
    -------
    global, personal, selector, metrics
        The three trained weight dicts and mean losses per network.
    """
    if not 0 <= site_index < num_sites:
        raise ConfigError(f"site index {site_index} outside 0..{num_sites - 1}")
    device = Device.resolve(cfg.device)
    torch.manual_seed(seed)
    glob = _segmentation_learner(task, global_weights, cfg.lr, device)
    pers = _segmentation_learner(task, personal_weights, cfg.lr, device)
    sel = _selector_learner(task, selector_weights, num_sites, cfg, device) if train_selector else None
    dice = _dice_loss(cfg.loss)
    small = selector_inputs(data.images, cfg.selector_size) if sel is not None else data.images

    batches = batch_order(len(data.images), cfg.batch_size, cfg.epochs, seed)
    sums = {"global": 0.0, "personal": 0.0} | ({"selector": 0.0} if sel is not None else {})
    for i, idx in enumerate(batches, start=1):
        ctx.check_cancel()
        x = _to_device(data.images, idx, device)
        y = _to_device(data.masks, idx, device)
        losses = {
            "global": glob.step(lambda net, x=x, y=y: dice(net(x), y)),
            "personal": pers.step(lambda net, x=x, y=y: dice(net(x), y)),
        }
        if sel is not None:
            xs = _to_device(small, idx, device)
            label = torch.full((len(idx),), site_index, dtype=torch.long, device=device.torch_device)
            losses["selector"] = sel.step(lambda net, xs=xs, label=label: F.cross_entropy(net(xs), label))
        for k, v in losses.items():
            sums[k] += v
        ctx.report(i, len(batches), losses)
    n = max(len(batches), 1)
    metrics = {f"loss_{k}": v / n for k, v in sums.items()} | {"steps": float(len(batches))}
    selector_out = clone_weights(sel.net.state_dict()) if sel is not None else clone_weights(selector_weights)
    return clone_weights(glob.net.state_dict()), clone_weights(pers.net.state_dict()), selector_out, metrics


def train_selector_round(
    task: TaskSpec,
    selector_weights: Mapping[str, torch.Tensor],
    labels: np.ndarray,
    num_classes: int,
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    seed: int,
    ctx: RoundContext,
) -> tuple[Weights, dict[str, float]]:
    """Train the selector alone on per-image ``labels`` (FedSM-extra's extra rounds)."""
    device = Device.resolve(cfg.device)
    torch.manual_seed(seed)
    sel = _selector_learner(task, selector_weights, num_classes, cfg, device)
    small = selector_inputs(data.images, cfg.selector_size)
    targets = torch.from_numpy(labels.astype(np.int64))
    batches = batch_order(len(data.images), cfg.batch_size, cfg.epochs, seed)
    total = 0.0
    for i, idx in enumerate(batches, start=1):
        ctx.check_cancel()
        xs = _to_device(small, idx, device)
        y = targets[idx].to(device.torch_device)
        loss = sel.step(lambda net, xs=xs, y=y: F.cross_entropy(net(xs), y))
        total += loss
        ctx.report(i, len(batches), {"selector": loss})
    return clone_weights(sel.net.state_dict()), {"loss_selector": total / max(len(batches), 1),
                                                 "steps": float(len(batches))}


def best_model_labels(
    task: TaskSpec,
    global_weights: Mapping[str, torch.Tensor],
    personal_weights: list[Mapping[str, torch.Tensor]],
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    ctx: RoundContext,
) -> np.ndarray:
    """FedSM-extra selector labels: per image, the model with the lowest Dice loss.

    Index 0 is the global model, ``k`` (1..K) site k's personalized model.
    """
    from monai.losses import DiceLoss

    device = Device.resolve(cfg.device)
    per_image = DiceLoss(sigmoid=True, reduction="none")
    losses = np.zeros((len(data.images), 1 + len(personal_weights)), dtype=np.float64)
    for m, weights in enumerate([global_weights, *personal_weights]):
        net = build_segmentation_net(task.in_channels, task.out_channels)
        net.load_state_dict(weights)
        net.to(device.torch_device).eval()
        with torch.inference_mode():
            for start in range(0, len(data.images), cfg.batch_size):
                ctx.check_cancel()
                idx = np.arange(start, min(start + cfg.batch_size, len(data.images)))
                x = _to_device(data.images, idx, device)
                y = _to_device(data.masks, idx, device)
                with torch.autocast("cuda", enabled=device.amp):
                    out = net(x)
                loss = per_image(out.float(), y).flatten(1).mean(1)
                losses[idx, m] = loss.cpu().numpy()
    # ties (e.g. an empty slice every model gets right) go to the global model, index 0
    return np.argmin(losses, axis=1).astype(np.int64)
