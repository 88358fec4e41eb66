"""Fundus (and other 2D colour) photos: PNG, JPEG, TIFF, BMP -> :class:`~engine.io.study.Study` ``"photo"``.

A photo is always ``uint8 (H, W, 3)`` RGB in file order (no EXIF rotation: masks are drawn on the
stored pixels, so the stored order is the one that matches them). Conversions, each documented
because a photo's pixels are what the networks see:

- greyscale (``L``, ``1``) and palette (``P``) images become RGB (grey replicated into R, G, B;
  palette looked up);
- alpha (``RGBA``, ``LA``, ``PA``) is dropped, not blended: the colour values are kept as stored;
- 16-bit (and 32-bit integer) greyscale is scaled to 8 bits by the full range of its bit depth
  ``b``: ``v * 255 / (2**b - 1)``, rounded. ``b`` is the depth the file declares (a PNG's ``sBIT``
  chunk, e.g. 12 for 12-bit sensor data stored in 16 bits) when its values fit in it; otherwise the
  smallest sensor depth of :data:`SENSOR_DEPTHS` (8, 10, 12, 14, 16 bits) that holds the largest
  value, beyond 16 bits its bit length. So 12-bit data (values up to 4095) spans 0..255, a 16-bit
  image is divided by 257, nothing is ever clipped, and an image is never stretched to its own
  maximum: images of one camera keep their relative brightness unless one never reaches the top
  quarter of its range (it is then read as the next smaller depth, 4 times brighter). How a photo
  was scaled is in ``Study.description["scaling"]`` and logged, as a warning when the depth was
  inferred rather than declared; 16-bit RGB is reduced to 8 bits per channel by Pillow;
- float images are scaled from ``[0, 1]`` when they lie in it, else from their own min..max (also
  noted in ``description["scaling"]``);
- CMYK and YCbCr are converted by Pillow; a multi-page TIFF gives its first page (logged).

A photo larger than :data:`MAX_PIXELS` is refused before its pixels are decoded, which also
defuses "decompression bombs" (a tiny file that declares a huge image).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from engine.errors import DataError
from engine.io.guard import MAX_PIXELS as _GUARD_MAX_PIXELS
from engine.io.guard import open_image
from engine.io.study import Study

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
#: Largest photo read, in pixels (100 megapixels: 300 MB as RGB). Fundus cameras give under 25.
MAX_PIXELS = _GUARD_MAX_PIXELS
#: Bit depths of image sensors, tried in order for >8-bit grey photos that do not declare theirs.
SENSOR_DEPTHS = (8, 10, 12, 14, 16)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Pillow format name -> ``Study.source_format``.
_FORMATS = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg", "TIFF": "tiff", "BMP": "bmp", "DIB": "bmp"}


def photo_format(path: PathLike) -> str | None:
    """``"png"``, ``"jpeg"``, ``"tiff"`` or ``"bmp"`` from the file name, else ``None``."""
    suffix = Path(path).suffix.lower()
    return {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".tif": "tiff", ".tiff": "tiff", ".bmp": "bmp"}.get(suffix)


def _png_significant_bits(path: Path) -> int | None:
    """The grey depth a PNG declares in its ``sBIT`` chunk (e.g. 12 for 12-bit data in a 16-bit file), else ``None``.

    Pillow does not report ``sBIT``; the chunks before the first ``IDAT`` are walked here.
    """
    try:
        with path.open("rb") as fh:
            if fh.read(8) != _PNG_SIGNATURE:
                return None
            while True:
                head = fh.read(8)
                if len(head) < 8:
                    return None
                length, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND"):
                    return None
                if kind == b"sBIT":
                    data = fh.read(length)
                    return int(data[0]) if data and 1 <= data[0] <= 16 else None
                fh.seek(length + 4, os.SEEK_CUR)  # the chunk's data and CRC
    except OSError:
        return None


class _Scaling(NamedTuple):
    """How a photo's values were brought to 8 bits: a sentence, and whether it rests on a guess."""

    note: str
    guessed: bool


def _grey_depth(top: int, declared: int | None) -> tuple[int, str]:
    """Bit depth a >8-bit grey image is scaled by, and how it was chosen (see the module docstring)."""
    if declared is not None and top < (1 << declared):
        return declared, "declared by the file"
    how = f"inferred from the largest value {top}"
    if declared is not None:
        how += f"; the {declared} bits the file declares cannot hold it"
    for bits in SENSOR_DEPTHS:
        if top < (1 << bits):
            return bits, how
    return top.bit_length(), how


