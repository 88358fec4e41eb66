"""Site-style gate: does an image look like ANY participating site's images at all?

FedSM's selector is a K-way classifier; trained by the reference scheme it is unsure of an unseen
site's images on some data (fundus) but sure of them on other data (a GroupNorm selector, or
prostate with batch statistics: docs/results.md, "Selector (leave-one-site-out)"). A classifier
trained on K sites has no notion of "none of them". This gate adds one, from statistics a
federation can aggregate (no image and no per-image value leaves a site):

1. **Descriptor** (``intensity-v2``). Each image (at the U-Nets' input size, after the task's
   normalisation) is described by the acquisition-style statistics that distinguish scanners,
   cameras and protocols: per channel the mean, standard deviation, the 5/25/50/75/95% intensity
   quantiles, the mean absolute horizontal and vertical intensity step, the means of a 3 x 3 grid
   of regions (bias field, vignetting, field of view), the 50/90/99% gradient-magnitude quantiles
   (edge sharpness) and the median absolute Laplacian (noise). 22 numbers per channel: 66 for a
   fundus photo, 22 for an MRI slice. (``intensity-v1``, the first 9 per channel, is still read
   from older bundles; it left an unseen prostate site inside the gate on most seeds.)
2. **Model.** Each site sends, every training round, the count, sum and sum of outer products
   of its training images' descriptors (``d + d*d + 1`` numbers; 35 KB for fundus). The server
   fits one Gaussian per site: the site's mean and the within-site covariance pooled over sites
   (as LDA pools it), shrunk towards a scaled identity (:data:`SHRINKAGE`) because sites hold
   tens of images and a descriptor has up to 27 dimensions.
3. **Threshold.** In the last (calibration) round each site receives the fitted means and
   precision (and the pooled degrees of freedom and shrinkage, :data:`SITE_GATE_KEYS`), computes
   the squared Mahalanobis distance to the nearest site mean of every image the gate has not
   seen (:func:`calibration_distances`): its validation images, and each of its training cases
   under the gate refitted without that case (leave-one-case-out, at the site), scaled by the
   predictive factor ``(m^2 - 1) / m^2`` of a mean from ``m`` rather than ``m - 1`` cases. It
   sends a histogram of those distances (:data:`DISTANCE_EDGES`, log-spaced). The server reads
   from each site's histogram a bound a new image of the site stays below with probability
   ``quantile`` (default 0.95): the ``ceil(quantile * (n + 1))``-th smallest of its ``n``
   distances (split conformal), or :data:`SITE_MARGIN` times the largest where ``n`` is too small
   (:func:`site_threshold`), and sets the threshold at their median over sites
   (:func:`threshold_from_histograms`): robust to one site whose few validation images lie far
   from every training image. With a handful of cases per site the training cases' in-gate
   distances say nothing of a new case (a mean and a covariance fitted to them); their
   leave-one-case-out distances do, and they multiply the samples the threshold is read from
   (docs/results.md, "The gate on real photos and few cases").
4. **Routing.** At inference an image whose distance exceeds the threshold goes to the global
   model whatever the selector says (the reason says so); the others are routed by Algorithm 2,
   or by their nearest site with style routing (:func:`route_by_style`).

Measured in docs/results.md ("Site-style gate"). Not in the FedSM paper; the field's feature-
distance OOD score (Lee et al., NeurIPS 2018) on hand-built style features instead of a network's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.errors import ConfigError
from engine.fl.cases import case_mean_rows, case_means
from engine.fl.routing_choice import AUTO, chosen_rule
from engine.models.style_gate_format import (
    DESCRIPTOR,
    GRADIENT_QUANTILES,
    GRID,
    QUANTILES,
    SITE_ROUTINGS,
    check_quantile,
    descriptor_size,
    per_channel,
)

log = logging.getLogger(__name__)

#: A site with too few distances for a conformal bound gets this factor times its largest
#: (:func:`site_threshold`); the threshold is the median over sites (:func:`threshold_from_histograms`).
SITE_MARGIN = 1.25

#: Shrinkage of the pooled covariance towards ``trace / d * I`` (0: none, 1: identity-scaled).
SHRINKAGE = 0.1

#: Default share of participating validation images the threshold lets through.
DEFAULT_QUANTILE = 0.95

#: Upper edges of the distance histogram (squared Mahalanobis distance; log-spaced, 2.3% wide);
#: one more bin collects everything above the last edge.
DISTANCE_EDGES: np.ndarray = np.logspace(-2, 6, 801)

#: Parts of the server's fitted gate a site receives in the last round: what it needs to score its
#: images (``means``, ``precision``, ``sites``) and to refit the gate without one of its training
#: cases (``dof``: the pooled within-site degrees of freedom, ``shrinkage``).
SITE_GATE_KEYS = ("means", "precision", "sites", "dof", "shrinkage")

#: Server-state and payload part names.
STATS_PART = "style_stats"
GATE_PART = "style_gate"
HIST_PART = "style_hist"


def style_descriptors(images: np.ndarray, layout: str = DESCRIPTOR) -> np.ndarray:
    """Acquisition-style descriptor of each image: ``float64 (N, PER_CHANNEL[layout] * C)``.

    Parameters
    ----------
    images
        ``(N, C, H, W)`` normalised images, all at one size (the U-Nets' input size; ``intensity-v2``
        needs at least 3 x 3 pixels).
    layout
        A key of :data:`PER_CHANNEL`; values are grouped per channel.
    """
    per = per_channel(layout)
    x = np.asarray(images, dtype=np.float64)
    if x.ndim != 4:
        raise ConfigError(f"style descriptors need (N, C, H, W) images, got shape {x.shape}")
    n, c, h, w = x.shape
    if n == 0:
        return np.zeros((0, per * c))
    flat = x.reshape(n, c, -1)
    quant = np.quantile(flat, QUANTILES, axis=2).transpose(1, 2, 0)  # (N, C, Q)
    dx, dy = np.diff(x, axis=3), np.diff(x, axis=2)
    step_x = np.abs(dx).reshape(n, c, -1).mean(2) if w > 1 else np.zeros((n, c))
    step_y = np.abs(dy).reshape(n, c, -1).mean(2) if h > 1 else np.zeros((n, c))
    parts = [flat.mean(2)[..., None], flat.std(2)[..., None], quant, step_x[..., None], step_y[..., None]]
    if layout == "intensity-v2":
        if h < GRID or w < GRID:
            raise ConfigError(f"the {layout} style descriptor needs images of at least {GRID} x {GRID} pixels, "
                              f"got {h} x {w}")
        rows, cols = np.array_split(np.arange(h), GRID), np.array_split(np.arange(w), GRID)
        regions = np.stack([x[:, :, r][:, :, :, k].mean((2, 3)) for r in rows for k in cols], axis=2)
        grad = np.sqrt(dx[:, :, :-1, :] ** 2 + dy[:, :, :, :-1] ** 2).reshape(n, c, -1)  # forward differences
        grad_q = np.quantile(grad, GRADIENT_QUANTILES, axis=2).transpose(1, 2, 0)
        lap = (4 * x[:, :, 1:-1, 1:-1] - x[:, :, :-2, 1:-1] - x[:, :, 2:, 1:-1]
               - x[:, :, 1:-1, :-2] - x[:, :, 1:-1, 2:])
        noise = np.median(np.abs(lap).reshape(n, c, -1), axis=2)  # robust: edges are a minority of pixels
        parts += [regions, grad_q, noise[..., None]]
    return np.concatenate(parts, axis=2).reshape(n, -1)


def style_statistics(images: np.ndarray) -> dict[str, torch.Tensor]:
    """A site's descriptor sums: ``count (1,)``, ``sum (d,)``, ``outer (d, d)``, float64."""
    f = style_descriptors(images)
    return {"count": torch.tensor([float(len(f))], dtype=torch.float64),
            "sum": torch.from_numpy(f.sum(0)),
            "outer": torch.from_numpy(f.T @ f)}


