"""Fundus (and other 2D colour) photos: PNG, JPEG, TIFF, BMP -> :class:`~engine.io.study.Study` ``"photo"``.

A photo is always ``uint8 (H, W, 3)`` RGB in file order (no EXIF rotation: masks are drawn on the
stored pixels, so the stored order is the one that matches them). Conversions, each documented
because a photo's pixels are what the networks see:

- greyscale (``L``, ``1``) and palette (``P``) images become RGB (grey replicated into R, G, B;
  palette looked up);
- alpha (``RGBA``, ``LA``, ``PA``) is dropped, not blended: the colour values are kept as stored;
- 16-bit (and 32-bit integer) greyscale is scaled to 8 bits by its bit depth, inferred from the
  largest value (a 12-bit image with values up to 4095 is divided by 4095/255), so a 16-bit PNG
  does not turn white when clipped; 16-bit RGB is reduced to 8 bits per channel by Pillow;
- float images are scaled from ``[0, 1]`` when they lie in it, else from their min..max;
- CMYK and YCbCr are converted by Pillow; a multi-page TIFF gives its first page (logged).

A photo larger than :data:`MAX_PIXELS` is refused before its pixels are decoded, which also
defuses "decompression bombs" (a tiny file that declares a huge image).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import DataError
from engine.io.study import Study

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
#: Largest photo read, in pixels (100 megapixels: 300 MB as RGB). Fundus cameras give under 25.
MAX_PIXELS = 100_000_000
#: Pillow format name -> ``Study.source_format``.
_FORMATS = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg", "TIFF": "tiff", "BMP": "bmp", "DIB": "bmp"}


def photo_format(path: PathLike) -> str | None:
    """``"png"``, ``"jpeg"``, ``"tiff"`` or ``"bmp"`` from the file name, else ``None``."""
    suffix = Path(path).suffix.lower()
    return {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".tif": "tiff", ".tiff": "tiff", ".bmp": "bmp"}.get(suffix)


def _to_uint8_grey(values: np.ndarray) -> np.ndarray:
    """A single-channel integer or float image scaled to ``uint8`` (see the module docstring)."""
    if np.issubdtype(values.dtype, np.floating):
        finite = values[np.isfinite(values)]
        if finite.size == 0:
            return np.zeros(values.shape, np.uint8)
        lo, hi = float(finite.min()), float(finite.max())
        if lo >= 0.0 and hi <= 1.0:
            lo, hi = 0.0, 1.0
        scaled = (np.nan_to_num(values, nan=lo) - lo) / ((hi - lo) or 1.0)
        return np.clip(np.rint(scaled * 255.0), 0, 255).astype(np.uint8)
    top = int(values.max(initial=0))
    if int(values.min(initial=0)) < 0:
        raise DataError("has negative pixel values; a photo stores 0 (dark) to its maximum (bright)")
    if top <= 255:
        return values.astype(np.uint8)
    full_scale = (1 << top.bit_length()) - 1  # 12-bit data up to 4095 -> 4095, 16-bit -> 65535
    return np.rint(values.astype(np.float64) * (255.0 / full_scale)).astype(np.uint8)


def _rgb_from_image(img: Image.Image) -> np.ndarray:
    """Pillow image -> ``uint8 (H, W, 3)`` following the module's conversion rules."""
    mode = img.mode
    if mode == "RGB":
        return np.asarray(img, dtype=np.uint8)
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        arr = np.asarray(img)
        grey = _to_uint8_grey(arr.astype(np.float32) if mode == "F" else arr.astype(np.int64))
        return np.repeat(grey[:, :, None], 3, axis=2)
    if mode in ("RGBA", "RGBX", "RGBa"):
        return np.asarray(img, dtype=np.uint8)[:, :, :3]
    if mode in ("LA", "La"):
        grey = np.asarray(img, dtype=np.uint8)[:, :, 0]
        return np.repeat(grey[:, :, None], 3, axis=2)
    if mode in ("L", "1"):
        grey = np.asarray(img.convert("L"), dtype=np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    return np.asarray(img.convert("RGB"), dtype=np.uint8)  # P, PA, CMYK, YCbCr, LAB, HSV


def read_photo(path: PathLike) -> Study:
    """Read a 2D photo as a :class:`Study` of kind ``"photo"`` (``uint8 (H, W, 3)``).

    Raises
    ------
    DataError
        When the file is missing, not an image Pillow can decode (including a non-image file with
        an image suffix), truncated, larger than :data:`MAX_PIXELS`, or empty.
    """
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found; check the path")
    try:
        with warnings.catch_warnings():
            # We enforce MAX_PIXELS ourselves, before decoding; Pillow's own warning adds nothing.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(p) as img:
                width, height = img.size
                if width * height > MAX_PIXELS:
                    raise DataError(f"{p}: the image is {width}x{height} pixels ({width * height / 1e6:.1f} "
                                    f"megapixels), more than the {MAX_PIXELS / 1e6:g} megapixels FedSM reads; "
                                    "downscale it first")
                if width == 0 or height == 0:
                    raise DataError(f"{p}: the image has no pixels ({width}x{height}); re-export it")
                pages = int(getattr(img, "n_frames", 1) or 1)
                fmt = _FORMATS.get(str(img.format), str(img.format or "").lower())
                mode = img.mode
                img.load()
                rgb = np.ascontiguousarray(_rgb_from_image(img))
    except Image.DecompressionBombError as exc:
        raise DataError(f"{p}: the image declares more pixels than FedSM reads ({exc}); downscale it first") from exc
    except UnidentifiedImageError as exc:
        raise DataError(f"{p}: not an image file Pillow can read (the content is not PNG, JPEG, TIFF or BMP); "
                        "check the file or re-export it as PNG") from exc
    except DataError as exc:
        if str(exc).startswith(str(p)):
            raise
        raise DataError(f"{p}: {exc}") from exc
    except (OSError, ValueError, SyntaxError, MemoryError) as exc:
        raise DataError(f"{p}: the image cannot be decoded ({exc}); the file is damaged or truncated, "
                        "re-export it as PNG") from exc
    description = {"format": fmt.upper(), "mode": mode, "size": f"{width}x{height}"}
    if pages > 1:
        log.warning("%s: has %d pages; using the first", p, pages)
        description["pages"] = f"{pages} (first used)"
    return Study(
        array=rgb,
        kind="photo",
        affine=np.eye(4),
        spacing=(1.0, 1.0),
        modality="OP",
        window=(127.5, 255.0),
        source=p,
        source_format=fmt,
        description=description,
    )
