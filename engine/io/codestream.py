"""What a compressed DICOM frame declares, read from its own bytes, checked against the DICOM header.

A decoder allocates what the *codestream* says, not what ``Rows``/``Columns`` say: a JPEG 2000 frame
that declares 43,776 tiles of 2x3 pixels makes OpenJPEG (inside GDCM and inside Pillow) reserve
per-tile coding parameters for each, about 500 MB for a 512x512 slice; an RLE segment of 2-byte
runs decodes to 64 times its size whatever the header says. So before any decoder sees a frame,
:func:`check_frame` parses what the frame declares and refuses it (:class:`~engine.errors.DataError`
naming the file, the frame, both values and what to do) when

- the frame's codec is not one FedSM checks (:data:`CHECKED_SYNTAXES`) or its bytes are not that
  codec's (a JPEG stream under a JPEG 2000 transfer syntax);
- its size, number of components or precision disagree with ``Columns x Rows``,
  ``SamplesPerPixel`` and ``BitsAllocated``;
- decoding it would need more than :meth:`FrameHeader.decode_limit`, a bound derived from the
  header alone: :data:`DECODE_BYTES_PER_SAMPLE` bytes per declared pixel sample plus
  :data:`DECODE_SLACK`. Per codec:

  * **JPEG 2000** (and HTJ2K): SIZ (size, image and tile offsets, tile size, components,
    precision, sub-sampling) and COD (resolution levels, layers, code-block size) of the main
    header; the estimate is ``pixels x components x 8`` (OpenJPEG decodes into 32-bit
    tile-component buffers and copies them out) plus :data:`J2K_TILE_BYTES` per tile;
  * **JPEG** (baseline, extended, lossless) and **JPEG-LS**: the frame header (SOFn / SOF55:
    precision, size, components, sampling factors; a zero height, which only a later DNL marker
    would set, is refused) and the number of scans, at most :data:`MAX_JPEG_SCANS` (each
    progressive scan is a pass over the whole image: a CPU bomb, as libjpeg-turbo's own scan
    limit documents). libjpeg's and CharLS's memory is proportional to the size they declare;
  * **RLE**: the 64-byte header (segment count = samples x bytes per sample, offsets inside the
    frame and increasing) and each segment's compressed length, at most
    :data:`RLE_MAX_EXPANSION` times the bytes it must decode to plus one byte per row (RLE never
    grows data by more than one byte in 128, plus a run break per row), so a run-length bomb
    cannot make pydicom's segment decoder, which decodes a segment whole before comparing its
    length, build more than about 64 times a segment's declared bytes.

Deflated datasets (``1.2.840.10008.1.2.1.99``) are bounded while inflating
(:func:`engine.io.guard.check_dicom_inflate`); uncompressed pixel data longer than the header says is
refused before it is read (:func:`check_native_length`).
"""

from __future__ import annotations

import itertools
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import DataError

PathLike = str | os.PathLike[str]

#: Decoding may use this many bytes per pixel sample the DICOM header declares (a 512x512 slice of one
#: sample: 4 MiB, eight times its 16-bit pixels), plus :data:`DECODE_SLACK`.
DECODE_BYTES_PER_SAMPLE = 16
#: Fixed allowance on top of the per-sample bound (decoder set-up, a few tiles of a tiny image).
DECODE_SLACK = 1 << 20
#: OpenJPEG's memory per JPEG 2000 tile beyond its pixels (coding parameters of the tile; measured
#: 9.4 KiB per tile with OpenJPEG 2.5 in GDCM and Pillow: 43,776 tiles cost 413 MB).
J2K_TILE_BYTES = 16 << 10
#: Most scans a JPEG frame may hold (libjpeg-turbo's documentation suggests 500 as a scan limit).
MAX_JPEG_SCANS = 500
#: An RLE segment's compressed bytes may be this many times the bytes it decodes to (plus a byte per row).
RLE_MAX_EXPANSION = 1.02