def check_style_statistics(stats: Mapping[str, torch.Tensor], channels: int, what: str) -> None:
    """Reject descriptor sums of the wrong keys, shapes, dtypes or with non-finite values."""
    d = descriptor_size(channels)
    shapes = {"count": (1,), "sum": (d,), "outer": (d, d)}
    if set(stats) != set(shapes):
        raise ConfigError(f"{what} has keys {sorted(stats)}, expected {sorted(shapes)}")
    for key, shape in shapes.items():
        t = stats[key]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_floating_point():
            raise ConfigError(f"{what}: {key} must be a float tensor of shape {shape}")
        if not torch.isfinite(t).all():
            raise ConfigError(f"{what}: {key} holds NaN or infinite values")
    count = float(stats["count"][0])
    if count < 1 or count != int(count):
        raise ConfigError(f"{what}: count must be a whole number >= 1, got {count:g}")
    # sums of real descriptors give a positive semi-definite scatter matrix; anything else is forged
    mean = stats["sum"].double() / count
    scatter = stats["outer"].double() - count * torch.outer(mean, mean)
    if not torch.allclose(scatter, scatter.T, rtol=1e-6, atol=1e-6 * (1.0 + float(scatter.abs().max()))):
        raise ConfigError(f"{what}: outer is not symmetric")
    lowest = float(torch.linalg.eigvalsh((scatter + scatter.T) / 2).min())
    if lowest < -1e-6 * (1.0 + float(scatter.abs().max())):
        raise ConfigError(f"{what}: the sums do not come from real images (their scatter has a negative "
                          f"eigenvalue, {lowest:.3g})")


