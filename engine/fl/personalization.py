"""Personalization alternatives to SoftPull inside FedSM (the paper's Table 6).

FedSM's personalized models come from SoftPull. The paper compares SoftPull with four other ways
of getting a personalized model per site while the global model (FedAvg) and the model selector
train exactly as in FedSM. This module holds their update rules as small functions (tested
against hand-computed values) and the site half of one local round for each.

Alternatives and hyper-parameters (:class:`PersonalizationConfig`):

``finetune``  local fine-tuning
    Training rounds train the global model and the selector only. In the calibration round each
    site fine-tunes the *final* global model on its own training data for ``finetune_epochs``
    epochs (Adam, the U-Nets' learning rate); the result is its personalized model.
``apfl``  APFL, Deng et al. 2020 ("Adaptive Personalized Federated Learning"), Algorithm 1
    Each site keeps a private model ``v`` and a mixing weight ``alpha`` (init ``apfl_alpha``).
    Per batch: the site's copy of the global model ``w`` takes its FedAvg step; ``v`` takes a
    step with the gradient of the loss at the mixture ``vbar = alpha v + (1 - alpha) w``
    (``grad_v = alpha grad f(vbar)``) with *plain SGD* at ``apfl_v_lr`` (``apfl_v_optimizer``; 3.0,
    the best of 0.1 / 1 / 3 on validation: Dice-loss gradients of a U-Net are small), as in the
    paper: Adam divides every step by the running gradient scale and so cancels the ``alpha``
    factor that makes ``v`` learn more slowly when the mixture leans on ``w``;
    ``alpha <- clip(alpha - alpha_lr <v - w, grad f(vbar)>, 0, 1)`` (plain gradient step, as in
    the paper). The personalized model is the final mixture ``alpha v + (1 - alpha) w_global``.
``perfedavg``  Per-FedAvg, Fallah et al. 2020, first-order version (FO-MAML)
    A second shared U-Net ``theta`` (the meta-model) is trained by FedAvg with the first-order
    MAML step on two *different* batches, as in the paper's Algorithm 1: ``D`` is the round's
    next batch and ``D'`` a batch of an independently shuffled second pass over the site's data;
    ``theta' = theta - inner_lr grad f(theta; D)`` (SGD), then ``theta`` takes an Adam step along
    ``grad f(theta'; D')``. (A site whose data fits one batch gets the same images in both.) The personalized
    model is the final ``theta`` after ``adapt_steps`` SGD steps of ``inner_lr`` on the site's
    training set (full-data gradient, mean over its batches).
``pfedme``  pFedMe, Dinh et al. 2020 ("Personalized FL with Moreau Envelopes"), Algorithm 1
    At the start of every round the site's personalized model ``theta`` and its local copy
    ``w_loc`` are both set to the received pFedMe model ``w`` (the authors' code does the same).
    Per batch ``theta`` approximately solves ``min f(theta; D) + lam/2 ||theta - w_loc||^2``
    with ``pfedme_inner_steps`` Adam steps, then ``w_loc`` takes a step along the gradient of the
    Moreau envelope, ``lam (w_loc - theta)``; the server sets ``w <- (1 - beta) w + beta mean(w_loc)``.
    The last round's ``theta`` stays at the site and is the personalized model. Defaults follow
    the paper (``beta`` 1) except 3 inner steps instead of 5, Adam as the inner solver (plain SGD
    at 0.01 barely moves a U-Net trained with a Dice loss in a few rounds), and two changes that
    make pFedMe train at all with Dice-loss gradients, which are small (docs/results.md,
    personalization; with the paper's settings the personalized Dice was 0.08 fundus and 0.02
    prostate on cpu-converged):

    - the ``w_loc`` step (``pfedme_outer``): ``"adam"`` (default) is an Adam step at the U-Nets'
      learning rate on ``lam (w_loc - theta)``, like every other method's main model here;
      ``"sgd"`` is the paper's ``w_loc <- w_loc - eta lam (w_loc - theta)`` (``pfedme_eta``
      0.005), which moves ``w_loc`` by ``eta`` times the data gradient at ``theta``: at most
      2.4e-5 per parameter over 8 rounds here (fundus, 32 px), i.e. not at all;
    - ``lam`` 0.1 instead of 15: with Adam steps of 1e-3, ``lam`` 15 makes the proximal pull
      (0.015 per unit of step) outweigh the data gradient, ``theta`` oscillates around
      ``w_loc`` and the shared model does not learn. Chosen on validation (fundus, 6 sites,
      32 px, 8 rounds, seed 0; shared model's client-average validation Dice, global model
      0.146): ``lam`` 15: 0.062, 1: 0.129, 0.1: 0.152, 0.01: 0.153 (level with 0.1).

Where the original algorithms use plain SGD for the main model we use Adam with the U-Nets'
learning rate, like every other method here, so the comparison isolates the personalization rule
(APFL's private model is the exception, see above).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from engine.bundle.supermodel import PERSONALIZATION_RULES as BUNDLE_PERSONALIZATION_RULES
from engine.errors import ConfigError
from engine.fl.aggregation import fedavg
from engine.fl.local_training import (
    Device,
    _segmentation_learner,
    _selector_learner,
    _to_device,
    batch_order,
    segmentation_loss,
    selector_inputs,
)
from engine.fl.weights import Weights, clone_weights, weighted_sum
from engine.models import build_segmentation_net

if TYPE_CHECKING:
    from engine.data.site_data import SplitArrays
    from engine.fl.local_training import LocalTrainingConfig, RoundContext
    from engine.tasks import TaskSpec

#: Every rule FedSM can train its personalized models with (``--personalization``); the names
#: live with the bundle format, which records the rule.
PERSONALIZATION_RULES = BUNDLE_PERSONALIZATION_RULES
#: FedSM's own rule (the paper's): personalized models pulled towards each other after every round.
SOFTPULL = PERSONALIZATION_RULES[0]
#: The alternatives, in the order tables list them.
PERSONALIZATIONS = PERSONALIZATION_RULES[1:]
#: Rules whose sites train one more shared U-Net, averaged by the server (server state ``"shared"``).
SHARED_TRACK_RULES = ("perfedavg", "pfedme")
#: Site-state keys of APFL's private model and mixing weight (kept as weight dicts so that a
#: network site persists them between rounds like any other private tensor).
APFL_V, APFL_ALPHA = "apfl_v", "apfl_alpha"


def check_personalization(rule: str) -> str:
    """``rule`` if it is one of :data:`PERSONALIZATION_RULES`, else a :class:`ConfigError` naming them."""
    if rule not in PERSONALIZATION_RULES:
        raise ConfigError(f"unknown personalization {rule!r}; choose one of {', '.join(PERSONALIZATION_RULES)}")
    return rule


def apfl_alpha_of(site_state: Mapping[str, Any], default: float) -> float:
    """APFL's mixing weight as the site keeps it (``default`` before the site's first round)."""
    kept = site_state.get(APFL_ALPHA)
    return default if kept is None else float(kept["alpha"][0])


def apfl_model_now(site_state: Mapping[str, Any], global_weights: Mapping[str, torch.Tensor],
                   default_alpha: float) -> Weights | None:
    """APFL's personalized model as the site would build it from ``global_weights`` now
    (``alpha v + (1 - alpha) w``); ``None`` while the site holds no private model ``v``."""
    if APFL_V not in site_state:
        return None
    return apfl_mix(site_state[APFL_V], global_weights, apfl_alpha_of(site_state, default_alpha))


def _keep_apfl_alpha(site_state: dict[str, Any], alpha: float) -> None:
    site_state[APFL_ALPHA] = {"alpha": torch.tensor([alpha], dtype=torch.float64)}

LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class PersonalizationConfig:
    """Hyper-parameters of the personalization alternatives (see the module docstring)."""

    finetune_epochs: int = 2
    apfl_alpha: float = 0.5
    apfl_alpha_lr: float = 0.01
    apfl_v_optimizer: str = "sgd"
    #: Measured (fundus, 6 sites, 64 px, 8 rounds, seed 0; validation Dice of the personalized
    #: mixtures): SGD 0.1 -> 0.264, 1.0 -> 0.412, 3.0 -> 0.499; Adam 0.487; global model 0.474.
    apfl_v_lr: float = 3.0
    inner_lr: float = 0.01
    adapt_steps: int = 1
    pfedme_lam: float = 0.1
    pfedme_eta: float = 0.005
    pfedme_beta: float = 1.0
    pfedme_inner_steps: int = 3
    pfedme_outer: str = "adam"

    def __post_init__(self) -> None:
        if not 0.0 <= self.apfl_alpha <= 1.0:
            raise ConfigError(f"apfl_alpha={self.apfl_alpha} must lie in [0, 1]")
        if self.finetune_epochs < 1 or self.adapt_steps < 0 or self.pfedme_inner_steps < 1:
            raise ConfigError("finetune_epochs and pfedme_inner_steps must be >= 1, adapt_steps >= 0")
        if min(self.apfl_alpha_lr, self.inner_lr, self.pfedme_lam, self.pfedme_eta) <= 0:
            raise ConfigError("personalization step sizes and pfedme_lam must be > 0")
        if self.apfl_v_optimizer not in ("sgd", "adam") or self.apfl_v_lr <= 0:
            raise ConfigError(f"apfl_v_optimizer must be 'sgd' or 'adam' with apfl_v_lr > 0, got "
                              f"{self.apfl_v_optimizer!r}, {self.apfl_v_lr}")
        if self.pfedme_outer not in ("adam", "sgd"):
            raise ConfigError(f"pfedme_outer must be 'adam' or 'sgd', got {self.pfedme_outer!r}")
        if not 0.0 < self.pfedme_beta <= 2.0:
            raise ConfigError(f"pfedme_beta={self.pfedme_beta} must lie in (0, 2]")


# --------------------------------------------------------------------------------------------
# Update rules (pure; tested against hand-computed values)
# --------------------------------------------------------------------------------------------
def apfl_mix(v: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor], alpha: float) -> Weights:
    """APFL's personalized model ``alpha v + (1 - alpha) w``."""
    return weighted_sum([(v, alpha), (w, 1.0 - alpha)])