_JPEG_SYNTAXES = {
    "1.2.840.10008.1.2.4.50": "JPEG baseline", "1.2.840.10008.1.2.4.51": "JPEG extended",
    "1.2.840.10008.1.2.4.57": "JPEG lossless", "1.2.840.10008.1.2.4.70": "JPEG lossless (SV1)",
    "1.2.840.10008.1.2.4.80": "JPEG-LS lossless", "1.2.840.10008.1.2.4.81": "JPEG-LS near-lossless",
}
_J2K_SYNTAXES = {
    "1.2.840.10008.1.2.4.90": "JPEG 2000 lossless", "1.2.840.10008.1.2.4.91": "JPEG 2000",
    "1.2.840.10008.1.2.4.201": "HTJ2K lossless", "1.2.840.10008.1.2.4.202": "HTJ2K lossless (RPCL)",
    "1.2.840.10008.1.2.4.203": "HTJ2K",
}
RLE_SYNTAX = "1.2.840.10008.1.2.5"
#: Compressed transfer syntaxes whose frames :func:`check_frame` parses; FedSM decodes no others.
CHECKED_SYNTAXES = {**_JPEG_SYNTAXES, **_J2K_SYNTAXES, RLE_SYNTAX: "RLE lossless"}
_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xF7))
_WHAT_TO_DO = "the file is damaged or hostile — remove it from the folder, or export the series again uncompressed"