def fit_style_gate(stats: Sequence[Mapping[str, torch.Tensor] | None],
                   shrinkage: float = SHRINKAGE) -> dict[str, torch.Tensor]:
    """Per-site means and the shared shrunk precision from the sites' descriptor sums.

    Parameters
    ----------
    stats
        One entry per site in routing order; ``None`` for a site that has sent none (it is left
        out of the gate: its images then count as unlike every site).

    Returns
    -------
    dict
        ``means (K', d)``, ``precision (d, d)`` and ``sites (K',)`` (routing indices 0-based of the
        sites present), float64 / int64; ``dof (1,)`` (training images less sites: the pooled
        covariance divides by the larger of it and 1) and ``shrinkage (1,)``, with which a site refits
        the gate without one of its cases (:func:`leave_one_case_out_distances`). Empty when no site
        has sent statistics.
    """
    present = [(k, s) for k, s in enumerate(stats) if s is not None]
    if not present:
        return {}
    counts = np.array([float(s["count"][0]) for _, s in present])
    sums = np.stack([s["sum"].double().numpy() for _, s in present])
    outers = np.stack([s["outer"].double().numpy() for _, s in present])
    means = sums / counts[:, None]
    # within-site scatter: sum_k (outer_k - n_k mu_k mu_k^T); pooled over sites like LDA's covariance
    scatter = (outers - counts[:, None, None] * np.einsum("ki,kj->kij", means, means)).sum(0)
    dof = float(counts.sum()) - len(present)
    return {"means": torch.from_numpy(means),
            "precision": torch.from_numpy(_shrunk_precision(scatter, dof, shrinkage)),
            "sites": torch.tensor([k for k, _ in present], dtype=torch.int64),
            "dof": torch.tensor([dof], dtype=torch.float64),
            "shrinkage": torch.tensor([float(shrinkage)], dtype=torch.float64)}


def _shrunk_precision(scatter: np.ndarray, dof: float, shrinkage: float) -> np.ndarray:
    """Inverse of the pooled covariance ``scatter / max(dof, 1)`` shrunk towards ``trace / d * I``."""
    d = scatter.shape[0]
    cov = (scatter + scatter.T) / (2 * max(dof, 1.0))
    scale = max(float(np.trace(cov)) / d, 1e-12)
    precision = np.linalg.inv((1 - shrinkage) * cov + shrinkage * scale * np.eye(d))
    return (precision + precision.T) / 2


def _pooled_scatter(precision: np.ndarray, dof: float, shrinkage: float) -> np.ndarray:
    """The pooled within-site scatter a gate was fitted from, recovered from its precision.

    The shrinkage keeps the trace (``trace(shrunk) = trace(cov)``), so ``cov = (shrunk - shrinkage *
    trace / d * I) / (1 - shrinkage)`` and ``scatter = max(dof, 1) * cov``.
    """
    d = precision.shape[0]
    shrunk = np.linalg.inv(precision)
    shrunk = (shrunk + shrunk.T) / 2
    cov = (shrunk - shrinkage * float(np.trace(shrunk)) / d * np.eye(d)) / (1 - shrinkage)
    return max(dof, 1.0) * cov


