"""Optic-disc-centred crops of full fundus photographs, the same at training and at inference.

Public fundus datasets come in two forms: disc-centred crops (ORIGA, REFUGE crops: the disc fills
about a third of the image) and full photographs (Drishti-GS, RIM-ONE, REFUGE originals: a round
field of view on a black background, the disc about a tenth of the width). Resized to the
network's input, a full photo leaves the disc a few pixels wide, so one federation cannot mix the
two forms. With ``fundus_crop = "auto"`` every full photograph is cropped around its optic disc
before anything else, and crops are left as they are.

Steps (deterministic, no learned model; numbers are fractions, so they hold at any resolution):

1. **Full photo or crop?** A full photograph has the black background of the camera's round field
   of view in its corners: :func:`is_full_photo` is true when at least
   :data:`DARK_CORNER_SHARE` of the pixels in the four corner squares (side 5 % of the shorter
   side) have every channel below :data:`DARK_LEVEL`.
2. **Where is the disc?** The disc is the brightest large region in the red channel.
   :func:`locate_disc` works on a copy shrunk to :data:`WORK_SIDE` pixels on its longer side (area
   averaging), keeps the field of view (red above :data:`DARK_LEVEL`, eroded by 3 % of the side so
   the bright rim of the field is ignored), smooths the red channel with a Gaussian of sigma 2.5 % of
   the shorter side (about the disc's radius, so vessels and small bright lesions do not win), and
   takes the position of the maximum inside the field of view.
3. **Crop:** a square of side :data:`CROP_FRACTION` x the photo's shorter side centred on the
   disc, moved inside the photo where it would leave it (:func:`crop_box`).

Training (:mod:`engine.data.site_data`) crops the photo and its mask with the same box;
inference (:func:`engine.inference.study.segment_with`) segments the crop and writes the mask back
into a full-size map (background outside the crop). The bundle records the setting
(``extra["fundus_crop"]``), so ``fedsm infer``, ``fedsm evaluate`` and the desktop app crop exactly
when its training did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ConfigError

#: ``fundus_crop`` settings: ``"none"`` (photos as they are) or ``"auto"`` (crop full photos).
CROP_MODES = ("none", "auto")
#: A channel value below this is the black background of a fundus camera's field of view.
DARK_LEVEL = 40
#: Share of dark corner pixels that marks a full photograph.
DARK_CORNER_SHARE = 0.5
#: Side of the working copy used to find the disc.
WORK_SIDE = 256
#: Crop side as a fraction of the photo's shorter side (the disc then fills about a quarter of it).
CROP_FRACTION = 0.4


@dataclass(frozen=True)
class CropBox:
    """Rows ``top:top+size`` and columns ``left:left+size`` of a photo."""

    top: int
    left: int
    size: int

    def slices(self) -> tuple[slice, slice]:
        """``(rows, columns)`` slices into the photo."""
        return slice(self.top, self.top + self.size), slice(self.left, self.left + self.size)


def check_mode(mode: str) -> str:
    """``mode`` if it is a known ``fundus_crop`` setting, else :class:`ConfigError`."""
    if mode not in CROP_MODES:
        raise ConfigError(f"unknown fundus crop {mode!r}; choose one of {', '.join(CROP_MODES)}")
    return mode


def is_full_photo(rgb: np.ndarray) -> bool:
    """Whether ``rgb`` (``uint8 (H, W, 3)``) is a full fundus photograph (dark corners), not a crop."""
    h, w = rgb.shape[:2]
    c = max(2, min(h, w) // 20)
    corners = np.concatenate([rgb[:c, :c].reshape(-1, 3), rgb[:c, -c:].reshape(-1, 3),
                              rgb[-c:, :c].reshape(-1, 3), rgb[-c:, -c:].reshape(-1, 3)])
    return bool((corners.max(axis=1) < DARK_LEVEL).mean() >= DARK_CORNER_SHARE)


def _shrink(rgb: np.ndarray) -> tuple[np.ndarray, float]:
    import torch
    import torch.nn.functional as F

    h, w = rgb.shape[:2]
    scale = min(1.0, WORK_SIDE / max(h, w))
    t = torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.float32)).permute(2, 0, 1)[None]
    if scale < 1.0:
        t = F.interpolate(t, size=(max(1, round(h * scale)), max(1, round(w * scale))), mode="area")
    return t[0].permute(1, 2, 0).numpy(), scale


def locate_disc(rgb: np.ndarray) -> tuple[int, int]:
    """``(row, column)`` of the optic disc's centre in a fundus photo (see the module docstring, step 2)."""
    from scipy import ndimage

    small, scale = _shrink(rgb)
    red = small[..., 0]
    side = min(red.shape)
    field = red > DARK_LEVEL
    erosion = max(1, round(0.03 * side))
    field = ndimage.binary_erosion(field, iterations=erosion)
    smooth = ndimage.gaussian_filter(red, sigma=max(1.0, 0.025 * side))
    if field.any():
        smooth = np.where(field, smooth, -np.inf)
    row, col = np.unravel_index(int(np.argmax(smooth)), smooth.shape)
    return round((float(row) + 0.5) / scale - 0.5), round((float(col) + 0.5) / scale - 0.5)


def crop_box(shape: tuple[int, ...], centre: tuple[int, int], fraction: float = CROP_FRACTION) -> CropBox:
    """A square of side ``fraction`` x the shorter side around ``centre``, kept inside the image."""
    h, w = shape[:2]
    size = max(1, min(h, w, round(fraction * min(h, w))))
    top = min(max(0, centre[0] - size // 2), h - size)
    left = min(max(0, centre[1] - size // 2), w - size)
    return CropBox(int(top), int(left), int(size))


def disc_box(rgb: np.ndarray, mode: str) -> CropBox | None:
    """The crop for a photo under ``mode``: ``None`` when the photo is used whole."""
    if check_mode(mode) == "none" or not is_full_photo(rgb):
        return None
    return crop_box(rgb.shape, locate_disc(rgb))
