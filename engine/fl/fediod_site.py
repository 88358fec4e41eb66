"""FedIOD's site half: the teacher, the discriminator and the privacy-sanitised input gradients.

Everything a site keeps lives in :attr:`engine.fl.methods.SiteRuntime.state` under
:data:`STATE_KEY`, and nothing of it leaves the site: the coordinator only ever receives the
site's size and label frequencies (once), the teacher's logits and the discriminator's scores
on *generated* images, and gradients with respect to those images (clipped and noised per the
site's :class:`~engine.fl.fediod_privacy.PrivacySetting`).

A site may bring any teacher architecture: put ``"teacher_factory"`` (``() -> nn.Module``
mapping ``(N, C, S, S)`` images to ``(N, L, S, S)`` logits) into the site state before the
run; otherwise the project's U-Net is trained (:func:`train_teacher`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import ConfigError, FedSMError
from engine.fl.evaluation import dice_per_case
from engine.fl.fediod_losses import discriminator_loss
from engine.fl.fediod_nets import PatchDiscriminator
from engine.fl.fediod_privacy import PrivacySetting, clip_and_noise, epsilon_spent
from engine.fl.local_training import Device, LocalTrainingConfig, RoundContext, train_segmentation_round
from engine.fl.methods.contract import noise_generator
from engine.fl.weights import clone_weights
from engine.models import build_segmentation_net

if TYPE_CHECKING:
    from engine.data.site_data import SplitArrays
    from engine.fl.methods import SiteRuntime
    from engine.tasks import TaskSpec

#: Key of the FedIOD site state inside ``SiteRuntime.state``.
STATE_KEY = "fediod"
#: Key of the site operator's :class:`PrivacySetting` inside ``SiteRuntime.state`` (site.toml).
PRIVACY_KEY = "privacy"


@dataclass
class SiteState:
    """What one site keeps between FedIOD's exchanges (never sent)."""

    teacher: torch.nn.Module
    discriminator: PatchDiscriminator
    optimizer: torch.optim.Optimizer
    privacy: PrivacySetting
    noise_multiplier: float
    #: draws the site's real batches for its discriminator (seeded from the run's seed: reproducible)
    rng: torch.Generator
    #: draws its privacy noise where it must repeat (a simulation, :func:`noise_generator`); ``None``: the
    #: operating system's secure generator (:mod:`engine.fl.secure_noise`), every network site
    noise_rng: torch.Generator | None
    releases: int = 0
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    teacher_metrics: dict[str, float] = field(default_factory=dict)
    #: (step, images with grad, logits, scores) of the last query, graph kept for its gradient
    graph: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far (``inf`` when the site adds no noise)."""
        return epsilon_spent(self.noise_multiplier, self.releases, self.privacy.delta)


def label_frequency(masks: np.ndarray) -> np.ndarray:
    """Fraction of pixels that are foreground, per label (the site's "class statistics"), float64 ``(L,)``."""
    if masks.ndim != 4 or masks.shape[0] == 0:
        raise ConfigError(f"label frequencies need (N, L, H, W) masks with N >= 1, got shape {masks.shape}")
    return masks.astype(bool).mean(axis=(0, 2, 3), dtype=np.float64)


def validation_dice(net: torch.nn.Module, data: SplitArrays, device: Device, batch_size: int = 16) -> float:
    """Mean per-case Dice of ``net`` on ``data`` (sigmoid > 0.5)."""
    net.eval()
    out = np.zeros(data.masks.shape, dtype=np.uint8)
    with torch.inference_mode():
        for start in range(0, len(data.images), batch_size):
            x = torch.from_numpy(data.images[start:start + batch_size]).to(device.torch_device)
            out[start:start + batch_size] = (net(x).float() > 0).cpu().numpy()
    return float(dice_per_case(out, data.masks, data.case_ids).mean())


def train_teacher(task: TaskSpec, site: SiteRuntime, cfg: LocalTrainingConfig, max_epochs: int, patience: int,
                  seed: int, ctx: RoundContext) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Stage 1: train the site's U-Net teacher to completion, early-stopped on its validation split.

    One epoch at a time; after each, the validation Dice decides: the best weights so far are
    kept, and training stops after ``patience`` epochs without improvement (or at
    ``max_epochs``). A site without validation images trains ``max_epochs`` epochs.

    Returns
    -------
    weights, metrics
        The best weights and ``{"teacher_val_dice", "teacher_epochs", "teacher_best_epoch"}``.
    """
    if max_epochs < 1 or patience < 1:
        raise ConfigError(f"teacher epochs and patience must be >= 1, got {max_epochs} and {patience}")
    torch.manual_seed(seed % (2**63))
    weights = clone_weights(build_segmentation_net(task.in_channels, task.out_channels).state_dict())
    validation = site.validation if site.validation is not None and len(site.validation.images) else None
    device = Device.resolve(cfg.device)
    best, best_dice, best_epoch, epoch = weights, -math.inf, 0, 0
    for epoch in range(1, max_epochs + 1):
        weights, _ = train_segmentation_round(task, weights, site.train, cfg, seed + epoch, ctx)
        if validation is None:
            best, best_epoch = weights, epoch
            continue
        net = build_segmentation_net(task.in_channels, task.out_channels).to(device.torch_device)
        net.load_state_dict(weights)
        dice = validation_dice(net, validation, device)
        if dice > best_dice:
            best, best_dice, best_epoch = weights, dice, epoch
        elif epoch - best_epoch >= patience:
            break
    return best, {"teacher_val_dice": best_dice if validation is not None else float("nan"),
                  "teacher_epochs": float(epoch), "teacher_best_epoch": float(best_epoch)}


def setup_site(task: TaskSpec, site: SiteRuntime, config: dict[str, Any], default_privacy: PrivacySetting,
               ctx: RoundContext) -> SiteState:
    """Train (or take) the teacher, build the discriminator and settle the site's noise level."""
    seed = int(config["seed"])
    device = Device.resolve(str(config.get("device", "auto")))
    factory: Callable[[], torch.nn.Module] | None = site.state.get("teacher_factory")
    metrics: dict[str, float] = {}
    if factory is not None:
        teacher = factory()
    else:
        cfg = LocalTrainingConfig(epochs=1, batch_size=int(config["batch_size"]), lr=float(config["lr"]),
                                  device=str(config.get("device", "auto")))
        weights, metrics = train_teacher(task, site, cfg, int(config["teacher_epochs"]),
                                         int(config["teacher_patience"]), seed, ctx)
        teacher = build_segmentation_net(task.in_channels, task.out_channels)
        teacher.load_state_dict(weights)
    teacher.to(device.torch_device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    torch.manual_seed((seed + 1) % (2**63))
    disc = PatchDiscriminator(task.in_channels).to(device.torch_device)
    opt = torch.optim.Adam(disc.parameters(), lr=float(config["lr_d"]), betas=(0.5, 0.999))
    privacy = site.state.get(PRIVACY_KEY) or default_privacy
    if not isinstance(privacy, PrivacySetting):
        raise ConfigError(f"site {site.name}: privacy setting must be a PrivacySetting, got {type(privacy).__name__}")
    noise = privacy.resolved_noise(int(config["releases"]))
    rng = torch.Generator()
    rng.manual_seed((seed + 2) % (2**63))
    # the noise is never seeded from the coordinator's `seed`: knowing it, the coordinator could regenerate
    # every draw and subtract it from the released gradients; a network site's comes from the OS's CSPRNG
    noise_rng = noise_generator(site)
    return SiteState(teacher, disc, opt, privacy, noise, rng, noise_rng, teacher_metrics=metrics)


def _real_batch(state: SiteState, data: SplitArrays, size: int) -> torch.Tensor:
    idx = torch.randperm(len(data.images), generator=state.rng)[:size].numpy()
    return torch.from_numpy(data.images[np.sort(idx)])


def answer_query(state: SiteState, data: SplitArrays, images: torch.Tensor, step: int,
                 train_discriminator: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One distillation step at the site: update ``D_k`` (Eq. 2), then score and segment ``images``.

    The images are kept (by ``step``) for the gradient request that follows.

    Returns
    -------
    logits, scores, d_loss
        ``T_k(x)`` ``(B, L, S, S)``, ``D_k(x)`` patch logits, and the discriminator's loss.
    """
    device = next(state.discriminator.parameters()).device
    x = images.detach().to(device, torch.float32)
    d_loss = float("nan")
    if train_discriminator:
        real = _real_batch(state, data, len(x)).to(device)
        state.discriminator.train()
        state.optimizer.zero_grad(set_to_none=True)
        loss = discriminator_loss(state.discriminator(real), state.discriminator(x))
        loss.backward()
        state.optimizer.step()
        d_loss = float(loss.detach())
    # The forward pass keeps its graph for the gradient request that follows (one teacher pass
    # per step instead of two); a site rebuilt from its weight dicts recomputes it.
    xg = x.clone().requires_grad_(True)
    logits = state.teacher(xg).float()
    scores = state.discriminator(xg).float()
    state.pending = {step: x}
    state.graph = (step, xg, logits, scores)
    return logits.detach().cpu(), scores.detach().cpu(), d_loss


def answer_gradient(state: SiteState, step: int, logit_grad: torch.Tensor, score_grad: torch.Tensor
                    ) -> torch.Tensor:
    """Vector-Jacobian product of (``T_k(x)``, ``D_k(x)``) w.r.t. ``x`` for the coordinator's cotangents, sanitised.

    Only the gradient with respect to the generated images leaves the site; with a privacy
    setting it is clipped to the site's norm and noised with its multiplier, and every release
    is counted for the accountant. Without one (noise 0) the exact gradient is sent and the
    reported epsilon is infinite.
    """
    x = state.pending.pop(step, None)
    if x is None:
        raise FedSMError(f"no images of step {step} are waiting for a gradient at this site; "
                         "the coordinator must send the query first")
    graph, state.graph = state.graph, None
    if graph is not None and graph[0] == step:
        _, x, logits, scores = graph
    else:
        x = x.clone().requires_grad_(True)
        logits = state.teacher(x).float()
        scores = state.discriminator(x).float()
    if logit_grad.shape != logits.shape or score_grad.shape != scores.shape:
        raise FedSMError(f"gradient request shapes {tuple(logit_grad.shape)}, {tuple(score_grad.shape)} do not "
                         f"match the answers {tuple(logits.shape)}, {tuple(scores.shape)}")
    (grad,) = torch.autograd.grad((logits, scores), (x,),
                                  (logit_grad.to(x.device, torch.float32), score_grad.to(x.device, torch.float32)))
    state.releases += 1
    if state.noise_multiplier <= 0:
        return grad.detach().cpu().float()  # no DP: the exact gradient (still only w.r.t. the images)
    released, _ = clip_and_noise(grad.cpu(), state.privacy.clip_norm, state.noise_multiplier, state.noise_rng)
    return released


#: Keys of the weight-dict mirror of a :class:`SiteState` inside ``SiteRuntime.state``.
MIRROR_KEYS = ("fediod/teacher", "fediod/discriminator", "fediod/site")


def mirror_state(site: SiteRuntime, state: SiteState, teacher: bool = True) -> None:
    """Copy ``state`` into plain weight dicts in ``site.state``, as transports persist site state.

    A transport that keeps only weight dicts between messages (e.g. through
    :func:`engine.federation.checkpoint.save_site_state`) can then rebuild the site with
    :func:`restore_state`. The discriminator's Adam moments are not kept (a restored site starts a
    fresh Adam); everything else, the batch generator, a seeded noise generator (secure noise has no
    state) and the release count included, is.
    The teacher never changes after setup, so ``teacher=False`` skips copying it again.
    """
    if teacher or "fediod/teacher" not in site.state:
        site.state["fediod/teacher"] = {k: v.detach().cpu().clone() for k, v in state.teacher.state_dict().items()}
    site.state["fediod/discriminator"] = {k: v.detach().cpu().clone()
                                          for k, v in state.discriminator.state_dict().items()}
    p = state.privacy
    info = {"releases": torch.tensor(float(state.releases), dtype=torch.float64),
            "noise_multiplier": torch.tensor(state.noise_multiplier, dtype=torch.float64),
            "clip_norm": torch.tensor(p.clip_norm, dtype=torch.float64),
            "delta": torch.tensor(p.delta, dtype=torch.float64),
            "epsilon_target": torch.tensor(math.nan if p.epsilon is None else p.epsilon, dtype=torch.float64),
            "rng": state.rng.get_state().clone(),
            "lr_d": torch.tensor(state.optimizer.param_groups[0]["lr"], dtype=torch.float64)}
    if state.noise_rng is not None:  # secure noise has no state to keep
        info["noise_rng"] = state.noise_rng.get_state().clone()
    for step, images in state.pending.items():
        info["pending_step"] = torch.tensor(step, dtype=torch.int64)
        info["pending_images"] = images.detach().cpu().clone()
    for key, value in state.teacher_metrics.items():
        info[f"metric/{key}"] = torch.tensor(value, dtype=torch.float64)
    site.state["fediod/site"] = info


def restore_state(task: TaskSpec, site: SiteRuntime, device: str = "auto") -> SiteState | None:
    """Rebuild a :class:`SiteState` from its weight-dict mirror (``None`` when there is none)."""
    teacher_w, disc_w, info = (site.state.get(k) for k in MIRROR_KEYS)
    if not (isinstance(teacher_w, dict) and isinstance(disc_w, dict) and isinstance(info, dict)):
        return None
    dev = Device.resolve(device).torch_device
    factory = site.state.get("teacher_factory")
    teacher = factory() if factory is not None else build_segmentation_net(task.in_channels, task.out_channels)
    teacher.load_state_dict(teacher_w)
    teacher.to(dev).eval()
    for param in teacher.parameters():
        param.requires_grad_(False)
    disc = PatchDiscriminator(task.in_channels).to(dev)
    disc.load_state_dict(disc_w)
    opt = torch.optim.Adam(disc.parameters(), lr=float(info["lr_d"]), betas=(0.5, 0.999))
    target = float(info["epsilon_target"])
    privacy = PrivacySetting(noise_multiplier=0.0 if math.isfinite(target) else float(info["noise_multiplier"]),
                             epsilon=target if math.isfinite(target) else None,
                             clip_norm=float(info["clip_norm"]), delta=float(info["delta"]))
    rng = torch.Generator()
    rng.set_state(info["rng"].clone())
    noise_rng = noise_generator(site)  # None on a network site: secure noise, whatever an older version kept
    if noise_rng is not None and "noise_rng" in info:
        noise_rng.set_state(info["noise_rng"].clone())
    pending = {int(info["pending_step"]): info["pending_images"].to(dev)} if "pending_images" in info else {}
    metrics = {k.removeprefix("metric/"): float(v) for k, v in info.items() if k.startswith("metric/")}
    return SiteState(teacher, disc, opt, privacy, float(info["noise_multiplier"]), rng, noise_rng,
                     int(info["releases"]), pending, metrics)


def teacher_copy(state: SiteState) -> torch.nn.Module:
    """A copy of the site's teacher (for the simulation's Standalone evaluation only)."""
    return copy.deepcopy(state.teacher)