def apfl_gradients(v: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor], alpha: float,
                   grad_at_mix: Mapping[str, torch.Tensor]) -> tuple[Weights, float]:
    """Gradients of APFL's private model and mixing weight from ``g = grad f(vbar)``.

    Returns
    -------
    grad_v, grad_alpha
        ``alpha g`` per tensor and ``sum <v - w, g>`` over all tensors.
    """
    grad_v = {k: alpha * g for k, g in grad_at_mix.items()}
    grad_alpha = float(sum(((v[k] - w[k]) * g).sum() for k, g in grad_at_mix.items()))
    return grad_v, grad_alpha


def apfl_alpha_step(alpha: float, grad_alpha: float, lr: float) -> float:
    """``clip(alpha - lr grad_alpha, 0, 1)``."""
    return float(min(max(alpha - lr * grad_alpha, 0.0), 1.0))


def pfedme_local_update(w_local: Mapping[str, torch.Tensor], theta: Mapping[str, torch.Tensor],
                        lam: float, eta: float) -> Weights:
    """pFedMe's local model step ``w <- w - eta lam (w - theta)`` (the paper's plain step)."""
    grad = pfedme_envelope_gradient(w_local, theta, lam)
    return {k: w_local[k] - eta * grad[k] for k in w_local}


def pfedme_envelope_gradient(w_local: Mapping[str, torch.Tensor], theta: Mapping[str, torch.Tensor],
                             lam: float) -> Weights:
    """Gradient of pFedMe's Moreau envelope at ``w_local``: ``lam (w_local - theta)``.

    ``theta`` is the (approximate) solution of the proximal problem around ``w_local``; the
    paper's local step is ``w_local - eta`` times this (:func:`pfedme_local_update`).
    """
    return {k: lam * (w_local[k] - theta[k]) for k in w_local}