def leave_one_case_out_distances(descriptors: np.ndarray, cases: np.ndarray, gate: Mapping[str, object],
                                 site: int) -> np.ndarray:
    """Each training image's distance under the gate refitted without its case, times ``(m^2 - 1) / m^2``.

    Computed at the site from its own descriptors and the gate it received; only a histogram of the
    result leaves it.

    Parameters
    ----------
    descriptors
        ``(N, d)`` descriptors of the site's training images (the images its descriptor sums came from).
    cases
        ``(N,)`` case of each image (all slices of a volume share one); a case is left out whole.
    gate
        ``means``, ``precision``, ``sites`` and, for the refit of the pooled covariance, ``dof`` and
        ``shrinkage`` (:data:`SITE_GATE_KEYS`); without those two only the site's mean is refitted.
    site
        The site's routing index (0-based).

    Returns
    -------
    numpy.ndarray
        ``float64 (N',)``, in the order of ``descriptors``: squared Mahalanobis distance of every
        image of every left-out case to the nearest site mean of the refitted gate (the site's mean
        without the case, the other sites' means as they are, the pooled covariance without the
        case's scatter), scaled by
        ``(m^2 - 1) / m^2`` for a site with ``m`` training cases: a new case's expected distance to
        a mean of ``m`` cases against ``m - 1`` (``1 + 1/m`` against ``1 + 1/(m - 1)``). Empty
        when the site holds fewer than two cases (leaving its only case out leaves it no mean).
        When the gate does not hold the site (it sent no statistics) the gate never saw these
        images, and their plain distances are returned.
    """
    f = np.asarray(descriptors, dtype=np.float64)
    cases = np.asarray(cases)
    if len(cases) != len(f):
        raise ConfigError(f"{len(f)} training descriptors but {len(cases)} case ids")
    sites = np.asarray(_array(gate["sites"]), dtype=np.int64)
    if site not in sites.tolist():
        return style_distances(f, gate)[0]
    ids = np.unique(cases)
    m = len(ids)
    if m < 2:
        return np.zeros(0)
    means = np.asarray(_array(gate["means"]), dtype=np.float64)
    precision = np.asarray(_array(gate["precision"]), dtype=np.float64)
    row = sites.tolist().index(site)
    refit = "dof" in gate and "shrinkage" in gate
    if refit:
        dof = float(np.asarray(_array(gate["dof"]), dtype=np.float64).reshape(-1)[0])
        shrinkage = float(np.asarray(_array(gate["shrinkage"]), dtype=np.float64).reshape(-1)[0])
        refit = shrinkage < 1.0  # a fully shrunk gate does not tell its covariance
    if refit:
        # the pooled scatter less this site's own, which the loop below replaces case by case
        mean = f.mean(0)
        others = _pooled_scatter(precision, dof, shrinkage) - (f - mean).T @ (f - mean)
    n, total, outer = len(f), f.sum(0), f.T @ f
    factor = (m * m - 1.0) / (m * m)
    out = np.empty(n)
    for case in ids:
        held = cases == case
        fc = f[held]
        kept = n - len(fc)
        loo_mean = (total - fc.sum(0)) / kept
        loo_means = means.copy()
        loo_means[row] = loo_mean
        loo_precision = precision
        if refit:
            own = outer - fc.T @ fc - kept * np.outer(loo_mean, loo_mean)
            loo_precision = _shrunk_precision(others + own, dof - len(fc), shrinkage)
        dist, _ = style_distances(fc, {"means": loo_means, "precision": loo_precision, "sites": sites})
        out[held] = factor * dist
    return out


