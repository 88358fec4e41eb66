"""Server-side aggregation rules of FedAvg, SoftPull, Scaffold, and FedProx's site term.

Pure functions over weight dicts, tested against hand-computed values; no I/O, no transport.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.errors import ConfigError, WeightsError
from engine.fl.weights import Weights, weighted_sum


def fedavg(updates: Sequence[tuple[Mapping[str, torch.Tensor], int]]) -> Weights:
    """FedAvg: ``w = sum_k (n_k / n) w_k`` over the responding sites.

    Parameters
    ----------
    updates
        ``(weights, n_k)`` per responding site, ``n_k`` = number of training samples.
    """
    if not updates:
        raise WeightsError("FedAvg needs at least one site update")
    total = sum(int(n) for _, n in updates)
    if total <= 0:
        raise WeightsError("FedAvg: the responding sites reported no training samples")
    return weighted_sum([(w, int(n) / total) for w, n in updates])


def check_lam(lam: float, num_sites: int) -> None:
    """Raise :class:`ConfigError` unless ``1/num_sites <= lam <= 1``."""
    if not (1.0 / num_sites - 1e-12 <= lam <= 1.0):
        raise ConfigError(
            f"SoftPull lam={lam} is outside [1/K, 1] = [{1.0 / num_sites:.3f}, 1] for K={num_sites} sites; "
            "1/K is plain averaging, 1 is local training (paper's best: 0.7 fundus, 0.3 prostate)"
        )


def soft_pull(personal: Mapping[str, Mapping[str, torch.Tensor]], lam: float) -> dict[str, Weights]:
    """SoftPull: ``w_k <- lam w_k + (1 - lam)/(K - 1) sum_{k' != k} w_k'``.

    ``K`` is the number of models given, i.e. the sites that responded this round: a site that
    did not respond neither pulls nor is pulled. With a single model there is nothing to pull
    towards and the model is returned unchanged (the reference implementation returns
    ``lam * w``, which shrinks the weights; that is a bug we do not copy).
    """
    names = list(personal)
    if not names:
        raise WeightsError("SoftPull needs at least one personalized model")
    if not 0.0 <= lam <= 1.0:
        raise ConfigError(f"SoftPull lam={lam} must lie in [0, 1]")
    if len(names) == 1:
        only = names[0]
        return {only: {k: v.clone() for k, v in personal[only].items()}}
    other = (1.0 - lam) / (len(names) - 1)
    return {
        name: weighted_sum([(personal[peer], lam if peer == name else other) for peer in names])
        for name in names
    }


def proximal_penalty(model: torch.nn.Module, anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal term ``mu/2 * ||w - w_round||^2`` over the trainable parameters.

    Its gradient with respect to each parameter is ``mu * (w - w_round)``.
    """
    total = torch.zeros((), device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        if param.requires_grad:
            total = total + (param - anchor[name]).pow(2).sum()
    return 0.5 * mu * total


def scaffold_site_control(gradient_sum: Mapping[str, torch.Tensor], batches: int,
                          site_control: Mapping[str, torch.Tensor]) -> Weights:
    """Scaffold's new site control variate: the mean of the round's uncorrected minibatch gradients.

    ``c_k+ = (1/B) sum_b g_b``, where ``g_b`` is the gradient of the site's loss on minibatch
    ``b`` at the weights of step ``b``, taken *before* ``c - c_k`` is added, and ``B`` the number
    of steps it was summed over. This is option I of Karimireddy et al. (2020) (a gradient of the
    site's loss), with the gradient averaged along the round instead of evaluated once more at
    the received weights, so it costs nothing extra. Option II,
    ``c_k - c + (x - y_k) / (steps * lr)``, assumes plain SGD steps ``y <- y - lr (g + c - c_k)``;
    with Adam the weight change is not ``lr`` times the summed gradients (each Adam step moves
    about ``lr`` per coordinate whatever the gradient's size), so option II gives a control
    variate of order 1 per coordinate that swamps the gradients it should correct.

    Parameters
    ----------
    gradient_sum
        Sum over the round's steps of the uncorrected gradient, per parameter (see
        :class:`engine.fl.local_training.ScaffoldGradients`).
    batches
        Number of steps summed. ``0`` (no usable gradient this round) keeps ``site_control``.
    site_control
        The site's current ``c_k``; gives the parameter names, and the result when ``batches == 0``.
    """
    if batches < 0:
        raise ConfigError(f"Scaffold: the number of summed gradients must be >= 0, got {batches}")
    if set(gradient_sum) != set(site_control):
        raise WeightsError(
            f"Scaffold: gradient sum has parameters {sorted(set(gradient_sum) ^ set(site_control))} that the "
            "control variate lacks, or the reverse")
    if batches == 0:
        return {k: v.clone() for k, v in site_control.items()}
    return {k: (gradient_sum[k] / batches).to(site_control[k].dtype) for k in site_control}


def scaffold_server_update(server_control: Mapping[str, torch.Tensor],
                           control_deltas: Sequence[Mapping[str, torch.Tensor]],
                           num_sites: int) -> Weights:
    """Scaffold's server control update ``c <- c + (1/N) sum_{k in S} (c_k+ - c_k)``.

    ``num_sites`` is N, all sites of the federation; ``control_deltas`` come from the |S|
    sites that responded.
    """
    if num_sites <= 0:
        raise ConfigError("Scaffold needs at least one site")
    terms = [(server_control, 1.0)] + [(d, 1.0 / num_sites) for d in control_deltas]
    return weighted_sum(terms)
