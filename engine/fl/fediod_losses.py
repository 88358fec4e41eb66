"""FedIOD's coordinator losses, written for sigmoid (multi-label) segmentation.

FedIOD (Gong et al., AAAI 2024) was written for softmax classifiers. Every network here
outputs one *independent* sigmoid logit map per structure (see :mod:`engine.tasks`), so each
pixel and label is a Bernoulli variable ``q = sigmoid(z)`` and the paper's categorical terms
become their Bernoulli counterparts, averaged over batch, labels and pixels:

- consensus (Eq. 3): entropy of each teacher's prediction, ``sum_k w_k mean H(q_k)``;
- uniqueness (Eqs. 4-5): the weighted Jensen-Shannon divergence across sites,
  ``H(sum_k w_k q_k) - sum_k w_k H(q_k)``;
- importance weights (Eqs. 8-10): per pixel and label, a site's share of the federation's
  foreground (or background) pixels of that label, mixed by how likely the pixel is
  foreground: ``pi_k(x) = qbar * fg_k + (1 - qbar) * bg_k`` with ``fg_k = n_k f_k / sum_j n_j f_j``
  (``f_k`` = the site's per-label foreground pixel frequency, the "class statistics" of a
  segmentation site) and ``sum_k pi_k(x) = 1`` at every pixel;
- mimic (Eq. 10): mean squared difference between the student's logits and the
  importance-weighted ensemble ``A = sum_k pi_k(x) * z_k``;
- balance: Bernoulli KL from the federation's label frequency to the batch-mean ensemble
  probability (the segmentation form of the authors' class-balance term, which keeps the
  generator from collapsing to all-background images);
- adversarial (Eq. 2 from the generator's side): ``sum_k w_k BCE(D_k(x), 1)``.

Every function is a plain torch expression, so the coordinator differentiates through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import WeightsError

#: Probabilities are clamped to [EPS, 1 - EPS] before a logarithm.
EPS = 1e-6


def bernoulli_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``Bernoulli(sigmoid(logits))``, element-wise and stable for large logits."""
    q = torch.sigmoid(logits)
    return q * F.softplus(-logits) + (1.0 - q) * F.softplus(logits)