def nearest_sites(matrix: np.ndarray, sites: np.ndarray,
                  cases: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each image's distance to its nearest site and the site's routing index (0-based; -1 without sites).

    ``matrix``: :func:`style_distance_matrix`'s ``(N, K')`` distances and ``sites`` its column sites.
    With ``cases``, every image of a case gets the case's nearest site, the one with the smallest
    mean distance over the case's images (a volume is routed whole); the distances stay each image's own.
    """
    m = np.asarray(matrix, dtype=np.float64)
    if m.shape[1] == 0:
        return np.full(len(m), np.inf), np.full(len(m), -1, dtype=np.int64)
    distance, column = m.min(1), m.argmin(1)
    if cases is not None and len(m):
        column = case_mean_rows(m, cases).argmin(1)
    return distance, np.asarray(sites, dtype=np.int64)[column]


def calibration_distances(gate: Mapping[str, object], site: int, train_images: np.ndarray,
                          train_cases: np.ndarray, validation_images: np.ndarray | None = None,
                          validation_cases: np.ndarray | None = None) -> np.ndarray:
    """The distances a site's last-round histogram counts: every case the gate has not seen.

    The gate judges cases (a volume by its slices' mean distance, a photo by its own: ``unit``
    ``case`` of :data:`~engine.models.style_gate_format.GATE_UNITS`), so these are case means: its
    validation cases' mean distances under ``gate``, and each training case's mean leave-one-case-out
    distance (:func:`leave_one_case_out_distances`). A site without validation images thus sends
    honest distances of its training cases, not their distances to a mean and covariance fitted to
    them (0 for a site with one training image); a site with one training case and no validation
    image sends none (the server leaves it out of the threshold). Judging a volume whole keeps an
    unseen prostate scanner out of the gate on more draws than judging slices (docs/results.md, "A
    volume judged whole").

    Parameters
    ----------
    gate
        The gate the site received (:data:`SITE_GATE_KEYS`).
    site
        The site's routing index (0-based).
    train_images, train_cases
        The site's training images (as its descriptor sums were computed) and their case ids.
    validation_images, validation_cases
        The site's validation images, or ``None`` / empty, and their case ids (``None``: each image a
        case of its own).
    """
    loo = leave_one_case_out_distances(style_descriptors(train_images), train_cases, gate, site)
    parts = [case_means(loo, train_cases) if len(loo) else loo]
    if validation_images is not None and len(validation_images):
        val = style_distances(style_descriptors(validation_images), gate)[0]
        cases = np.arange(len(val)) if validation_cases is None else np.asarray(validation_cases)
        parts.insert(0, case_means(val, cases))
    return np.concatenate(parts)


def style_distances(descriptors: np.ndarray, gate: Mapping[str, object]) -> tuple[np.ndarray, np.ndarray]:
    """Squared Mahalanobis distance to the nearest site mean, and that site's routing index (0-based).

    ``gate`` holds ``means``, ``precision`` and ``sites`` as tensors or nested lists.
    """
    return nearest_sites(*style_distance_matrix(descriptors, gate))


def style_distance_matrix(descriptors: np.ndarray, gate: Mapping[str, object]) -> tuple[np.ndarray, np.ndarray]:
    """Squared Mahalanobis distance of every descriptor to every site mean of ``gate``.

    Returns ``float64 (N, K')`` distances and the ``int64 (K',)`` routing index (0-based) of each
    column's site; ``(N, 0)`` for a gate without means.
    """
    means = np.asarray(_array(gate["means"]), dtype=np.float64)
    precision = np.asarray(_array(gate["precision"]), dtype=np.float64)
    sites = np.asarray(_array(gate["sites"]), dtype=np.int64)
    f = np.asarray(descriptors, dtype=np.float64)
    if len(means) == 0:
        return np.zeros((len(f), 0)), sites
    diff = f[:, None, :] - means[None, :, :]  # (N, K', d)
    return np.einsum("nkd,de,nke->nk", diff, precision, diff), sites


def distance_histogram(distances: np.ndarray) -> dict[str, torch.Tensor]:
    """Counts of ``distances`` per :data:`DISTANCE_EDGES` bin (one more for the overflow): ``{"counts": (B,)}``."""
    d = np.asarray(distances, dtype=np.float64)
    bins = np.searchsorted(DISTANCE_EDGES, d[np.isfinite(d)], side="left")
    counts = np.bincount(bins, minlength=len(DISTANCE_EDGES) + 1).astype(np.float64)
    counts[-1] += float((~np.isfinite(d)).sum())
    return {"counts": torch.from_numpy(counts)}


def check_distance_histogram(hist: Mapping[str, torch.Tensor], what: str) -> None:
    """Reject a distance histogram of the wrong shape or with negative, fractional or non-finite counts."""
    if set(hist) != {"counts"}:
        raise ConfigError(f"{what} has keys {sorted(hist)}, expected ['counts']")
    t = hist["counts"]
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (len(DISTANCE_EDGES) + 1,) or not t.is_floating_point():
        raise ConfigError(f"{what}: counts must be a float tensor of shape ({len(DISTANCE_EDGES) + 1},)")
    if not torch.isfinite(t).all() or (t < 0).any() or (t != t.round()).any():
        raise ConfigError(f"{what}: counts must be finite whole numbers >= 0")


def histogram_quantile(counts: np.ndarray, quantile: float) -> float:
    """Upper edge of the bin where ``counts`` first reach ``quantile`` of its images (``inf``: overflow or empty)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = float(counts.sum())
    if n <= 0:
        return float("inf")
    reach = int(np.searchsorted(np.cumsum(counts), quantile * n - 1e-9, side="left"))
    return float(DISTANCE_EDGES[reach]) if reach < len(DISTANCE_EDGES) else float("inf")