def pfedme_server_update(server: Mapping[str, torch.Tensor], local: Sequence[Mapping[str, torch.Tensor]],
                         beta: float) -> Weights:
    """pFedMe's server step ``w <- (1 - beta) w + beta mean_k(w_k)`` over the answering sites."""
    if not local:
        return dict(server)
    share = beta / len(local)
    return weighted_sum([(server, 1.0 - beta), *[(w, share) for w in local]])


def first_order_maml_gradient(net: torch.nn.Module, loss_fn: LossFn, batch_a: Any, batch_b: Any,
                              inner_lr: float) -> dict[str, torch.Tensor]:
    """Per-FedAvg's first-order meta-gradient ``grad f(theta - inner_lr grad f(theta; a); b)``."""
    params = dict(net.named_parameters())
    loss_a = loss_fn(lambda x: functional_call(net, params, (x,)), batch_a)
    grads = torch.autograd.grad(loss_a, list(params.values()))
    adapted = {n: (p - inner_lr * g).detach().requires_grad_() for (n, p), g in zip(params.items(), grads,
                                                                                   strict=True)}
    loss_b = loss_fn(lambda x: functional_call(net, adapted, (x,)), batch_b)
    meta = torch.autograd.grad(loss_b, list(adapted.values()))
    return {n: g.detach() for n, g in zip(adapted, meta, strict=True)}