def bernoulli_entropy(q: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``Bernoulli(q)``, element-wise (``q`` clamped to [EPS, 1 - EPS])."""
    q = q.clamp(EPS, 1.0 - EPS)
    return -(q * torch.log(q) + (1.0 - q) * torch.log1p(-q))


def _check_site_weights(stacked: torch.Tensor, site_weights: torch.Tensor) -> torch.Tensor:
    if site_weights.ndim != 1 or site_weights.shape[0] != stacked.shape[0]:
        raise WeightsError(f"site weights of shape {tuple(site_weights.shape)} do not match "
                           f"{stacked.shape[0]} sites")
    return site_weights.to(stacked.dtype).view(-1, *([1] * (stacked.ndim - 1)))


def consensus_loss(logits: torch.Tensor, site_weights: torch.Tensor) -> torch.Tensor:
    """Eq. 3: site-weighted mean entropy of every teacher's prediction.

    Parameters
    ----------
    logits
        ``(K, B, L, H, W)`` teachers' logits.
    site_weights
        ``(K,)`` weights summing to 1 (site sizes ``n_k / n``).
    """
    w = _check_site_weights(logits, site_weights)
    return (w * bernoulli_entropy_from_logits(logits)).sum(0).mean()


def jensen_shannon(probabilities: torch.Tensor, site_weights: torch.Tensor) -> torch.Tensor:
    """Eqs. 4-5: weighted Jensen-Shannon divergence across sites, mean over pixels and labels.

    ``JSD = H(sum_k w_k q_k) - sum_k w_k H(q_k)``, which equals ``sum_k w_k KL(q_k || m)``
    with the mixture ``m``; 0 when all sites agree, at most ``ln 2`` per pixel for two sites.

    Parameters
    ----------
    probabilities
        ``(K, B, L, H, W)`` Bernoulli probabilities ``q_k = sigmoid(z_k)``.
    site_weights
        ``(K,)`` weights summing to 1.
    """
    w = _check_site_weights(probabilities, site_weights)
    mixture = (w * probabilities).sum(0)
    return (bernoulli_entropy(mixture) - (w * bernoulli_entropy(probabilities)).sum(0)).mean()


def class_weights(num_samples: torch.Tensor, label_frequency: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each site's share of the federation's foreground and background pixels, per label.

    Parameters
    ----------
    num_samples
        ``(K,)`` training images per site.
    label_frequency
        ``(K, L)`` fraction of a site's pixels that are foreground of label ``l``.

    Returns
    -------
    fg, bg
        ``(K, L)`` each, columns summing to 1. A label with no foreground (or no background)
        pixel anywhere falls back to the site sizes' shares.
    """
    n = num_samples.to(torch.float64).view(-1, 1)
    f = label_frequency.to(torch.float64)
    if n.shape[0] != f.shape[0] or (n < 0).any() or (f < 0).any() or (f > 1).any():
        raise WeightsError(f"class statistics do not fit: {n.shape[0]} site sizes, label frequencies "
                           f"{tuple(f.shape)} must lie in [0, 1]")
    sizes = n / n.sum().clamp_min(1e-12)

    def share(counts: torch.Tensor) -> torch.Tensor:
        total = counts.sum(0, keepdim=True)
        return torch.where(total > 0, counts / total.clamp_min(1e-300), sizes.expand_as(counts))

    return share(n * f), share(n * (1.0 - f))


def importance_weights(probabilities: torch.Tensor, site_weights: torch.Tensor, fg: torch.Tensor,
                       bg: torch.Tensor) -> torch.Tensor:
    """Eqs. 8-9: per-pixel importance ``pi_k(x)`` of each site's answer.

    ``pi_k(x) = qbar * fg_k + (1 - qbar) * bg_k`` where ``qbar = sum_k w_k q_k`` (detached)
    is the site-weighted probability that the pixel is foreground of the label.

    Returns
    -------
    torch.Tensor
        ``(K, B, L, H, W)``, summing to 1 over sites at every pixel and label.
    """
    w = _check_site_weights(probabilities, site_weights)
    qbar = (w * probabilities.detach()).sum(0, keepdim=True)
    shape = (fg.shape[0], 1, fg.shape[1], 1, 1)
    fg_ = fg.to(probabilities.dtype).view(shape)
    bg_ = bg.to(probabilities.dtype).view(shape)
    return qbar * fg_ + (1.0 - qbar) * bg_


def ensemble_logits(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Eq. 10's target ``A = sum_k pi_k(x) * z_k`` (``(B, L, H, W)``)."""
    return (weights * logits).sum(0)


def mimic_loss(student_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Eq. 10: mean squared difference between the student's logits and the ensemble's."""
    return ((student_logits - target) ** 2).mean()


def balance_loss(ensemble_probability: torch.Tensor, label_frequency: torch.Tensor) -> torch.Tensor:
    """Bernoulli KL from the federation's per-label frequency to the batch-mean ensemble probability.

    Parameters
    ----------
    ensemble_probability
        ``(B, L, H, W)`` the ensemble's foreground probability.
    label_frequency
        ``(L,)`` federation-wide foreground frequency per label.
    """
    p = ensemble_probability.mean(dim=(0, 2, 3)).clamp(EPS, 1.0 - EPS)
    f = label_frequency.to(p.dtype).clamp(EPS, 1.0 - EPS)
    return (f * torch.log(f / p) + (1.0 - f) * torch.log((1.0 - f) / (1.0 - p))).sum()


def generator_gan_loss(scores: list[torch.Tensor], site_weights: torch.Tensor) -> torch.Tensor:
    """The generator's side of Eq. 2: ``sum_k w_k BCE(D_k(x), real)`` over the sites' discriminator scores."""
    if len(scores) != site_weights.shape[0]:
        raise WeightsError(f"{len(scores)} discriminator scores for {site_weights.shape[0]} site weights")
    terms = [F.binary_cross_entropy_with_logits(s, torch.ones_like(s)) for s in scores]
    return (site_weights.to(terms[0].dtype) * torch.stack(terms)).sum()


def discriminator_loss(real_scores: torch.Tensor, fake_scores: torch.Tensor) -> torch.Tensor:
    """Eq. 2 at a site: BCE of real local images against 1 plus generated images against 0, halved."""
    return 0.5 * (F.binary_cross_entropy_with_logits(real_scores, torch.ones_like(real_scores))
                  + F.binary_cross_entropy_with_logits(fake_scores, torch.zeros_like(fake_scores)))