def site_threshold(counts: np.ndarray, quantile: float, margin: float = SITE_MARGIN) -> float:
    """One site's threshold from its distance histogram: a conformal bound, or ``margin`` x its largest.

    With ``n`` distances of images the gate has not seen (:func:`calibration_distances`), a new image
    of the site lies at or below the ``ceil(quantile * (n + 1))``-th smallest of them with
    probability at least ``quantile`` (split conformal prediction; exchangeable distances): the
    upper edge of that distance's bin. Where ``n`` is too small for that rank (fewer than 19 at
    0.95), the largest distance times ``margin``. ``inf`` when that bin is the overflow bin or the
    histogram is empty.
    """
    counts = np.asarray(counts, dtype=np.float64)
    n = float(counts.sum())
    if n <= 0:
        return float("inf")
    rank = math.ceil(quantile * (n + 1) - 1e-9)
    factor = 1.0 if rank <= n else margin
    reach = int(np.searchsorted(np.cumsum(counts), min(rank, n) - 1e-9, side="left"))
    return float(factor * DISTANCE_EDGES[reach]) if reach < len(DISTANCE_EDGES) else float("inf")


def threshold_from_histograms(hists: Sequence[Mapping[str, torch.Tensor]], quantile: float,
                              margin: float = SITE_MARGIN) -> float:
    """The gate's threshold: the median over sites of each site's :func:`site_threshold`.

    Each site's bound is read from its own histogram (sites that sent no distance are left out).
    The median over sites, not one bound of all images together, so that one site whose images lie
    far from every training image (a site with one validation volume, measured on prostate) cannot
    open the gate for everyone. The rank bound needs no allowance; the margin makes up for a site
    with too few distances for it, whose largest falls short of its true quantile (docs/results.md,
    "Style routing" and "The gate on real photos and few cases"). ``inf`` (every image passes) when
    no site sent a distance.
    """
    check_quantile(quantile)
    edges = [site_threshold(h["counts"].double().numpy(), quantile, margin) for h in hists
             if float(h["counts"].sum()) > 0]
    if not edges:
        return float("inf")
    return float(np.median(edges))


