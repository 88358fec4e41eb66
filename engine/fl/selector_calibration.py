"""Federated calibration of the model selector's last layer from class feature statistics.

Why: each site's selector data has a single label (its own site index), so the selector's
decision layer, trained locally and averaged by FedAvg, drifts toward "always my site"; on
our synthetic federations a plainly trained selector routed every image to one site. The
backbone's features still separate the sites well. After the last training round each site
therefore sends sufficient statistics of the selector's penultimate features (per-class count
and sum, and the total of outer products: a few hundred KB, no images, no per-image values),
and the server solves linear discriminant analysis in closed form for the last layer (the idea
of classifier calibration from client feature statistics, as in CCVR, Luo et al. 2021).
No training happens on the server and no drift is possible: the result is the same LDA a
single site holding everyone's features would compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.errors import WeightsError
from engine.fl.weights import Weights
from engine.models.selector import ModelSelector

#: Keys of the selector's final linear layer (``classifier[-1]`` of the pooled head).
STAT_KEYS = ("count", "sum", "outer")


def final_layer_keys(selector: ModelSelector) -> tuple[str, str]:
    """State-dict keys (weight, bias) of the selector's last linear layer."""
    index = len(selector.classifier) - 1
    return f"classifier.{index}.weight", f"classifier.{index}.bias"


def penultimate_features(selector: ModelSelector, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Inputs of the selector's last linear layer, float64 ``(N, D)``."""
    selector.eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size]
            h = selector.classifier[:-1](selector.pool(selector.features(x)))
            out.append(h.double().cpu())
    return torch.cat(out) if out else torch.zeros((0, selector.classifier[-1].in_features), dtype=torch.float64)


def class_statistics(features: torch.Tensor, labels: np.ndarray, num_classes: int) -> Weights:
    """Sufficient statistics of ``features`` grouped by ``labels``.

    Returns
    -------
    dict
        ``count (C,)``, ``sum (C, D)`` and ``outer (D, D)`` = sum of ``f f^T`` over all
        samples, float64. Statistics of several sites add up key by key.
    """
    feats = features.to(torch.float64)
    lab = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    count = torch.bincount(lab, minlength=num_classes).to(torch.float64)
    sums = torch.zeros((num_classes, feats.shape[1]), dtype=torch.float64)
    sums.index_add_(0, lab, feats)
    return {"count": count, "sum": sums, "outer": feats.T @ feats}


def add_statistics(stats: Sequence[Mapping[str, torch.Tensor]]) -> Weights:
    """Key-by-key sum of several sites' statistics."""
    if not stats:
        raise WeightsError("no selector statistics arrived; at least one site must answer the calibration round")
    return {k: sum((s[k] for s in stats[1:]), stats[0][k].clone()) for k in STAT_KEYS}


def fit_lda(stats: Mapping[str, torch.Tensor], shrinkage: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear discriminant analysis with a shared, shrunk covariance and uniform class priors.

    ``score_c(f) = f^T S^-1 mu_c - mu_c^T S^-1 mu_c / 2``; softmax of the scores is the posterior
    of equal-covariance Gaussian classes. Uniform priors, because a small site's images must
    not be routed away from its model just because the site is small. A class with no samples
    anywhere gets a score far below the others, so it is never chosen.

    Returns
    -------
    weight, bias
        ``(C, D)`` and ``(C,)`` float64.
    """
    count, sums, outer = stats["count"], stats["sum"], stats["outer"]
    n = float(count.sum())
    present = count > 0
    k = int(present.sum())
    if k == 0:
        raise WeightsError("selector statistics hold no samples")
    dim = outer.shape[0]
    means = torch.zeros_like(sums)
    means[present] = sums[present] / count[present, None]
    between = (sums[present].T / count[present]) @ sums[present]  # sum_c n_c mu_c mu_c^T
    scatter = outer - between
    cov = scatter / max(n - k, 1.0)
    scale = float(torch.trace(cov)) / dim if dim else 1.0
    cov = (1.0 - shrinkage) * cov + shrinkage * max(scale, 1e-12) * torch.eye(dim, dtype=torch.float64)
    precision_means = torch.linalg.solve(cov, means.T).T  # S^-1 mu_c, (C, D)
    bias = -0.5 * (precision_means * means).sum(1)
    if not bool(present.all()):
        lowest = float(bias[present].min()) if k else 0.0
        bias[~present] = lowest - 1e4
        precision_means[~present] = 0.0
    return precision_means, bias


def calibrated_selector(selector_weights: Mapping[str, torch.Tensor], stats: Mapping[str, torch.Tensor],
                        weight_key: str, bias_key: str, shrinkage: float = 0.1) -> Weights:
    """Copy of ``selector_weights`` whose last layer is the LDA fitted on ``stats``."""
    weight, bias = fit_lda(stats, shrinkage)
    out = dict(selector_weights)
    ref_w, ref_b = selector_weights[weight_key], selector_weights[bias_key]
    if tuple(weight.shape) != tuple(ref_w.shape):
        raise WeightsError(f"selector statistics give a {tuple(weight.shape)} layer, the selector has "
                           f"{tuple(ref_w.shape)}")
    out[weight_key] = weight.to(ref_w.dtype)
    out[bias_key] = bias.to(ref_b.dtype)
    return out
