"""Limits checked before a hostile file can cost memory or time, and library errors made engine errors.

Every reader of :mod:`engine.io` (and the bundle reader) goes through these before it decodes:

- **JSON** (:func:`load_json`): nesting deeper than :data:`MAX_JSON_DEPTH` is refused before
  :func:`json.loads` could hit Python's recursion limit; text longer than ``max_chars`` too.
- **Photos and label images** (:func:`open_image`): only :data:`PHOTO_FORMATS` are opened (a JPEG
  2000 file named ``.png`` reaches no decoder); the size Pillow reads from the header is checked
  against :data:`MAX_PIXELS`, a JPEG's scans and a TIFF's tile size against the image, before any
  pixel is decoded; Pillow's own ``DecompressionBombError``, ``SyntaxError: broken PNG file`` and the
  many other types its plugins raise on damaged files become :class:`~engine.errors.DataError`.
- **DICOM**: a deflated dataset (transfer syntax ``1.2.840.10008.1.2.1.99``) is inflated in
  chunks and discarded, only counting, until it ends or passes :data:`MAX_DICOM_INFLATED_BYTES`
  (:func:`check_dicom_inflate`; at most the pixel bytes the header declares plus
  :data:`DEFLATED_HEADER_ALLOWANCE`); ``Rows x Columns x frames x bytes`` is checked against
  :data:`MAX_PIXEL_BYTES` before pixel data is read or a buffer reserved (:func:`check_pixel_budget`);
  every compressed frame's codestream (JPEG, JPEG-LS, JPEG 2000, RLE) is parsed and checked against
  the header, and against a decode bound derived from it, by :mod:`engine.io.codestream`;
  pydicom's ``BytesLengthException`` and
  ``NotImplementedError`` (unknown VR) on a damaged header become DataError
  (:func:`dicom_damage`).
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import DataError, FedSMError
from engine.io.codestream import MAX_JPEG_SCANS

#: Deepest nesting of JSON read (datalists, bundle metadata, provenance): real files use under 10.
MAX_JSON_DEPTH = 64
#: Largest photo or label image, in pixels (100 megapixels; fundus cameras give under 25).
MAX_PIXELS = 100_000_000
#: Largest inflated size of a deflated DICOM dataset (256 MiB; deflate is used for SR and small objects).
MAX_DICOM_INFLATED_BYTES = 256 << 20
#: Largest pixel data one DICOM file may declare, decoded (2 GiB: a 2000-frame 512x512 16-bit CT).
MAX_PIXEL_BYTES = 2 << 30
#: What a deflated dataset may inflate to beyond the pixel bytes its header declares (the rest of its header).
DEFLATED_HEADER_ALLOWANCE = 16 << 20
DEFLATED_SYNTAX = "1.2.840.10008.1.2.1.99"
_INFLATE_CHUNK = 1 << 20


# --- JSON ------------------------------------------------------------------------------------------


def json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of ``text``, brackets inside strings not counted (linear scan)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def load_json(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH, max_chars: int = 100_000_000) -> Any:
    """``json.loads`` with the nesting and size checked first.

    Parameters
    ----------
    text
        The JSON text (bytes are decoded as UTF-8).
    what
        Names the source in messages (``"datalist.json"``, ``"the bundle's FedSM metadata"``).

    Raises
    ------
    DataError
        When the text is not UTF-8, longer than ``max_chars``, nested deeper than ``max_depth`` or
        not JSON (the message says which, with the position).
    """
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{what}: not UTF-8 text ({exc}); save it as UTF-8 JSON") from None
    if not isinstance(text, str):
        raise DataError(f"{what}: holds a {type(text).__name__} where JSON text was expected")
    if len(text) > max_chars:
        raise DataError(f"{what}: {len(text):,} characters of JSON, more than the {max_chars:,} FedSM reads")
    depth = json_depth(text)
    if depth > max_depth:
        raise DataError(f"{what}: JSON nested {depth} levels deep, more than the {max_depth} FedSM reads; the file is "
                        "damaged or was not written for FedSM")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{what}: not valid JSON ({exc})") from None


# --- images (Pillow) -------------------------------------------------------------------------------

#: What Pillow's plugins raise on damaged files (found by the fuzz tests): all mean "cannot decode".
PIL_DAMAGE = (OSError, ValueError, SyntaxError, EOFError, struct.error, ZeroDivisionError, KeyError, TypeError,
              IndexError, MemoryError, OverflowError)


#: The image formats FedSM reads through Pillow (``Image.open(..., formats=...)``): a file of any other
#: format Pillow knows (JPEG 2000, GIF, PSD, ...) is not opened, whatever its name, so no other decoder runs.
PHOTO_FORMATS = ("PNG", "JPEG", "MPO", "TIFF", "BMP", "DIB")
#: A TIFF tile may hold at most this many times the image's pixels (or 1 megapixel, whichever is larger):
#: libtiff reserves a whole tile's buffer, however small the image it declares.
MAX_TIFF_TILE_RATIO = 4


def _check_declared(path: Path, img: Any, what: str) -> None:
    """What a photo's decoder will allocate, beyond width x height: JPEG scans, TIFF tiles."""
    width, height = img.size
    if img.format in ("JPEG", "MPO"):
        with path.open("rb") as fh:
            scans = fh.read().count(b"\xff\xda")
        if scans > MAX_JPEG_SCANS:
            raise DataError(f"{path}: the {what} is a JPEG of {scans:,} scans, more than the {MAX_JPEG_SCANS} FedSM "
                            f"decodes (each scan is a pass over the whole {width}x{height} image); it is damaged or "
                            "hostile — re-export it as PNG")
    if img.format == "TIFF":
        tags = getattr(img, "tag_v2", {})
        tile = (int(tags.get(322) or 0), int(tags.get(323) or 0))  # TileWidth, TileLength
        if tile[0] * tile[1] > max(MAX_TIFF_TILE_RATIO * width * height, 1 << 20):
            raise DataError(f"{path}: the {what} is a {width}x{height} TIFF whose tiles are {tile[0]}x{tile[1]} "
                            "pixels; a decoder would reserve a whole tile — the file is damaged or hostile, re-export "
                            "it as PNG")