def parse_style_gate(value: object) -> float | None:
    """A style-gate setting: ``None``, ``"off"`` or ``false`` turn it off; a number or numeric text is the quantile."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none")):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"the style gate must be 'off' or a quantile in (0, 1], got {value!r}") from None
    return check_quantile(value)  # type: ignore[arg-type]


def check_site_routing(site_routing: object, style_gate: float | None) -> str:
    """A FedSM ``site_routing`` setting: ``"auto"`` (default: the better of the two on validation data,
    :mod:`engine.fl.routing_choice`), ``"selector"`` (the paper's) or ``"style"`` (needs the gate on)."""
    if site_routing != AUTO and site_routing not in SITE_ROUTINGS:
        raise ConfigError(f"site_routing must be 'auto', 'selector' or 'style', got {site_routing!r}")
    if site_routing == "style" and style_gate is None:
        raise ConfigError("site_routing 'style' routes by the site-style gate, which is off; turn it on "
                          "(--style-gate 0.95, [training] style_gate = 0.95) or route by the selector")
    return str(site_routing)


def bundle_site_routing(requested: str, gate_meta: Mapping[str, object],
                        choice: Mapping[str, torch.Tensor] | None = None) -> str:
    """The ``site_routing`` a bundle records.

    ``requested``, with ``"auto"`` resolved to the federation's validation choice (``choice``, the
    server's :data:`engine.fl.routing_choice.CHOICE_PART`; the selector without one); style routing
    without a fitted gate (no site sent statistics, or no last round) falls back to the selector,
    with a warning.
    """
    rule = chosen_rule(requested, choice)
    if rule == "style" and not gate_meta:
        log.warning("style routing was asked for, but the federation fitted no site-style gate; the super "
                    "model routes by its selector and gamma instead")
        return "selector"
    return rule


def gate_metadata(gate: Mapping[str, torch.Tensor], site_names: Sequence[str]) -> dict[str, object]:
    """The bundle's ``style_gate`` field from the server's state part (``{}`` without a fitted gate)."""
    if not gate or "threshold" not in gate:
        return {}
    threshold = float(gate["threshold"].reshape(-1)[0])
    return {"descriptor": DESCRIPTOR,
            "sites": [site_names[int(k)] for k in gate["sites"].tolist()],
            "means": gate["means"].double().tolist(),
            "precision": gate["precision"].double().tolist(),
            "threshold": threshold if np.isfinite(threshold) else None,
            "quantile": float(gate["quantile"].reshape(-1)[0]),
            "unit": "case"}


def judges_cases(meta: Mapping[str, object], cases: np.ndarray | None) -> bool:
    """Whether a bundle's gate judges these images by case: its ``unit`` is ``case`` and cases are given."""
    return meta.get("unit", "image") == "case" and cases is not None


def gate_nearest(images: np.ndarray, meta: Mapping[str, object], site_names: Sequence[str],
                 cases: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each image's nearest site under a bundle's gate, its distance, and whether it is outside.

    ``images`` are at the U-Nets' input size, normalised as in training; ``cases``: the case of each
    image (the slices of one volume share one; ``None``: each image a case of its own).

    Returns
    -------
    tuple
        ``distance float (N,)`` (squared Mahalanobis distance to the nearest site mean; for a gate
        that judges cases, the mean over the image's case of each image's distance to its nearest
        site, which is what the threshold bounds), ``nearest int64 (N,)`` (the nearest site's routed
        model index, 1..K; for a gate that judges cases, the site with the smallest mean distance
        over the case, so every slice of a volume has one nearest site) and ``outside bool (N,)``
        (beyond the threshold: unlike every site the gate knows; all ``False`` without a threshold).
    """
    gate = {"means": meta["means"], "precision": meta["precision"],
            "sites": [list(site_names).index(s) for s in meta["sites"]]}  # type: ignore[union-attr]
    matrix, sites = style_distance_matrix(style_descriptors(images, str(meta["descriptor"])), gate)
    by_case = judges_cases(meta, cases)
    distance, nearest = nearest_sites(matrix, sites, cases if by_case else None)
    if by_case and len(distance):
        distance = case_mean_rows(distance, cases)
    threshold = meta["threshold"]
    outside = (distance > float(threshold) if threshold is not None  # type: ignore[arg-type]
               else np.zeros(len(distance), dtype=bool))
    return distance, (nearest + 1).astype(np.int64), outside


def route_by_style(nearest: np.ndarray, outside: np.ndarray) -> np.ndarray:
    """Style routing: each image to its nearest site's model (1..K), to global (0) when outside the gate.

    The gate's Gaussians are a nearest-class-mean classifier with a shared covariance (LDA's rule
    at equal priors); with the threshold it is the open-set classifier of Lee et al. (2018).
    """
    return np.where(np.asarray(outside, dtype=bool), 0, np.asarray(nearest, dtype=np.int64)).astype(np.int64)


def _array(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