@dataclass(frozen=True)
class FrameHeader:
    """What the DICOM header says one frame holds, and what decoding it may cost."""

    rows: int
    columns: int
    samples: int
    bits_allocated: int

    @property
    def pixels(self) -> int:
        return self.rows * self.columns

    @property
    def bytes_per_sample(self) -> int:
        return max((self.bits_allocated + 7) // 8, 1)

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the decoded frame as the header declares it."""
        return self.pixels * self.samples * self.bytes_per_sample

    @property
    def decode_limit(self) -> int:
        """Most bytes a decoder may need for this frame: the bound every codestream is checked against."""
        return self.pixels * max(self.samples, 1) * DECODE_BYTES_PER_SAMPLE + DECODE_SLACK

    def describe(self) -> str:
        return (f"Columns x Rows {self.columns}x{self.rows}, SamplesPerPixel {self.samples}, BitsAllocated "
                f"{self.bits_allocated}")


@dataclass(frozen=True)
class J2KHeader:
    """The main header of a JPEG 2000 codestream: SIZ, and COD when present."""

    width: int
    height: int
    x_offset: int
    y_offset: int
    tile_width: int
    tile_height: int
    tile_x_offset: int
    tile_y_offset: int
    precisions: tuple[int, ...]
    subsampling: tuple[tuple[int, int], ...]
    levels: int | None = None
    layers: int | None = None
    codeblock: tuple[int, int] | None = None

    @property
    def size(self) -> tuple[int, int]:
        return max(self.width - self.x_offset, 0), max(self.height - self.y_offset, 0)

    @property
    def components(self) -> int:
        return len(self.precisions)

    @property
    def tiles(self) -> int:
        across = -(-(self.width - self.tile_x_offset) // self.tile_width) if self.tile_width else 0
        down = -(-(self.height - self.tile_y_offset) // self.tile_height) if self.tile_height else 0
        return max(across, 0) * max(down, 0)

    def decode_estimate(self) -> int:
        """Bytes OpenJPEG needs: 32-bit tile-component buffers and their copy out, plus each tile's parameters."""
        width, height = self.size
        return width * height * self.components * 8 + self.tiles * J2K_TILE_BYTES


@dataclass(frozen=True)
class JpegHeader:
    """A JPEG (SOFn) or JPEG-LS (SOF55) frame header and the number of scans of the frame."""

    marker: int
    precision: int
    width: int
    height: int
    sampling: tuple[tuple[int, int], ...]
    scans: int

    @property
    def components(self) -> int:
        return len(self.sampling)

    @property
    def kind(self) -> str:
        return "JPEG-LS" if self.marker == 0xF7 else "JPEG"


class _Malformed(ValueError):
    """The codestream's own structure is broken (raised by the parsers, worded by :func:`check_frame`)."""


# --- parsers ---------------------------------------------------------------------------------------


def _j2k_codestream(data: bytes) -> bytes | None:
    """The raw codestream of a JPEG 2000 frame: itself, or the one inside a JP2 wrapper; ``None`` otherwise."""
    if data[:4] == b"\xff\x4f\xff\x51":
        return data
    if data[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n":
        at = data.find(b"\xff\x4f\xff\x51")
        return data[at:] if at >= 0 else None
    return None


def parse_j2k(data: bytes) -> J2KHeader:
    """The main header of a JPEG 2000 codestream (raw, or wrapped in JP2 boxes).

    Raises
    ------
    ValueError
        When the bytes are not a JPEG 2000 codestream or its SIZ or COD segment is malformed.
    """
    stream = _j2k_codestream(data)
    if stream is None:
        raise _Malformed("it does not start with a JPEG 2000 codestream (SOC, SIZ)")
    if len(stream) < 6 + 38:
        raise _Malformed("its SIZ segment is cut short")
    (length,) = struct.unpack(">H", stream[4:6])
    fields = struct.unpack(">HIIIIIIIIH", stream[6:6 + 36])
    _, width, height, x_off, y_off, tile_w, tile_h, tile_x, tile_y, count = fields
    if count < 1 or length != 38 + 3 * count or len(stream) < 4 + length:
        raise _Malformed(f"its SIZ segment is malformed (length {length} for {count} component(s))")
    comps = [stream[42 + 3 * i:45 + 3 * i] for i in range(count)]
    precisions = tuple((c[0] & 0x7F) + 1 for c in comps)
    subsampling = tuple((c[1], c[2]) for c in comps)
    header = J2KHeader(width, height, x_off, y_off, tile_w, tile_h, tile_x, tile_y, precisions, subsampling)
    # The main header's other segments, up to the first tile-part (SOT): COD sets levels, layers and blocks.
    pos = 4 + length
    while pos + 4 <= len(stream):
        marker, seg_length = struct.unpack(">HH", stream[pos:pos + 4])
        if marker in (0xFF90, 0xFFD9) or marker >> 8 != 0xFF or seg_length < 2:
            break
        if marker == 0xFF52 and seg_length >= 12 and pos + 2 + seg_length <= len(stream):
            layers = struct.unpack(">H", stream[pos + 6:pos + 8])[0]
            levels, xcb, ycb = stream[pos + 9], stream[pos + 10], stream[pos + 11]
            header = J2KHeader(*[getattr(header, f) for f in (
                "width", "height", "x_offset", "y_offset", "tile_width", "tile_height", "tile_x_offset",
                "tile_y_offset", "precisions", "subsampling")], levels=levels, layers=layers, codeblock=(xcb, ycb))
        pos += 2 + seg_length
    return header


def parse_jpeg(data: bytes) -> JpegHeader:
    """The frame header (SOFn, or SOF55 for JPEG-LS) of a JPEG stream and its number of scans.

    Raises
    ------
    ValueError
        When the bytes are not a JPEG stream or it has no readable frame header.
    """
    if data[:2] != b"\xff\xd8":
        raise _Malformed("it does not start with a JPEG stream (SOI)")
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise _Malformed(f"its marker segments are broken at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        (length,) = struct.unpack(">H", data[pos + 2:pos + 4])
        if marker in _JPEG_SOF:
            if length < 8 or pos + 2 + length > len(data):
                raise _Malformed("its frame header is cut short")
            precision = data[pos + 4]
            height, width = struct.unpack(">HH", data[pos + 5:pos + 9])
            count = data[pos + 9]
            if count < 1 or length != 8 + 3 * count:
                raise _Malformed(f"its frame header is malformed (length {length} for {count} component(s))")
            sampling = tuple((data[pos + 11 + 3 * i] >> 4, data[pos + 11 + 3 * i] & 0x0F) for i in range(count))
            # Entropy-coded data stuffs every 0xFF with 0x00, so each FF DA left in the stream starts a scan.
            return JpegHeader(marker, precision, width, height, sampling, data.count(b"\xff\xda", pos))
        if marker in (0xD9, 0xDA):  # end of image or a scan before any frame header
            break
        pos += 2 + length
    raise _Malformed("it has no frame header (SOFn) before its first scan")


def parse_rle(data: bytes) -> list[int]:
    """The segment offsets of an RLE frame's 64-byte header.

    Raises
    ------
    ValueError
        When the header is cut short, declares 0 or more than 15 segments, or its offsets do not
        start at 64, increase, and stay inside the frame.
    """
    if len(data) < 64:
        raise _Malformed(f"its 64-byte RLE header is cut short ({len(data)} bytes)")
    count, *offsets = struct.unpack("<16I", data[:64])
    if not 1 <= count <= 15:
        raise _Malformed(f"its RLE header declares {count} segments (1 to 15 are possible)")
    used = offsets[:count]
    if used[0] != 64 or any(b <= a for a, b in itertools.pairwise(used)) or used[-1] >= len(data):
        raise _Malformed(f"its RLE segment offsets {used} do not start at 64, increase and stay inside the "
                         f"frame's {len(data)} bytes")
    return used


# --- checks ----------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_frame(path: PathLike, frame: bytes, header: FrameHeader, syntax: str, index: int = 0,
                frames: int = 1) -> None:
    """Refuse a compressed frame whose codestream disagrees with the header or would cost more than it allows.

    Parameters
    ----------
    path
        The file, for messages.
    frame
        The frame's bytes (its fragments joined), as pydicom's ``generate_frames`` gives them.
    header
        What the DICOM header says the frame holds.
    syntax
        The file's transfer syntax UID.
    index, frames
        Which frame of how many (messages name the frame of a multi-frame file).

    Raises
    ------
    DataError
        Naming the file (and frame), what the codestream declares against the header, and what to do.
    """
    where = f"{path}: frame {index + 1} of {frames}" if frames > 1 else str(path)
    name = CHECKED_SYNTAXES.get(syntax)
    if name is None:
        raise DataError(f"{path}: its pixel data is compressed with transfer syntax {syntax or 'unknown'}, which FedSM "
                        f"does not decode (it reads {', '.join(sorted(set(CHECKED_SYNTAXES.values())))} and "
                        "uncompressed data); export the series uncompressed")
    try:
        if syntax in _J2K_SYNTAXES:
            _check_j2k(where, parse_j2k(frame), header)
        elif syntax in _JPEG_SYNTAXES:
            _check_jpeg(where, parse_jpeg(frame), header, syntax)
        else:
            _check_rle(where, frame, parse_rle(frame), header)
    except _Malformed as exc:
        raise DataError(f"{where}: the {name} frame cannot be used: {exc}; {_WHAT_TO_DO}") from None


def _check_j2k(where: str, j2k: J2KHeader, header: FrameHeader) -> None:
    declared = f"{j2k.size[0]}x{j2k.size[1]} pixels"
    if j2k.size != (header.columns, header.rows):
        raise DataError(f"{where}: the compressed frame is {declared} but the header says "
                        f"{header.columns}x{header.rows}; the file is damaged — copy the series again")
    if j2k.components != header.samples:
        raise DataError(f"{where}: the JPEG 2000 codestream declares {j2k.components} components but the header "
                        f"says {header.describe()}; {_WHAT_TO_DO}")
    top = max(j2k.precisions)
    if top > max(header.bits_allocated, 8):
        raise DataError(f"{where}: the JPEG 2000 codestream declares {top}-bit samples but the header says "
                        f"{header.describe()}; {_WHAT_TO_DO}")
    if any(not 1 <= dx <= 4 or not 1 <= dy <= 4 for dx, dy in j2k.subsampling):
        raise DataError(f"{where}: the JPEG 2000 codestream declares component sub-sampling "
                        f"{list(j2k.subsampling)} (1 to 4 is possible); {_WHAT_TO_DO}")
    if (j2k.tile_width < 1 or j2k.tile_height < 1 or j2k.tile_x_offset > j2k.x_offset
            or j2k.tile_y_offset > j2k.y_offset or j2k.tile_x_offset + j2k.tile_width <= j2k.x_offset
            or j2k.tile_y_offset + j2k.tile_height <= j2k.y_offset):
        raise DataError(f"{where}: the JPEG 2000 codestream's tile grid is invalid (tiles of {j2k.tile_width}x"
                        f"{j2k.tile_height} at offset {j2k.tile_x_offset},{j2k.tile_y_offset}, image offset "
                        f"{j2k.x_offset},{j2k.y_offset}); {_WHAT_TO_DO}")
    if j2k.levels is not None and j2k.levels > 32:
        raise DataError(f"{where}: the JPEG 2000 codestream declares {j2k.levels} resolution levels (at most 32 are "
                        f"possible); {_WHAT_TO_DO}")
    if j2k.codeblock is not None and (max(j2k.codeblock) > 8 or sum(j2k.codeblock) > 8):
        raise DataError(f"{where}: the JPEG 2000 codestream declares code-blocks of 2^{j2k.codeblock[0] + 2} x "
                        f"2^{j2k.codeblock[1] + 2} (at most 4096 samples are possible); {_WHAT_TO_DO}")
    if j2k.layers is not None and j2k.layers < 1:
        raise DataError(f"{where}: the JPEG 2000 codestream declares no quality layers; {_WHAT_TO_DO}")
    need, limit = j2k.decode_estimate(), header.decode_limit
    if need > limit:
        raise DataError(f"{where}: the JPEG 2000 codestream declares {j2k.tiles:,} tiles of {j2k.tile_width}x"
                        f"{j2k.tile_height} pixels for an image of {declared}; decoding it would need about "
                        f"{_mib(need)}, more than the {_mib(limit)} its header ({header.describe()}) allows; "
                        f"{_WHAT_TO_DO}")


def _check_jpeg(where: str, jpeg: JpegHeader, header: FrameHeader, syntax: str) -> None:
    if (jpeg.marker == 0xF7) != syntax.startswith("1.2.840.10008.1.2.4.8"):
        expected = "JPEG-LS" if syntax.startswith("1.2.840.10008.1.2.4.8") else "JPEG"
        raise DataError(f"{where}: the transfer syntax says {expected} but the frame is a {jpeg.kind} stream; "
                        f"{_WHAT_TO_DO}")
    if jpeg.height == 0:
        raise DataError(f"{where}: the {jpeg.kind} frame header declares a height of 0 (set later by a DNL marker, "
                        f"which FedSM does not accept) against the header's {header.describe()}; {_WHAT_TO_DO}")
    if (jpeg.width, jpeg.height) != (header.columns, header.rows):
        raise DataError(f"{where}: the compressed frame is {jpeg.width}x{jpeg.height} pixels but the header says "
                        f"{header.columns}x{header.rows}; the file is damaged — copy the series again")
    if jpeg.components != header.samples:
        raise DataError(f"{where}: the {jpeg.kind} frame declares {jpeg.components} components but the header says "
                        f"{header.describe()}; {_WHAT_TO_DO}")
    if jpeg.precision > max(header.bits_allocated, 8) or jpeg.precision < 2:
        raise DataError(f"{where}: the {jpeg.kind} frame declares {jpeg.precision}-bit samples but the header says "
                        f"{header.describe()}; {_WHAT_TO_DO}")
    if any(not 1 <= h <= 4 or not 1 <= v <= 4 for h, v in jpeg.sampling) and jpeg.marker != 0xF7:
        raise DataError(f"{where}: the JPEG frame declares sampling factors {list(jpeg.sampling)} (1 to 4 are "
                        f"possible); {_WHAT_TO_DO}")
    if jpeg.scans > MAX_JPEG_SCANS:
        raise DataError(f"{where}: the {jpeg.kind} frame holds {jpeg.scans:,} scans, more than the {MAX_JPEG_SCANS} "
                        f"FedSM decodes (each scan is a pass over the whole {jpeg.width}x{jpeg.height} image); "
                        f"{_WHAT_TO_DO}")


def _check_rle(where: str, frame: bytes, offsets: list[int], header: FrameHeader) -> None:
    expected = header.samples * header.bytes_per_sample
    if len(offsets) != expected:
        raise DataError(f"{where}: the RLE frame has {len(offsets)} segment(s) but the header ({header.describe()}) "
                        f"needs {expected} (one per byte of each sample); {_WHAT_TO_DO}")
    ends = [*offsets[1:], len(frame)]
    allowed = int(header.pixels * RLE_MAX_EXPANSION) + header.rows + 16
    for n, (start, end) in enumerate(zip(offsets, ends, strict=True), start=1):
        if end - start > allowed:
            raise DataError(f"{where}: RLE segment {n} holds {end - start:,} compressed bytes for the "
                            f"{header.pixels:,} bytes a {header.columns}x{header.rows} frame's segment decodes to "
                            f"(at most {allowed:,}); such a segment can decode to 64 times its size — "
                            f"{_WHAT_TO_DO}")


def check_native_length(path: PathLike, length: int, header: FrameHeader, frames: int) -> None:
    """Refuse uncompressed pixel data much longer than the header's frames need, before it is read.

    A value a few bytes longer (padding, a trailing byte some writers add) passes; one longer than
    twice the need plus 64 KiB is damage or an attempt to make the reader load what it never uses.

    Raises
    ------
    DataError
        Naming the file, the element's length and what the header declares.
    """
    need = header.decoded_bytes * frames
    if header.bits_allocated == 1:
        need = (header.pixels * header.samples * frames + 7) // 8
    if length != 0xFFFFFFFF and length > 2 * need + (64 << 10):
        raise DataError(f"{Path(path)}: its pixel data element holds {length:,} bytes but the header declares "
                        f"{frames} frame(s) of {header.describe()} ({need:,} bytes); {_WHAT_TO_DO}")


def check_compressed_frames(path: PathLike, pixel_data: bytes, header: FrameHeader, frames: int, syntax: str) -> None:
    """:func:`check_frame` on each frame of encapsulated pixel data, as the decoders will split it.

    Raises
    ------
    DataError
        When the encapsulation is cut short or damaged, holds fewer frames than the header
        declares, or a frame fails :func:`check_frame`.
    """
    from pydicom.encaps import generate_frames

    if syntax not in CHECKED_SYNTAXES:
        check_frame(path, b"", header, syntax)  # refuses the syntax
    if len(pixel_data) < 8:
        raise DataError(f"{path}: the compressed pixel data holds {len(pixel_data)} bytes; the file is truncated — "
                        "copy the series again")
    seen = 0
    try:
        for seen, frame in enumerate(generate_frames(pixel_data, number_of_frames=frames), start=1):
            check_frame(path, bytes(frame), header, syntax, seen - 1, frames)
            if seen == frames:
                break
    except DataError:
        raise
    except Exception as exc:  # pydicom's item parsing on damaged encapsulation: ValueError, struct.error, ...
        raise DataError(f"{path}: the compressed pixel data is damaged ({type(exc).__name__}: {exc}); copy the "
                        "series again") from None
    if seen < frames:
        raise DataError(f"{path}: the compressed pixel data holds {seen} frame(s) but the header declares {frames}; "
                        "the file is truncated or damaged — copy the series again")