@contextlib.contextmanager
def open_image(path: Path, what: str = "image", max_pixels: int = MAX_PIXELS) -> Iterator[Any]:
    """``PIL.Image.open(path)`` whose declared size is checked before anything is decoded; errors as DataError.

    Only :data:`PHOTO_FORMATS` are opened. Before any pixel is decoded: width x height against
    ``max_pixels`` (Pillow stores at most 4 bytes per pixel, so a photo costs at most 400 MB
    decoded), a JPEG's number of scans against :data:`MAX_JPEG_SCANS`, a TIFF's tile size against
    its image (:data:`MAX_TIFF_TILE_RATIO`). Use the image inside the ``with`` block (``load()``,
    ``convert()``, ``np.asarray``): decoding errors raised there are translated too. A
    :class:`DataError` raised inside passes unchanged.

    Raises
    ------
    DataError
        When the file is not a PNG, JPEG, TIFF or BMP image, declares more than ``max_pixels``
        pixels or none, more JPEG scans or larger TIFF tiles than allowed, or is damaged or truncated.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # The size is checked here, before decoding; Pillow's own warning adds nothing.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            Image.init()  # registers every plugin, so each of PHOTO_FORMATS can be named
            with Image.open(path, formats=[f for f in PHOTO_FORMATS if f in Image.OPEN]) as img:
                width, height = img.size
                if width * height > max_pixels:
                    raise DataError(f"{path}: the {what} is {width}x{height} pixels ({width * height / 1e6:.1f} "
                                    f"megapixels), more than the {max_pixels / 1e6:g} megapixels FedSM reads; "
                                    "downscale it first")
                if width <= 0 or height <= 0:
                    raise DataError(f"{path}: the {what} has no pixels ({width}x{height}); re-export it")
                _check_declared(Path(path), img, what)
                yield img
    except FedSMError:
        raise
    except Image.DecompressionBombError as exc:
        raise DataError(f"{path}: the {what} declares more pixels than FedSM reads ({exc}); downscale it "
                        "first") from None
    except UnidentifiedImageError:
        raise DataError(f"{path}: not an image file Pillow can read (the content is not PNG, JPEG, TIFF or BMP); "
                        f"check the {what} or re-export it as PNG") from None
    except PIL_DAMAGE as exc:
        raise DataError(f"{path}: the {what} cannot be decoded ({type(exc).__name__}: {exc}); the file is damaged "
                        "or truncated, re-export it as PNG") from None


# --- DICOM -----------------------------------------------------------------------------------------


def _pydicom_damage() -> tuple[type[BaseException], ...]:
    from pydicom.errors import BytesLengthException, InvalidDicomError

    # NotImplementedError: an unknown VR; the rest: values whose bytes do not fit their VR.
    return (BytesLengthException, InvalidDicomError, NotImplementedError, struct.error, UnicodeDecodeError,
            OverflowError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, zlib.error)


@contextlib.contextmanager
def dicom_damage(path: Path | str) -> Iterator[None]:
    """Turn what pydicom raises on a damaged header (wrong value lengths, unknown VRs, ...) into DataError.

    Engine errors pass unchanged. Wraps code that reads values of an already parsed header: pydicom
    converts each value when it is first used, so damage shows up there, not in ``dcmread``.
    """
    try:
        yield
    except FedSMError:
        raise
    except MemoryError as exc:
        raise DataError(f"{path}: the DICOM file declares more data than fits in memory ({exc}); it is damaged "
                        "or hostile — remove it from the folder") from None
    except _pydicom_damage() as exc:
        raise DataError(f"{path}: damaged DICOM header ({type(exc).__name__}: {exc}); remove the file from the "
                        "folder or copy the series again") from None


def _meta_transfer_syntax(head: bytes) -> tuple[str, int] | None:
    """A Part 10 file's TransferSyntaxUID and where its dataset starts, from the meta group's bytes."""
    if len(head) < 144 or head[128:132] != b"DICM" or head[132:136] != b"\x02\x00\x00\x00":
        return None
    (group_length,) = struct.unpack("<I", head[140:144])
    end = 144 + group_length
    pos, syntax = 144, ""
    while pos + 8 <= min(end, len(head)):
        group, element = struct.unpack("<HH", head[pos:pos + 4])
        vr = head[pos + 4:pos + 6]
        if vr in (b"OB", b"OW", b"OF", b"SQ", b"UT", b"UN"):
            if pos + 12 > len(head):
                return None
            (length,) = struct.unpack("<I", head[pos + 8:pos + 12])
            start = pos + 12
        else:
            (length,) = struct.unpack("<H", head[pos + 6:pos + 8])
            start = pos + 8
        if group != 0x0002:
            break
        if element == 0x0010:
            syntax = head[start:start + length].decode("ascii", "replace").strip(" \x00")
        pos = start + length
    return syntax, end


def _declared_pixel_bytes(prefix: bytes) -> int | None:
    """Pixel bytes an inflated dataset's header declares (Rows x Columns x frames x samples x bytes), from its start.

    ``None`` when the first bytes do not reach group 0028 or cannot be parsed (the caller then keeps
    the fixed cap).
    """
    from pydicom.filereader import read_dataset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = read_dataset(io.BytesIO(prefix), is_implicit_VR=False, is_little_endian=True,
                              stop_when=lambda tag, vr, length: tag > 0x00280100)
            rows, cols = int(ds.get("Rows") or 0), int(ds.get("Columns") or 0)
            frames = int(ds.get("NumberOfFrames") or 1)
            samples = int(ds.get("SamplesPerPixel") or 1)
            bits = int(ds.get("BitsAllocated") or 16)
    except Exception:  # a prefix cut inside an element, or a damaged header: pydicom reports it later
        return None
    if rows <= 0 or cols <= 0:
        return None
    return rows * cols * max(frames, 1) * max(samples, 1) * max((bits + 7) // 8, 1)


def check_dicom_inflate(path: Path, limit: int | None = None) -> None:
    """Refuse a deflated DICOM whose dataset inflates past its bound, counting without keeping it.

    The bound is ``limit`` (default :data:`MAX_DICOM_INFLATED_BYTES`), and, when the dataset's
    first MiB declares an image, the pixel bytes its header declares plus
    :data:`DEFLATED_HEADER_ALLOWANCE`, whichever is smaller: pydicom inflates the whole dataset
    into memory, so a 512x512 slice cannot make it hold more than about 17 MiB. Files of any other
    transfer syntax pass at once (only the first 4 KiB are read).

    Raises
    ------
    DataError
        When the deflated stream inflates past the bound (a "zip bomb") or is not valid deflate data.
    """
    limit = MAX_DICOM_INFLATED_BYTES if limit is None else limit
    try:
        with path.open("rb") as fh:
            found = _meta_transfer_syntax(fh.read(4096))
            if found is None or found[0] != DEFLATED_SYNTAX:
                return
            fh.seek(found[1])
            inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            total = 0
            prefix: bytearray | None = bytearray()
            declared: int | None = None
            while not inflater.eof:
                data = fh.read(_INFLATE_CHUNK)
                if not data:
                    return  # a truncated stream: pydicom reports it
                while data and not inflater.eof:
                    chunk = inflater.decompress(data, _INFLATE_CHUNK)
                    total += len(chunk)
                    if prefix is not None:
                        prefix += chunk[:_INFLATE_CHUNK - len(prefix)]
                        if len(prefix) >= _INFLATE_CHUNK or inflater.eof:
                            declared = _declared_pixel_bytes(bytes(prefix))
                            prefix = None
                            if declared is not None:
                                limit = min(limit, declared + DEFLATED_HEADER_ALLOWANCE)
                    if total > limit:
                        said = (f", while its header declares {declared:,} bytes of pixels" if declared is not None
                                else "")
                        raise DataError(f"{path}: the deflate-compressed DICOM dataset inflates to more than "
                                        f"{limit / 2**20:.0f} MiB (a 'zip bomb'){said}; FedSM does not read it — "
                                        "remove the file or re-export the series uncompressed")
                    data = inflater.unconsumed_tail
    except zlib.error as exc:
        raise DataError(f"{path}: the deflate-compressed DICOM dataset is damaged ({exc}); copy the series "
                        "again") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def check_pixel_budget(path: Path | str, rows: int, columns: int, frames: int, bits: int, samples: int = 1,
                       limit: int | None = None) -> int:
    """The decoded size of a file's pixel data from its header, refused past ``limit`` bytes.

    Returns
    -------
    int
        ``rows * columns * frames * samples * bytes per sample``.

    Raises
    ------
    DataError
        When a dimension is not positive or the decoded pixels would exceed the limit.
    """
    limit = MAX_PIXEL_BYTES if limit is None else limit
    if rows <= 0 or columns <= 0 or frames <= 0:
        raise DataError(f"{path}: the header declares {frames} frame(s) of {columns}x{rows} pixels; it is damaged")
    size = rows * columns * frames * max(samples, 1) * max((bits + 7) // 8, 1)
    if size > limit:
        raise DataError(f"{path}: the header declares {frames} frame(s) of {columns}x{rows} pixels "
                        f"({size / 2**30:.1f} GiB decoded), more than the {limit / 2**30:.0f} GiB FedSM reads from one "
                        "file; it is damaged, or crop/downsample the series first")
    return size


def codestream_size(fragment: bytes) -> tuple[int, int] | None:
    """``(columns, rows)`` a compressed frame declares: JPEG 2000 SIZ or JPEG SOFn; ``None`` otherwise."""
    if fragment[:4] == b"\xff\x4f\xff\x51" and len(fragment) >= 24:  # J2K codestream: SOC then SIZ
        xsiz, ysiz, xosiz, yosiz = struct.unpack(">IIII", fragment[8:24])
        return max(xsiz - xosiz, 0), max(ysiz - yosiz, 0)
    if fragment[:4] == b"\x00\x00\x00\x0c":  # JP2 box wrapper: find the codestream
        at = fragment.find(b"\xff\x4f\xff\x51")
        return codestream_size(fragment[at:]) if at >= 0 else None
    if fragment[:2] == b"\xff\xd8":  # JPEG: walk the markers to the frame header
        pos = 2
        while pos + 4 <= len(fragment):
            if fragment[pos] != 0xFF:
                return None
            marker = fragment[pos + 1]
            if marker == 0xFF:
                pos += 1
                continue
            (length,) = struct.unpack(">H", fragment[pos + 2:pos + 4])
            if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xF7):
                if pos + 9 > len(fragment):
                    return None
                height, width = struct.unpack(">HH", fragment[pos + 5:pos + 9])
                return width, height
            pos += 2 + length
    return None