def shared_model_update(rule: str, shared: Mapping[str, torch.Tensor],
                        answers: Sequence[tuple[Mapping[str, torch.Tensor], int]],
                        pcfg: PersonalizationConfig) -> Weights | None:
    """The server's step on the shared U-Net of a rule in :data:`SHARED_TRACK_RULES`, from the
    answering sites' ``(weights, sample count)``: Per-FedAvg averages its meta-model (FedAvg),
    pFedMe mixes (:func:`pfedme_server_update`); ``None`` for rules without a shared model."""
    if rule == "perfedavg":
        return fedavg(answers)
    if rule == "pfedme":
        return pfedme_server_update(shared, [w for w, _ in answers], pcfg.pfedme_beta)
    return None


def pfedme_objective(net: torch.nn.Module, loss: torch.Tensor, w_local: Mapping[str, torch.Tensor],
                     lam: float) -> torch.Tensor:
    """pFedMe's inner objective ``f(theta) + lam/2 ||theta - w_local||^2``."""
    prox = sum(((p - w_local[n]) ** 2).sum() for n, p in net.named_parameters())
    return loss + 0.5 * lam * prox


# --------------------------------------------------------------------------------------------
# Site half of one round
# --------------------------------------------------------------------------------------------
def _seg_net(task: TaskSpec, weights: Mapping[str, torch.Tensor], device: Any) -> torch.nn.Module:
    net = build_segmentation_net(task.in_channels, task.out_channels)
    net.load_state_dict(weights)
    return net.to(device.torch_device).train()


def _adam(net: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.999))


