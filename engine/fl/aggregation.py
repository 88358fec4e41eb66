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


def fedprox_penalty(model: torch.nn.Module, anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal term ``mu/2 * ||w - w_round||^2`` over the trainable parameters.

    Its gradient with respect to each parameter is ``mu * (w - w_round)``.
    """
    total = torch.zeros((), device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        if param.requires_grad:
            total = total + (param - anchor[name]).pow(2).sum()
    return 0.5 * mu * total


def scaffold_site_control(site_control: Mapping[str, torch.Tensor], server_control: Mapping[str, torch.Tensor],
                          round_start: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor],
                          steps: int, lr: float) -> Weights:
    """Scaffold's site control variate update (option II of Karimireddy et al., 2020).

    ``c_k+ = c_k - c + (x - y_k) / (steps * lr)``, with ``x`` the weights received this round
    and ``y_k`` the weights after ``steps`` local steps of learning rate ``lr``.
    """
    if steps <= 0 or lr <= 0:
        raise ConfigError(f"Scaffold needs steps > 0 and lr > 0, got steps={steps}, lr={lr}")
    scale = 1.0 / (steps * lr)
    return {
        k: site_control[k] - server_control[k] + (round_start[k] - trained[k]) * scale
        for k in site_control
    }


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
