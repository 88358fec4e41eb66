"""Synthetic multi-site federations written as real files (PNG / NIfTI + datalists).

The generator stands in for the paper's data when none is at hand: it renders plausible fundus
photos (optic disc and cup) or prostate MRI volumes, and makes sites differ the way real sites do.
Every site draws its *anatomy* (what is segmented) from the same distribution; sites differ in
*acquisition* (colour cast, brightness, contrast, blur, field of view, centring, noise, bias field),
in *annotation habit* (one expert draws the boundary wider), and in *size* (the largest site has
8x the cases of the smallest, like Table 1 of the FedSM paper). Acquisition differences are large
on purpose: a selector must be able to tell the sites apart at 32 px.

Layout written by :func:`generate_federation`::

    out_dir/
      site1/images/case000.png|.nii.gz   site1/labels/case000.png|.nii.gz   site1/datalist.json
      site2/...
      federation.json                    written last: task, sites, size, seed, version, profiles

Fundus label maps follow ORIGA: 0 background, 1 disc rim (disc minus cup), 2 cup. Prostate label
volumes are ``uint8`` 0/1; image volumes are ``float32`` (X, Y, Z) with ``Z = slices`` axial slices,
spacing ``128/S x 128/S x 3`` mm (a 128 mm field at every image size ``S``).

Site profiles (fixed before any method is evaluated; sites 7-12 are derived from a seeded RNG,
see :func:`site_profiles`). ``blur`` is a Gaussian sigma in pixels at 256 px (scaled with the image
size); ``fov`` is the radius of the circular field of view (fundus) or the half-width of the body
(prostate) as a fraction of half the image; ``jitter`` is the std of the disc / organ centre as a
fraction of half the image; ``noise`` is a std in [0, 1] intensity units; ``bias`` the amplitude of a
smooth multiplicative field; ``outer``/``inner`` the annotation habit, a relative change of the
annotated disc (gland) / cup radius against the rendered one.

Fundus (``gains`` = RGB colour cast, ``bright`` = overall brightness, ``gamma`` > 1 = harder contrast)::

    site cases gains (R, G, B)      bright gamma blur  fov  jitter noise  bias  outer  inner
    1      8   (1.00, 0.55, 0.30)   1.00   1.00  0.6  0.95  0.04  0.020  0.15   0.00   0.00
    2     12   (1.05, 0.80, 0.50)   1.25   0.75  1.2  0.85  0.05  0.030  0.20   0.00  +0.10
    3     20   (0.85, 0.38, 0.30)   0.70   1.35  0.4  1.08  0.03  0.015  0.10   0.00   0.00
    4     28   (0.90, 0.62, 0.62)   0.95   0.90  2.4  0.72  0.06  0.025  0.25  +0.12   0.00
    5     40   (1.05, 0.45, 0.12)   1.10   1.15  0.8  0.92  0.05  0.050  0.15   0.00   0.00
    6     64   (0.70, 0.60, 0.40)   0.80   1.50  1.0  1.00  0.04  0.020  0.40  -0.05   0.00

    1 warm orange; 2 bright yellow, its expert draws the cup wider; 3 dark red, field clipped by the
    frame; 4 pale pink, blurry, small field, its expert draws the disc wider; 5 saturated orange,
    noisy; 6 dull brown, strongly vignetted, disc drawn tight.

Prostate (``scale``/``offset`` = raw scanner units, removed again by percentile normalisation;
``bright`` = soft-tissue brightness relative to fluid and fat, i.e. T2 weighting, which survives it)::

    site cases scale offset          bright gamma blur  fov  jitter noise  bias  outer  inner
    1      4   1000     0            1.00   1.00  0.6  0.95  0.03  0.020  0.15   0.00   0.00
    2      6   2500   100            1.35   0.70  1.4  0.86  0.04  0.040  0.30   0.00   0.00
    3      8    400     0            0.70   1.60  0.3  1.05  0.02  0.012  0.10  +0.12   0.00
    4     12   1500     0            1.00   1.00  2.4  0.90  0.05  0.070  0.55   0.00   0.00
    5     18    800   200            1.50   1.10  0.8  0.80  0.03  0.030  0.20   0.00   0.00
    6     32   3000     0            0.85   1.25  1.0  1.00  0.04  0.030  0.45  -0.05   0.00

    1 reference 3T; 2 soft, washed-out contrast; 3 hard contrast, quiet, its expert draws the gland
    wider; 4 noisy, blurry, strong coil bias (1.5T with endorectal coil); 5 bright tissue, small
    body in the field; 6 hard contrast, vignetted, gland drawn tight.

For ``K`` sites the first ``K`` profiles are used; sites 7-12 are drawn as far as possible from the
earlier ones, but are less clearly apart than the hand-written six.

Anatomy, the same at every site: fundus photos show a circular field of view on a dark frame, an
orange-red retina with choroidal texture, a darker macula and vessels leaving the disc, an
elliptic bright disc (vertical radius 0.22-0.30 of half the image) with a paler cup, vertical
cup-to-disc ratio uniform in 0.3-0.7. Prostate volumes show a pelvis-like body with a fat ring,
femoral heads, a dark rectum, a darker gland in periprostatic fat in the middle slices only (top
and bottom slices hold no gland) and a bright bladder above it.

Each site's cases are split 0.5 / 0.25 / 0.25 into training / validation / testing (at least one
case each, see :func:`split_counts`) by a seeded permutation. Everything is deterministic: case
``i`` of site index ``k`` (0-based) draws from ``numpy.random.default_rng([seed, k, 1, i])`` and the
same arguments give byte-identical files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.datalist import load_datalist, write_datalist
from engine.errors import ConfigError, DataError
from engine.io.atomic import write_text_atomic
from engine.io.files import write_label_png, write_nifti, write_rgb_png
from engine.tasks import get_task

#: Bumped whenever the rendering changes, so existing data is no longer taken as a match.
GENERATOR_VERSION = 2
MIN_SITES, MAX_SITES = 2, 12
DEFAULT_SLICES = 12
#: Through-plane spacing of prostate volumes (mm) and the in-plane field of view (mm).
SLICE_SPACING_MM = 3.0
FIELD_MM = 128.0
FEDERATION_FILE = "federation.json"

# Stream tags for numpy SeedSequence entropy: [seed, site, tag, index]; one fixed length so no
# two streams can ever share a state.
_CASE_STREAM, _SPLIT_STREAM, _PROFILE_STREAM = 1, 2, 3
# Extra profiles (sites 7..12) are part of the generator, not of the data seed.
_PROFILE_SEED = 0x5EED


@dataclass(frozen=True)
class SiteProfile:
    """How one site acquires and annotates its images (see the module docstring's tables).

    Attributes
    ----------
    cases
        Number of cases (photos or volumes) the site holds.
    gains
        RGB colour cast (fundus); ``(1, 1, 1)`` for prostate.
    scale, offset
        Raw scanner intensity units (prostate): ``raw = scale * image + offset``.
    brightness
        Overall brightness (fundus) / soft-tissue brightness against fluid and fat (prostate).
    gamma
        Contrast as a power law on [0, 1] intensities; > 1 is harder.
    blur
        Gaussian blur sigma in pixels at 256 px, scaled with the image size.
    fov
        Field-of-view radius (fundus) / body half-width (prostate), fraction of half the image.
    jitter
        Std of the disc / organ centre, fraction of half the image.
    noise
        Noise std in [0, 1] intensity units (Gaussian for fundus, Rician for prostate).
    bias
        Amplitude of the smooth multiplicative bias field.
    outer, inner
        Annotation habit: relative change of the annotated disc or gland (``outer``) and cup
        (``inner``) radius against the rendered anatomy.
    """

    cases: int
    gains: tuple[float, float, float] = (1.0, 1.0, 1.0)
    scale: float = 1.0
    offset: float = 0.0
    brightness: float = 1.0
    gamma: float = 1.0
    blur: float = 0.5
    fov: float = 0.95
    jitter: float = 0.04
    noise: float = 0.02
    bias: float = 0.15
    outer: float = 0.0
    inner: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready dict (tuples as lists), as stored in ``federation.json``."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


_P = SiteProfile
FUNDUS_PROFILES: tuple[SiteProfile, ...] = (
    _P(8, (1.00, 0.55, 0.30), brightness=1.00, gamma=1.00, blur=0.6, fov=0.95, jitter=0.04, noise=0.020,
       bias=0.15),
    _P(12, (1.05, 0.80, 0.50), brightness=1.25, gamma=0.75, blur=1.2, fov=0.85, jitter=0.05, noise=0.030,
       bias=0.20, inner=0.10),
    _P(20, (0.85, 0.38, 0.30), brightness=0.70, gamma=1.35, blur=0.4, fov=1.08, jitter=0.03, noise=0.015,
       bias=0.10),
    _P(28, (0.90, 0.62, 0.62), brightness=0.95, gamma=0.90, blur=2.4, fov=0.72, jitter=0.06, noise=0.025,
       bias=0.25, outer=0.12),
    _P(40, (1.05, 0.45, 0.12), brightness=1.10, gamma=1.15, blur=0.8, fov=0.92, jitter=0.05, noise=0.050,
       bias=0.15),
    _P(64, (0.70, 0.60, 0.40), brightness=0.80, gamma=1.50, blur=1.0, fov=1.00, jitter=0.04, noise=0.020,
       bias=0.40, outer=-0.05),
)
PROSTATE_PROFILES: tuple[SiteProfile, ...] = (
    _P(4, scale=1000.0, offset=0.0, brightness=1.00, gamma=1.00, blur=0.6, fov=0.95, jitter=0.03, noise=0.020,
       bias=0.15),
    _P(6, scale=2500.0, offset=100.0, brightness=1.35, gamma=0.70, blur=1.4, fov=0.86, jitter=0.04,
       noise=0.040, bias=0.30),
    _P(8, scale=400.0, offset=0.0, brightness=0.70, gamma=1.60, blur=0.3, fov=1.05, jitter=0.02, noise=0.012,
       bias=0.10, outer=0.12),
    _P(12, scale=1500.0, offset=0.0, brightness=1.00, gamma=1.00, blur=2.4, fov=0.90, jitter=0.05,
       noise=0.070, bias=0.55),
    _P(18, scale=800.0, offset=200.0, brightness=1.50, gamma=1.10, blur=0.8, fov=0.80, jitter=0.03,
       noise=0.030, bias=0.20),
    _P(32, scale=3000.0, offset=0.0, brightness=0.85, gamma=1.25, blur=1.0, fov=1.00, jitter=0.04,
       noise=0.030, bias=0.45, outer=-0.05),
)
del _P


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------
def _signature(task: str, p: SiteProfile) -> np.ndarray:
    """What a low-resolution classifier sees of a profile, roughly on a common scale."""
    if task == "fundus":
        colour = np.asarray(p.gains) * p.brightness
        return np.concatenate([colour * 2.0, [p.gamma, p.fov * 2.0, p.bias]])
    return np.asarray([p.brightness * 2.0, p.gamma * 2.0, p.fov * 2.0, p.noise * 20.0, p.bias * 2.0,
                       p.blur / 2.0])


def _derive_profile(task: str, index: int, earlier: list[SiteProfile]) -> SiteProfile:
    """Profile of site ``index + 1`` (> 6): random, but as far as possible from the earlier ones."""
    rng = np.random.default_rng([_PROFILE_SEED, index, _PROFILE_STREAM, 0 if task == "fundus" else 1])
    best, best_dist = None, -1.0
    fov_low = 0.7 if task == "fundus" else 0.8  # a smaller body would crowd the pelvic organs
    for _ in range(64):
        habit = rng.choice(np.array([0.0, 0.0, 0.0, 0.10, -0.05]))
        common: dict[str, Any] = dict(
            brightness=round(float(rng.uniform(0.7, 1.3)), 2), gamma=round(float(rng.uniform(0.7, 1.5)), 2),
            blur=round(float(rng.uniform(0.3, 2.4)), 1), fov=round(float(rng.uniform(fov_low, 1.08)), 2),
            jitter=round(float(rng.uniform(0.02, 0.06)), 2), noise=round(float(rng.uniform(0.015, 0.06)), 3),
            bias=round(float(rng.uniform(0.1, 0.5)), 2), outer=float(habit), inner=0.0,
        )
        if task == "fundus":
            gains = (round(float(rng.uniform(0.7, 1.05)), 2), round(float(rng.uniform(0.35, 0.8)), 2),
                     round(float(rng.uniform(0.12, 0.62)), 2))
            cand = SiteProfile(int(rng.integers(8, 65)), gains, **common)
        else:
            cand = SiteProfile(int(rng.integers(4, 33)), scale=float(round(rng.uniform(300, 3000), -1)),
                               offset=float(round(rng.uniform(0, 200), -1)), **common)
        sig = _signature(task, cand)
        dist = min(float(np.linalg.norm(sig - _signature(task, e))) for e in earlier)
        if dist > best_dist:
            best, best_dist = cand, dist
    assert best is not None
    return best


def site_profiles(task: str, sites: int) -> list[SiteProfile]:
    """The first ``sites`` profiles of ``task``: the fixed table, then derived ones beyond six.

    Raises
    ------
    ConfigError
        When the task is unknown or ``sites`` is outside 2..12.
    """
    get_task(task)
    _check_sites(sites)
    table = list(FUNDUS_PROFILES if task == "fundus" else PROSTATE_PROFILES)
    while len(table) < sites:
        table.append(_derive_profile(task, len(table), table))
    return table[:sites]


# --------------------------------------------------------------------------------------------
# Small image helpers (numpy only: scipy is not a dependency)
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _gauss_matrix(size: int, sigma: float) -> np.ndarray:
    """``(size, size)`` matrix that blurs along one axis with a Gaussian (edges renormalised).

    A dense matrix product is the cheapest separable blur at these sizes (scipy is not a
    dependency): ``S^3`` multiply-adds in about a millisecond, and any sigma costs the same.
    """
    x = np.arange(size, dtype=np.float64)
    m = np.exp(-0.5 * ((x[:, None] - x[None, :]) / sigma) ** 2)
    m[m < 1e-6] = 0.0
    m /= m.sum(axis=1, keepdims=True)
    return m.astype(np.float32)


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur over the first two axes of ``(H, W)``, ``(H, W, C)`` or ``(H, W, D)`` arrays.

    The products run in torch rather than numpy: numpy's multithreaded OpenBLAS slows down by
    more than 10x on a busy machine for these small products, torch's thread pool does not.
    """
    if sigma < 0.2:
        return img
    import torch

    g = torch.from_numpy(_gauss_matrix(img.shape[0], float(sigma)))
    t = torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32))
    with torch.no_grad():
        if img.ndim == 2:
            out = g @ t @ g.T
        else:
            # Channels / slices first so the product broadcasts over them: (C, H, W).
            out = (g @ t.permute(2, 0, 1) @ g.T).permute(1, 2, 0)
    return np.ascontiguousarray(out.numpy())


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, ...], sigma: float) -> np.ndarray:
    """Zero-mean, unit-std smooth random texture (blurred white noise)."""
    field = _blur(rng.standard_normal(shape).astype(np.float32), sigma)
    std = float(field.std())
    return (field - field.mean()) / (std if std > 0 else 1.0)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [-1, 1]: ``rows`` (S, 1) and ``cols`` (1, S)."""
    c = ((np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0).astype(np.float32)
    return c[:, None], c[None, :]


def _ellipse_q(rows: np.ndarray, cols: np.ndarray, cy: float, cx: float, ry: float, rx: float,
               angle: float = 0.0) -> np.ndarray:
    """Normalised elliptic radius: < 1 inside the (rotated) ellipse, 1 on its boundary."""
    dy, dx = rows - cy, cols - cx
    ca, sa = math.cos(angle), math.sin(angle)
    u = dx * ca + dy * sa
    v = -dx * sa + dy * ca
    return np.sqrt((u / rx) ** 2 + (v / ry) ** 2)


def _bias_field(rng: np.random.Generator, rows: np.ndarray, cols: np.ndarray, strength: float,
                z: np.ndarray | None = None) -> np.ndarray:
    """Smooth multiplicative field ``1 + strength * g``: a random tilt plus a radial fall-off."""
    a = rng.standard_normal(3 if z is None else 4)
    lin = a[0] * cols + a[1] * rows + (0.0 if z is None else a[3] * z)
    lin = lin / (np.abs(lin).max() + 1e-6)
    radial = 0.4 - (rows ** 2 + cols ** 2)
    g = 0.6 * lin + (0.6 + 0.3 * a[2]) * radial
    return np.clip(1.0 + strength * g, 0.2, None).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Fundus
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FundusAnatomy:
    """The rendered (true) optic disc and cup, in [-1, 1] image coordinates (rows, cols)."""

    side: int
    disc_centre: tuple[float, float]
    disc_radii: tuple[float, float]
    cup_centre: tuple[float, float]
    cup_radii: tuple[float, float]
    angle: float

    @property
    def cup_to_disc(self) -> float:
        """Vertical cup-to-disc ratio."""
        return self.cup_radii[0] / self.disc_radii[0]


def _fundus_anatomy(rng: np.random.Generator, profile: SiteProfile) -> FundusAnatomy:
    side = 1 if rng.random() < 0.5 else -1  # right or left eye: the disc lies nasally
    cy = float(rng.uniform(-0.06, 0.06) + rng.normal(0.0, profile.jitter))
    cx = float(side * 0.25 + rng.normal(0.0, profile.jitter))
    ry = float(rng.uniform(0.22, 0.30))
    rx = ry * float(rng.uniform(0.86, 0.97))  # discs are slightly taller than wide
    angle = float(rng.uniform(-0.25, 0.25))
    cdr = float(rng.uniform(0.3, 0.7))
    cry = cdr * ry
    crx = min(cry * float(rng.uniform(0.85, 1.05)), 0.9 * rx)
    # The cup sits a little temporal (away from the nose) and never touches the rim boundary.
    ox = -side * float(rng.uniform(0.0, 0.5)) * (rx - crx)
    oy = float(rng.uniform(-0.3, 0.3)) * (ry - cry)
    ca, sa = math.cos(angle), math.sin(angle)
    return FundusAnatomy(side, (cy, cx), (ry, rx), (cy + ox * sa + oy * ca, cx + ox * ca - oy * sa),
                         (cry, crx), angle)


def _splat_vessels(rng: np.random.Generator, size: int, anatomy: FundusAnatomy) -> np.ndarray:
    """Ink map of vessels leaving the disc: arcades bending towards the macula, plus branches."""
    ink = np.zeros(size * size, dtype=np.float32)
    half = size / 2.0
    cy, cx = anatomy.disc_centre
    side = anatomy.side
    step = 1.0 / size  # half a pixel in [-1, 1] units
    # Main arcades leave up and down and bend temporally (-side); nasal vessels are thinner.
    starts = [(-math.pi / 2, 1.0, -side * 1.6), (math.pi / 2, 1.0, side * 1.6),
              (-math.pi / 2 + side * 0.6, 0.7, 0.0), (math.pi / 2 - side * 0.6, 0.7, 0.0),
              (-math.pi / 2 - side * 1.0, 0.6, -side * 0.8), (math.pi / 2 + side * 1.0, 0.6, side * 0.8)]
    vessels = []
    for angle, width, bend in starts:
        vessels.append((cy, cx, angle + rng.normal(0, 0.15), width * rng.uniform(0.8, 1.1),
                        bend + rng.normal(0, 0.3), rng.uniform(0.9, 1.5)))
    for _ in range(int(rng.integers(3, 7))):  # branches from random points near the disc
        a = rng.uniform(-math.pi, math.pi)
        r = rng.uniform(0.15, 0.45)
        vessels.append((cy + r * math.sin(a), cx + r * math.cos(a), a + rng.normal(0, 0.5),
                        rng.uniform(0.35, 0.6), rng.normal(0, 1.5), rng.uniform(0.3, 0.8)))
    width_px = 3.0 * size / 256.0 + 0.4  # main vessel width in pixels
    for y0, x0, angle, width, bend, length in vessels:
        n = max(2, int(length / step))
        t = np.arange(n, dtype=np.float64) * step
        theta = angle + bend * t + 0.15 * np.sin(t * rng.uniform(4, 9) + rng.uniform(0, 6))
        ys = y0 + np.cumsum(np.sin(theta)) * step
        xs = x0 + np.cumsum(np.cos(theta)) * step
        w = width * width_px * np.clip(1.0 - 0.6 * t / length, 0.3, 1.0)
        # Bilinear splat of each point; weight = width * half a pixel of length (ink per area).
        py, px = (ys + 1.0) * half - 0.5, (xs + 1.0) * half - 0.5
        iy, ix = np.floor(py).astype(np.int64), np.floor(px).astype(np.int64)
        fy, fx = py - iy, px - ix
        for dy, dx, wt in ((0, 0, (1 - fy) * (1 - fx)), (0, 1, (1 - fy) * fx), (1, 0, fy * (1 - fx)),
                           (1, 1, fy * fx)):
            yy, xx = iy + dy, ix + dx
            ok = (yy >= 0) & (yy < size) & (xx >= 0) & (xx < size)
            np.add.at(ink, yy[ok] * size + xx[ok], (0.5 * w * wt)[ok].astype(np.float32))
    return ink.reshape(size, size)


def render_fundus(rng: np.random.Generator, profile: SiteProfile, size: int
                  ) -> tuple[np.ndarray, np.ndarray, FundusAnatomy]:
    """Render one fundus photo and its ORIGA label map.

    Parameters
    ----------
    rng
        The case's random generator (anatomy first, then acquisition).
    profile
        The site's acquisition and annotation habit.
    size
        Image side in pixels.

    Returns
    -------
    image, label, anatomy
        ``uint8 (S, S, 3)`` photo, ``uint8 (S, S)`` label map (0 background, 1 rim, 2 cup; every
        cup pixel lies inside the annotated disc) and the true geometry that was rendered.
    """
    anat = _fundus_anatomy(rng, profile)
    rows, cols = _grid(size)
    half = size / 2.0
    (cy, cx), (ry, rx) = anat.disc_centre, anat.disc_radii
    (ccy, ccx), (cry, crx) = anat.cup_centre, anat.cup_radii

    # Canonical (site-independent) retina: orange-red with choroidal texture and a dark macula.
    texture = 1.0 + 0.07 * _smooth_noise(rng, (size, size), 0.08 * size) \
        + 0.03 * _smooth_noise(rng, (size, size), max(0.7, 0.012 * size))
    my, mx = cy + rng.normal(0, 0.03), cx - anat.side * 0.58
    macula = 1.0 - 0.3 * np.exp(-((rows - my) ** 2 + (cols - mx) ** 2) / (2 * 0.13 ** 2))
    base = np.array([0.80, 0.37, 0.17], dtype=np.float32)
    img = (texture * macula)[..., None] * base

    # Disc: bright yellow rim brightening towards a pale cup; soft edges about a pixel wide.
    q_disc = _ellipse_q(rows, cols, cy, cx, ry, rx, anat.angle)
    q_cup = _ellipse_q(rows, cols, ccy, ccx, cry, crx, anat.angle)
    w_disc = _sigmoid((1.0 - q_disc) * ry * half / 0.7)[..., None]
    w_cup = _sigmoid((1.0 - q_cup) * cry * half / 0.9)[..., None]
    rim_glow = 1.0 + 0.1 * (1.0 - np.clip(q_disc, 0, 1))
    rim = np.array([1.1, 0.78, 0.50], dtype=np.float32) * rim_glow[..., None]
    cup = np.array([1.2, 1.08, 0.98], dtype=np.float32)
    img = img * (1.0 - w_disc) + rim * w_disc
    img = img * (1.0 - w_cup) + cup * w_cup

    # Vessels on top (they cross the rim): dark red, thicker ones darker.
    ink = _blur(_splat_vessels(rng, size, anat), max(0.6, 0.004 * size))
    dark = np.clip(ink * 1.1, 0.0, 0.8)[..., None]
    img = img * (1.0 - dark * np.array([0.45, 0.8, 0.8], dtype=np.float32))

    # Acquisition: colour cast, brightness, bias field, contrast, field of view, blur, noise.
    img = img * (np.asarray(profile.gains, dtype=np.float32) * profile.brightness)
    img = img * _bias_field(rng, rows, cols, profile.bias)[..., None]
    img = np.clip(img, 0.0, 1.0) ** profile.gamma
    fov_r = np.sqrt(rows ** 2 + cols ** 2)
    fov = _sigmoid((profile.fov - fov_r) * half / 0.8)[..., None]
    img = img * fov + 0.012 * (1.0 - fov)
    img = _blur(img, profile.blur * size / 256.0)
    img = img + rng.normal(0.0, profile.noise, img.shape).astype(np.float32)
    image = np.round(np.clip(img, 0.0, 1.0) * 255.0).astype(np.uint8)

    # Annotation: the expert's disc and cup (habit-scaled), cup clipped to the disc.
    disc = _ellipse_q(rows, cols, cy, cx, ry * (1 + profile.outer), rx * (1 + profile.outer), anat.angle) <= 1
    cupm = _ellipse_q(rows, cols, ccy, ccx, cry * (1 + profile.inner), crx * (1 + profile.inner),
                      anat.angle) <= 1
    label = disc.astype(np.uint8)
    label[disc & cupm] = 2
    return image, label, anat


# --------------------------------------------------------------------------------------------
# Prostate
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProstateAnatomy:
    """The rendered (true) gland: centre (rows, cols in [-1, 1]; slice index) and radii."""

    centre: tuple[float, float, float]
    radii: tuple[float, float, float]


def render_prostate(rng: np.random.Generator, profile: SiteProfile, size: int, slices: int = DEFAULT_SLICES
                    ) -> tuple[np.ndarray, np.ndarray, ProstateAnatomy]:
    """Render one T2-like pelvic MRI volume and its gland label.

    Returns
    -------
    volume, label, anatomy
        ``float32 (S, S, D)`` volume in the site's raw (whole) units, ``uint8 (S, S, D)`` 0/1 gland label
        (empty in the top and bottom slices), both in RAS+ canonical voxel order (axis 0 towards the
        patient's right, axis 1 anterior, axis 2 superior; :func:`prostate_affine` is diagonal), and
        the true gland geometry in drawing coordinates (rows, cols: see :func:`_image_to_ras`).
    """
    rows, cols = _grid(size)
    r3, c3 = rows[..., None], cols[..., None]
    z = np.arange(slices, dtype=np.float32)[None, None, :]
    half = size / 2.0
    edge = half / 0.8  # soft edges about one pixel wide

    # Anatomy (site-independent, apart from the body size = field of view and centring jitter).
    by, bx = float(rng.normal(0.05, profile.jitter)), float(rng.normal(0.0, profile.jitter))
    bw = profile.fov * float(rng.uniform(0.92, 1.0))
    bh = bw * float(rng.uniform(0.65, 0.75))
    py, px = by + float(rng.uniform(-0.04, 0.02)), bx + float(rng.normal(0.0, 0.03))
    pz = (slices - 1) / 2.0 + float(rng.uniform(-0.8, 0.8))
    pry, prx = float(rng.uniform(0.18, 0.24)), float(rng.uniform(0.24, 0.32))
    prz = slices * float(rng.uniform(0.2, 0.27))
    anat = ProstateAnatomy((py, px, pz), (pry, prx, prz))

    fat, muscle, fluid = 0.78, 0.42 * profile.brightness, 0.97
    body_q = _ellipse_q(rows, cols, by, bx, bh, bw)
    img = np.zeros((size, size, slices), dtype=np.float32) + 0.02  # air
    body = _sigmoid((1.0 - body_q) * bh * edge)[..., None]
    inner = _sigmoid((1.0 - _ellipse_q(rows, cols, by, bx, bh - 0.06, bw - 0.06)) * bh * edge)[..., None]
    tissue = muscle * (1.0 + 0.12 * _smooth_noise(rng, (size, size, slices), 0.03 * size))
    img = img * (1 - body) + body * (fat * (1 - inner) + tissue * inner)  # subcutaneous fat ring
    # Femoral heads: bright marrow inside a dark cortex, lateral, in every slice.
    for s in (-1, 1):
        q = _ellipse_q(rows, cols, by + 0.02, bx + s * 0.68 * bw, 0.11, 0.11)[..., None]
        img = np.where(q < 1.0, np.where(q < 0.8, 0.62, 0.08), img).astype(np.float32)
    # Periprostatic fat around the gland, the gland itself: dark central gland, bright periphery.
    q3 = np.sqrt(((r3 - py) / pry) ** 2 + ((c3 - px) / prx) ** 2 + ((z - pz) / prz) ** 2)
    halo = _sigmoid((1.4 - q3) * pry * edge)
    img = img * (1 - halo) + 0.72 * halo
    nodules = 1.0 + 0.15 * _smooth_noise(rng, (size, size, slices), 0.015 * size)
    gland_i = (0.24 + 0.2 * np.clip(q3, 0, 1) ** 2) * nodules * profile.brightness
    gland = _sigmoid((1.0 - q3) * pry * edge)
    img = img * (1 - gland) + gland_i * gland
    # Rectum (posterior, dark air with a wall) and bladder (anterior, above the gland, bright urine).
    rq = _ellipse_q(rows, cols, py + pry + 0.09, px, 0.07, 0.09)[..., None]
    img = np.where(rq < 1.0, np.where(rq < 0.7, 0.05, 0.3 * profile.brightness), img).astype(np.float32)
    bz = pz + prz + float(rng.uniform(0.5, 1.5))
    bq = np.sqrt(((r3 - (py - 0.2)) / 0.18) ** 2 + ((c3 - px) / 0.28) ** 2 + ((z - bz) / (slices * 0.3)) ** 2)
    # The gland and its fat push the bladder away: the two never overlap, so the image matches the label.
    bladder = _sigmoid((1.0 - bq) * 0.18 * edge) * (1.0 - halo)
    img = img * (1 - bladder) + fluid * bladder

    # Acquisition: bias field, contrast, in-plane blur, Rician noise, raw scanner units.
    zc = (z - (slices - 1) / 2.0) / slices
    img = img * _bias_field(rng, r3, c3, profile.bias, zc)
    img = np.clip(img, 0.0, None) ** profile.gamma
    img = _blur(img, profile.blur * size / 256.0)
    n1 = rng.normal(0.0, profile.noise, img.shape).astype(np.float32)
    n2 = rng.normal(0.0, profile.noise, img.shape).astype(np.float32)
    img = np.sqrt((img + n1) ** 2 + n2 ** 2)
    # Whole scanner units, as a magnitude image comes off the scanner (it also halves the file size).
    volume = np.round(img * profile.scale + profile.offset).astype(np.float32)

    s = 1.0 + profile.outer
    lq = np.sqrt(((r3 - py) / (pry * s)) ** 2 + ((c3 - px) / (prx * s)) ** 2 + ((z - pz) / (prz * s)) ** 2)
    label = (lq <= 1.0).astype(np.uint8)
    return _image_to_ras(volume), _image_to_ras(label), anat


def _image_to_ras(array: np.ndarray) -> np.ndarray:
    """``(rows, cols, z)`` as drawn (anterior up, patient's right on the left, as a radiologist
    reads an axial slice) to RAS+ canonical ``(x, y, z)``: index 0 grows to the patient's right,
    index 1 anteriorly; so a diagonal affine places the anatomy where it belongs."""
    return np.ascontiguousarray(array[::-1, ::-1, :].transpose(1, 0, 2))


def prostate_affine(size: int) -> np.ndarray:
    """Voxel-to-mm affine: ``128/S x 128/S x 3`` mm spacing, centred in-plane."""
    sp = FIELD_MM / size
    aff = np.diag([sp, sp, SLICE_SPACING_MM, 1.0])
    aff[:2, 3] = -FIELD_MM / 2.0
    return aff


# --------------------------------------------------------------------------------------------
# Federation
# --------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_sites(sites: int) -> None:
    if not _is_int(sites) or not MIN_SITES <= sites <= MAX_SITES:
        raise ConfigError(f"sites must be an integer from {MIN_SITES} to {MAX_SITES}, got {sites!r}")


def _check_args(task: str, sites: int, image_size: int, seed: int, slices: int) -> None:
    get_task(task)
    _check_sites(sites)
    if not _is_int(image_size) or image_size < 32 or image_size % 16:
        raise ConfigError(f"image_size must be a multiple of 16 and at least 32 (e.g. 64 or 256), "
                          f"got {image_size!r}")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    if not _is_int(slices) or slices < 6:
        raise ConfigError(f"slices must be an integer >= 6 (so some slices have no gland), got {slices!r}")


def _scaled_profiles(task: str, sites: int, cases_scale: int) -> list[SiteProfile]:
    """:func:`site_profiles` with ``cases_scale`` times the cases (a positive integer)."""
    if not _is_int(cases_scale) or cases_scale < 1:
        raise ConfigError(f"cases_scale must be a positive integer, got {cases_scale!r}")
    profiles = site_profiles(task, sites)
    if cases_scale == 1:
        return profiles
    return [dataclasses.replace(p, cases=p.cases * int(cases_scale)) for p in profiles]


def split_counts(cases: int) -> tuple[int, int, int]:
    """Training/validation/testing case counts: about 0.5/0.25/0.25, at least one each."""
    if cases < 3:
        raise ConfigError(f"a site needs at least 3 cases (one per split), got {cases}")
    n_train = min(math.ceil(cases / 2), cases - 2)
    n_val = (cases - n_train) // 2
    return n_train, n_val, cases - n_train - n_val


def _federation_doc(task: str, profiles: list[SiteProfile], image_size: int, seed: int, slices: int
                    ) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "generator": "engine.data.synth",
        "generator_version": GENERATOR_VERSION,
        "task": task,
        "sites": len(profiles),
        "image_size": int(image_size),
        "seed": int(seed),
    }
    if task == "prostate":
        doc["slices"] = int(slices)
    doc["site_names"] = [f"site{k + 1}" for k in range(len(profiles))]
    doc["datalists"] = [f"site{k + 1}/datalist.json" for k in range(len(profiles))]
    doc["profiles"] = {f"site{k + 1}": p.to_json() for k, p in enumerate(profiles)}
    return doc


def generate_federation(task: str, sites: int, out_dir: Path, image_size: int = 64, seed: int = 0,
                        progress: Callable[[str], None] | None = None, *, slices: int = DEFAULT_SLICES,
                        cases_scale: int = 1) -> list[Path]:
    """Write a synthetic federation of ``sites`` sites under ``out_dir``.

    Parameters
    ----------
    task
        ``"fundus"`` or ``"prostate"``.
    sites
        Number of sites, 2..12; the first ``sites`` profiles are used.
    out_dir
        Folder to write ``site1..siteK`` and ``federation.json`` into (created when missing).
        Files of an earlier generation are overwritten; ``federation.json`` is removed first and
        written last, so an interrupted run is never mistaken for complete data.
    image_size
        Image side in pixels, a multiple of 16 and at least 32.
    seed
        Non-negative data seed; the same arguments give byte-identical files.
    progress
        Called with a short message after each site.
    slices
        Axial slices per prostate volume (ignored for fundus).
    cases_scale
        Each site holds ``cases_scale`` times its profile's cases (the desktop demo uses more
        cases than the paper-like table); case ``i`` is the same image at every scale.

    Returns
    -------
    list of Path
        Each site's ``datalist.json``, in site order.

    Raises
    ------
    ConfigError
        When an argument is out of range.
    DataError
        When ``out_dir`` cannot be written.
    """
    _check_args(task, sites, image_size, seed, slices)
    out_dir = Path(out_dir)
    profiles = _scaled_profiles(task, sites, cases_scale)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / FEDERATION_FILE).unlink(missing_ok=True)
    except OSError as exc:
        raise DataError(f"{out_dir}: cannot write synthetic data there ({exc}); choose a writable "
                        "folder") from exc

    datalists = []
    for k, profile in enumerate(profiles):
        name = f"site{k + 1}"
        site_dir = out_dir / name
        entries = []
        for i in range(profile.cases):
            rng = np.random.default_rng([seed, k, _CASE_STREAM, i])
            case = f"case{i:03d}"
            try:
                if task == "fundus":
                    image, label, _ = render_fundus(rng, profile, image_size)
                    img_path = site_dir / "images" / f"{case}.png"
                    lab_path = site_dir / "labels" / f"{case}.png"
                    write_rgb_png(img_path, image)
                    write_label_png(lab_path, label)
                else:
                    volume, label, _ = render_prostate(rng, profile, image_size, slices)
                    img_path = site_dir / "images" / f"{case}.nii.gz"
                    lab_path = site_dir / "labels" / f"{case}.nii.gz"
                    affine = prostate_affine(image_size)
                    write_nifti(img_path, volume, affine)
                    write_nifti(lab_path, label, affine)
            except OSError as exc:
                raise DataError(f"{site_dir}: cannot write synthetic data ({exc}); check free space and "
                                "permissions") from exc
            entries.append({"image": img_path.relative_to(site_dir).as_posix(),
                            "label": lab_path.relative_to(site_dir).as_posix()})
        order = np.random.default_rng([seed, k, _SPLIT_STREAM, 0]).permutation(profile.cases)
        n_train, n_val, _ = split_counts(profile.cases)
        # Entries stay in case order inside each split, so listings read naturally.
        parts = {"training": np.sort(order[:n_train]), "validation": np.sort(order[n_train:n_train + n_val]),
                 "testing": np.sort(order[n_train + n_val:])}
        datalist = site_dir / "datalist.json"
        write_datalist(datalist, {sec: [entries[int(j)] for j in idx] for sec, idx in parts.items()},
                       info={"name": name, "task": task,
                             "description": f"synthetic {task} site {k + 1} of {sites} (seed {seed})"})
        datalists.append(datalist.absolute())
        if progress is not None:
            progress(f"{name}: wrote {profile.cases} {task} cases ({k + 1}/{sites} sites)")

    doc = _federation_doc(task, profiles, image_size, seed, slices)
    write_text_atomic(out_dir / FEDERATION_FILE, json.dumps(doc, indent=2) + "\n")
    return datalists


def existing_federation(out_dir: Path, task: str, sites: int, image_size: int, seed: int, *,
                        slices: int = DEFAULT_SLICES, cases_scale: int = 1) -> list[Path] | None:
    """The datalists of a complete earlier generation with exactly these settings, else ``None``.

    A match needs ``out_dir/federation.json`` to record the same task, site count, image size,
    seed, slice count (prostate), generator version and site profiles, and every image and label
    file named by the site datalists to exist. Anything unreadable counts as no match.
    """
    out_dir = Path(out_dir)
    try:
        _check_args(task, sites, image_size, seed, slices)
        stored = json.loads((out_dir / FEDERATION_FILE).read_text(encoding="utf-8"))
        wanted = _federation_doc(task, _scaled_profiles(task, sites, cases_scale), image_size, seed, slices)
    except (OSError, ValueError, ConfigError):
        return None
    if stored != wanted:
        return None
    paths = []
    for rel in wanted["datalists"]:
        path = (out_dir / rel).absolute()
        try:
            sections = load_datalist(path)
        except DataError:
            return None
        for entries in sections.values():
            for entry in entries:
                if not (os.path.isfile(entry["image"]) and os.path.isfile(entry["label"])):
                    return None
        paths.append(path)
    return paths