def _dice_batch_loss(name: str = "dice") -> Callable[[Callable[[torch.Tensor], torch.Tensor],
                                                      tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    loss = segmentation_loss(name)
    return lambda forward, batch: loss(forward(batch[0]), batch[1])


def _set_grads(net: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    for name, p in net.named_parameters():
        p.grad = grads[name].to(p.device, p.dtype).clone()


def per_fedavg_batches(batch: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-FedAvg's ``D`` (the round's batch) and ``D'`` (a batch of the independent second pass).

    Both have the configured batch size (the paper draws two full batches; splitting one batch
    in halves, as an earlier version did, halves both and correlates them).
    """
    return np.asarray(batch), np.asarray(other)


def _net_weights(net: torch.nn.Module) -> Weights:
    return clone_weights(net.state_dict())


def train_personalized_round(
    kind: str,
    task: TaskSpec,
    weights: Mapping[str, Mapping[str, torch.Tensor]],
    site_index: int,
    num_sites: int,
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    pcfg: PersonalizationConfig,
    site_state: dict[str, Any],
    seed: int,
    ctx: RoundContext,
    train_selector: bool = True,
) -> tuple[dict[str, Weights], dict[str, float]]:
    """One local training round of FedSM with personalization ``kind`` instead of SoftPull.

    ``weights`` holds ``global`` and ``selector`` (and ``personal``, the shared meta / pFedMe
    model, for ``perfedavg`` and ``pfedme``). Private state (APFL's ``v`` and ``alpha``,
    pFedMe's ``theta``) lives in ``site_state`` between rounds and leaves the site only as the
    personalized model of the last round (:func:`personalized_model`).

    Parameters
    ----------
    train_selector
        Whether the selector takes a step per batch here (the older per-batch scheme). ``False``
        when FedSM trains it with the reference scheme in its own pass
        (:func:`engine.fl.selector_training.reference_selector_round`); then ``selector`` is
        neither needed nor returned.

    Returns
    -------
    parts, metrics
        The trained parts to send back and mean losses.
    """
    if kind not in PERSONALIZATIONS:
        raise ConfigError(f"unknown personalization {kind!r}; choose from {', '.join(PERSONALIZATIONS)}")
    device = Device.resolve(cfg.device)
    torch.manual_seed(seed)
    loss_of = _dice_batch_loss(cfg.loss)
    # the global model steps exactly as FedAvg's does (its learner: fused Adam, the same loss), so FedSM's
    # global model stays FedAvg's whatever the personalization rule (engine.fl.methods.contract._fedavg_seed)
    glob = _segmentation_learner(task, weights["global"], cfg.lr, device)
    sel = _selector_learner(task, weights["selector"], num_sites, cfg, device) if train_selector else None
    small = selector_inputs(data.images, cfg.selector_size) if train_selector else None

    second: torch.nn.Module | None = None  # v (APFL), theta meta (Per-FedAvg), w_loc (pFedMe)
    theta: torch.nn.Module | None = None  # pFedMe's personalized model
    if kind == "apfl":
        second = _seg_net(task, site_state.get(APFL_V, weights["global"]), device)
        _keep_apfl_alpha(site_state, apfl_alpha_of(site_state, pcfg.apfl_alpha))
    elif kind in ("perfedavg", "pfedme"):
        second = _seg_net(task, weights["personal"], device)
    if kind == "pfedme":
        theta = _seg_net(task, weights["personal"], device)  # reset to the received model every round
    second_opt: torch.optim.Optimizer | None = None
    if kind == "apfl" and second is not None:
        second_opt = (torch.optim.SGD(second.parameters(), lr=pcfg.apfl_v_lr) if pcfg.apfl_v_optimizer == "sgd"
                      else _adam(second, cfg.lr))
    elif (kind == "perfedavg" or (kind == "pfedme" and pcfg.pfedme_outer == "adam")) and second is not None:
        second_opt = _adam(second, cfg.lr)
    theta_opt = _adam(theta, cfg.lr) if theta is not None else None

    batches = batch_order(len(data.images), cfg.batch_size, cfg.epochs, seed)
    # Per-FedAvg's D' comes from a second, independently shuffled pass over the site's data
    other = batch_order(len(data.images), cfg.batch_size, cfg.epochs, seed + 1) if kind == "perfedavg" else []
    sums: dict[str, float] = {}
    for i, idx in enumerate(batches, start=1):
        ctx.check_cancel()
        x = _to_device(data.images, idx, device)
        y = _to_device(data.masks, idx, device)
        losses: dict[str, float] = {}
        if kind == "apfl":
            assert second is not None and second_opt is not None
            alpha = apfl_alpha_of(site_state, pcfg.apfl_alpha)
            v_now = {n: p.detach() for n, p in second.named_parameters()}
            w_now = {n: p.detach() for n, p in glob.net.named_parameters()}
            mixed = {n: (alpha * v_now[n] + (1 - alpha) * w_now[n]).requires_grad_() for n in v_now}
            loss_mix = loss_of(lambda inp, mixed=mixed: functional_call(second, mixed, (inp,)), (x, y))
            grads = dict(zip(mixed, torch.autograd.grad(loss_mix, list(mixed.values())), strict=True))
            grad_v, grad_alpha = apfl_gradients(v_now, w_now, alpha, grads)
            second_opt.zero_grad(set_to_none=True)
            _set_grads(second, grad_v)
            second_opt.step()
            _keep_apfl_alpha(site_state, apfl_alpha_step(alpha, grad_alpha, pcfg.apfl_alpha_lr))
            losses["personal"] = float(loss_mix.detach())
        elif kind == "perfedavg":
            assert second is not None and second_opt is not None
            a, b = per_fedavg_batches(idx, other[i - 1])
            batch_a = (_to_device(data.images, a, device), _to_device(data.masks, a, device))
            batch_b = (_to_device(data.images, b, device), _to_device(data.masks, b, device))
            meta = first_order_maml_gradient(second, loss_of, batch_a, batch_b, pcfg.inner_lr)
            second_opt.zero_grad(set_to_none=True)
            _set_grads(second, meta)
            second_opt.step()
            with torch.no_grad():
                losses["personal"] = float(loss_of(second, (x, y)))
        elif kind == "pfedme":
            assert second is not None and theta is not None and theta_opt is not None
            w_loc = {n: p.detach().clone() for n, p in second.named_parameters()}
            for _ in range(pcfg.pfedme_inner_steps):
                theta_opt.zero_grad(set_to_none=True)
                fit = loss_of(theta, (x, y))
                pfedme_objective(theta, fit, w_loc, pcfg.pfedme_lam).backward()
                theta_opt.step()
            theta_now = {n: p.detach() for n, p in theta.named_parameters()}
            if second_opt is not None:  # "adam": a step along the envelope's gradient
                second_opt.zero_grad(set_to_none=True)
                _set_grads(second, pfedme_envelope_gradient(w_loc, theta_now, pcfg.pfedme_lam))
                second_opt.step()
            else:
                new_w = pfedme_local_update(w_loc, theta_now, pcfg.pfedme_lam, pcfg.pfedme_eta)
                with torch.no_grad():
                    for n, p in second.named_parameters():
                        p.copy_(new_w[n])
            losses["personal"] = float(fit.detach())
        losses["global"] = glob.step(lambda net, x=x, y=y: loss_of(net, (x, y)))
        if sel is not None:
            xs = _to_device(small, idx, device)
            label = torch.full((len(idx),), site_index, dtype=torch.long, device=device.torch_device)
            losses["selector"] = sel.step(lambda net, xs=xs, label=label: F.cross_entropy(net(xs), label))
        for k, v in losses.items():
            sums[k] = sums.get(k, 0.0) + v
        ctx.report(i, len(batches), losses)

    parts: dict[str, Weights] = {"global": _net_weights(glob.net)}
    if sel is not None:
        parts["selector"] = clone_weights(sel.net.state_dict())
    if kind == "apfl":
        assert second is not None
        site_state[APFL_V] = _net_weights(second)
    elif kind in ("perfedavg", "pfedme"):
        assert second is not None
        parts["personal"] = _net_weights(second)
    if theta is not None:
        site_state["pfedme_theta"] = _net_weights(theta)
    n = max(len(batches), 1)
    metrics = {f"loss_{k}": v / n for k, v in sums.items()} | {"steps": float(len(batches))}
    if kind == "apfl":
        metrics["apfl_alpha"] = apfl_alpha_of(site_state, pcfg.apfl_alpha)
    return parts, metrics


def personalized_model(
    kind: str,
    task: TaskSpec,
    weights: Mapping[str, Mapping[str, torch.Tensor]],
    data: SplitArrays,
    cfg: LocalTrainingConfig,
    pcfg: PersonalizationConfig,
    site_state: dict[str, Any],
    seed: int,
    ctx: RoundContext,
) -> Weights:
    """The site's final personalized model, built in the calibration round.

    ``weights`` holds the final ``global`` model (and the final shared ``personal`` model for
    ``perfedavg``).
    """
    if kind == "apfl":
        built = apfl_model_now(site_state, weights["global"], pcfg.apfl_alpha)
        # the site missed every training round: no private model, the global model in its place
        return clone_weights(weights["global"]) if built is None else built
    if kind == "pfedme":
        return clone_weights(site_state.get("pfedme_theta", weights["global"]))
    device = Device.resolve(cfg.device)
    torch.manual_seed(seed)
    loss_of = _dice_batch_loss(cfg.loss)
    if kind == "finetune":
        net = _seg_net(task, weights["global"], device)
        opt = _adam(net, cfg.lr)
        batches = batch_order(len(data.images), cfg.batch_size, pcfg.finetune_epochs, seed)
        for i, idx in enumerate(batches, start=1):
            ctx.check_cancel()
            opt.zero_grad(set_to_none=True)
            loss = loss_of(net, (_to_device(data.images, idx, device), _to_device(data.masks, idx, device)))
            loss.backward()
            opt.step()
            ctx.report(i, len(batches), {"finetune": float(loss.detach())})
        return _net_weights(net)
    if kind == "perfedavg":
        net = _seg_net(task, weights["personal"], device)
        batches = batch_order(len(data.images), cfg.batch_size, 1, seed)
        for _ in range(pcfg.adapt_steps):
            grads = [torch.zeros_like(p) for p in net.parameters()]
            for idx in batches:
                ctx.check_cancel()
                loss = loss_of(net, (_to_device(data.images, idx, device), _to_device(data.masks, idx, device)))
                for acc, g in zip(grads, torch.autograd.grad(loss, list(net.parameters())), strict=True):
                    acc += g / len(batches)
            with torch.no_grad():
                for p, g in zip(net.parameters(), grads, strict=True):
                    p -= pcfg.inner_lr * g
        return _net_weights(net)
    raise ConfigError(f"unknown personalization {kind!r}; choose from {', '.join(PERSONALIZATIONS)}")