def _float_to_uint8(values: np.ndarray) -> tuple[np.ndarray, _Scaling]:
    """A float grey image scaled to ``uint8``, and how (see the module docstring)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return np.zeros(values.shape, np.uint8), _Scaling("float grey without finite values: all 0", True)
    lo, hi = float(finite.min()), float(finite.max())
    if lo >= 0.0 and hi <= 1.0:
        lo, hi, scaling = 0.0, 1.0, _Scaling("float grey 0..1 scaled to 0..255", False)
    else:
        scaling = _Scaling(f"float grey scaled from its own range {lo:.6g}..{hi:.6g} to 0..255", True)
    scaled = (np.nan_to_num(values, nan=lo) - lo) / ((hi - lo) or 1.0)
    return np.clip(np.rint(scaled * 255.0), 0, 255).astype(np.uint8), scaling


def _int_to_uint8(values: np.ndarray, container: str, declared_bits: int | None = None
                  ) -> tuple[np.ndarray, _Scaling]:
    """An integer grey image scaled to ``uint8`` by the full range of its bit depth, and how.

    Raises
    ------
    DataError
        When a value is negative (the message lacks the path; the caller adds it).
    """
    if int(values.min(initial=0)) < 0:
        raise DataError("has negative pixel values; a photo stores 0 (dark) to its maximum (bright)")
    top = int(values.max(initial=0))
    bits, how = _grey_depth(top, declared_bits)
    full_scale = (1 << bits) - 1
    scaling = _Scaling(f"{container} grey read as {bits}-bit data ({how}): 0..{full_scale} scaled to 0..255",
                       guessed=bits != declared_bits)
    if bits <= 8:
        return values.astype(np.uint8), scaling
    # round(v * 255 / full_scale) in integers, a block of rows at a time: no float64 (8 bytes per pixel) copy
    # of a large image. full_scale is odd and 2 * v * 255 even, so no value lies half-way: the same as np.rint.
    wide = np.uint32 if full_scale < (1 << 24) else np.uint64
    out = np.empty(values.shape, np.uint8)
    step = max(1, (1 << 22) // max(values.shape[-1], 1))
    for start in range(0, values.shape[0], step):
        block = values[start:start + step].astype(wide)
        out[start:start + step] = (block * 255 + full_scale // 2) // full_scale
    return out, scaling


def _rgb_from_image(img: Image.Image, declared_bits: int | None = None) -> tuple[np.ndarray, _Scaling | None]:
    """Pillow image -> ``uint8 (H, W, 3)`` following the module's conversion rules, and the scaling note."""
    mode = img.mode
    if mode == "RGB":
        return np.asarray(img, dtype=np.uint8), None
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        arr = np.asarray(img)
        if mode == "F":
            grey, scaling = _float_to_uint8(arr.astype(np.float32))
        else:
            container = "16-bit" if mode.startswith("I;16") else "integer"
            grey, scaling = _int_to_uint8(arr, container, declared_bits)
        return np.repeat(grey[:, :, None], 3, axis=2), scaling
    if mode in ("RGBA", "RGBX", "RGBa"):
        return np.asarray(img, dtype=np.uint8)[:, :, :3], None
    if mode in ("LA", "La"):
        grey = np.asarray(img, dtype=np.uint8)[:, :, 0]
        return np.repeat(grey[:, :, None], 3, axis=2), None
    if mode in ("L", "1"):
        grey = np.asarray(img.convert("L"), dtype=np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2), None
    return np.asarray(img.convert("RGB"), dtype=np.uint8), None  # P, PA, CMYK, YCbCr, LAB, HSV


def read_photo(path: PathLike) -> Study:
    """Read a 2D photo as a :class:`Study` of kind ``"photo"`` (``uint8 (H, W, 3)``).

    Raises
    ------
    DataError
        When the file is missing, not an image Pillow can decode (including a non-image file with
        an image suffix), truncated, larger than :data:`MAX_PIXELS`, or empty.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found; check the path")
    # open_image refuses other formats, sizes over MAX_PIXELS and what a decoder would over-allocate
    # (JPEG scans, TIFF tiles) before any pixel is decoded, and words Pillow's errors.
    try:
        with open_image(p, "image", max_pixels=MAX_PIXELS) as img:
            width, height = img.size
            pages = int(getattr(img, "n_frames", 1) or 1)
            fmt = _FORMATS.get(str(img.format), str(img.format or "").lower())
            mode = img.mode
            img.load()
            declared = _png_significant_bits(p) if fmt == "png" and mode.startswith("I") else None
            rgb, scaling = _rgb_from_image(img, declared)
            rgb = np.ascontiguousarray(rgb)
    except DataError as exc:
        if str(exc).startswith(str(p)):
            raise
        raise DataError(f"{p}: {exc}") from exc
    description = {"format": fmt.upper(), "mode": mode, "size": f"{width}x{height}"}
    if pages > 1:
        log.warning("%s: has %d pages; using the first", p, pages)
        description["pages"] = f"{pages} (first used)"
    if scaling is not None:
        # The networks see these 8-bit values: a guessed depth or range is worth a warning.
        log.log(logging.WARNING if scaling.guessed else logging.INFO, "%s: %s", p, scaling.note)
        description["scaling"] = scaling.note
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
