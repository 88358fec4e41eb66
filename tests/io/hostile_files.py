"""Hostile versions of real files: byte flips, truncation, header field edits, giant dimensions.

Used by ``test_fuzz_real_files.py`` (hypothesis draws the seed file, the mutation and its random
seed) and by ``test_hostile_files.py`` (one named case per reported attack). Every mutation is a
pure function ``(bytes, numpy Generator) -> bytes`` so a failing example reproduces exactly.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

Mutation = Callable[[bytes, np.random.Generator], bytes]

GIANT = (65535, 2**31 - 1, 2**32 - 1, 100_000, 0, 1)


# --- generic ---------------------------------------------------------------------------------------


def flip_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    """1..8 bytes XORed with a random value, mostly in the first 4 KiB (where the headers are)."""
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        span = len(out) if rng.random() < 0.3 else min(len(out), 4096)
        if span:
            out[int(rng.integers(0, span))] ^= int(rng.integers(1, 256))
    return bytes(out)


def truncate(data: bytes, rng: np.random.Generator) -> bytes:
    """The file cut at a random point (sometimes inside the first 512 bytes)."""
    end = int(rng.integers(0, min(len(data), 512))) if rng.random() < 0.3 else int(rng.integers(0, len(data)))
    return data[:end]


# --- PNG -------------------------------------------------------------------------------------------


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.append((kind, data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return chunks


def _png_join(chunks: list[tuple[bytes, bytes]]) -> bytes:
    out = [b"\x89PNG\r\n\x1a\n"]
    for kind, body in chunks:
        out.append(struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body)))
    return b"".join(out)


def png_dims(data: bytes, rng: np.random.Generator) -> bytes:
    """IHDR width/height (and sometimes depth/colour type) edited, CRC fixed so Pillow trusts it."""
    chunks = _png_chunks(data)
    if not chunks or chunks[0][0] != b"IHDR" or len(chunks[0][1]) < 13:
        return flip_bytes(data, rng)
    ihdr = bytearray(chunks[0][1])
    width, height = struct.unpack(">II", ihdr[:8])
    choice = int(rng.integers(0, 4))
    if choice == 0:
        width = height = 12_000  # 144 Mpx: over the cap, under Pillow's own bomb limit x2
    elif choice == 1:
        width, height = (int(rng.choice(GIANT)) for _ in range(2))
    elif choice == 2:
        ihdr[8] = int(rng.choice([1, 2, 4, 8, 16, 3, 32]))
        ihdr[9] = int(rng.choice([0, 2, 3, 4, 6, 5, 7]))
    else:
        width, height = width * int(rng.integers(2, 6)), height
    ihdr[:8] = struct.pack(">II", width & 0xFFFFFFFF, height & 0xFFFFFFFF)
    chunks[0] = (b"IHDR", bytes(ihdr))
    return _png_join(chunks)


@functools.lru_cache(maxsize=4)
def png_bomb(width: int = 12_000, height: int = 12_000, rows: int | None = None) -> bytes:
    """A small PNG (all-zero grey rows, deflated) that declares ``width x height`` pixels.

    ``rows`` limits the rows actually stored (the header still declares ``height``): enough for
    tests of checks made before decoding.
    """
    raw = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    body = b"".join(raw.compress(row) for _ in range(height if rows is None else rows)) + raw.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return _png_join([(b"IHDR", ihdr), (b"IDAT", body), (b"IEND", b"")])


# --- JPEG ------------------------------------------------------------------------------------------


def jpeg_dims(data: bytes, rng: np.random.Generator) -> bytes:
    """The SOFn frame's height/width set to giant values."""
    out = bytearray(data)
    pos = 2
    while pos + 9 < len(out):
        if out[pos] != 0xFF:
            break
        marker = out[pos + 1]
        length = struct.unpack(">H", out[pos + 2:pos + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2, 0xC3):
            out[pos + 5:pos + 9] = struct.pack(">HH", int(rng.choice([65535, 0, 40000])),
                                               int(rng.choice([65535, 0, 40000])))
            return bytes(out)
        pos += 2 + length
    return flip_bytes(data, rng)


# --- NIfTI -----------------------------------------------------------------------------------------


def nifti_header_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """An uncompressed NIfTI-1's header edited: giant or negative dims, NaN srow, odd datatype, offset."""
    if len(data) < 352:  # already truncated into the header (a second mutation): nothing to edit
        return flip_bytes(data, rng) if data else data
    out = bytearray(data)
    choice = int(rng.integers(0, 6))
    if choice == 0:  # dims
        for i in range(1, 4):
            struct.pack_into("<h", out, 40 + 2 * i, int(rng.choice([32767, -1, 0, 1, 30000])))
    elif choice == 1:  # srow with NaN (sform in use)
        struct.pack_into("<h", out, 254, 1)
        for _ in range(int(rng.integers(1, 12))):
            struct.pack_into("<f", out, 280 + 4 * int(rng.integers(0, 12)), float("nan"))
    elif choice == 2:  # qform with NaN / inf quaternion, sform off
        struct.pack_into("<hh", out, 252, 1, 0)
        struct.pack_into("<f", out, 256 + 4 * int(rng.integers(0, 6)), float(rng.choice([np.nan, np.inf, 1e38])))
    elif choice == 3:  # pixdim
        struct.pack_into("<f", out, 80 + 4 * int(rng.integers(0, 3)), float(rng.choice([0.0, -1.0, np.nan, 1e30])))
    elif choice == 4:  # datatype / bitpix
        struct.pack_into("<hh", out, 70, int(rng.choice([0, 1, 128, 1536, 2304, 32767])), int(rng.choice([0, 8, 64])))
    else:  # vox_offset, dim[0]
        struct.pack_into("<f", out, 108, float(rng.choice([1e12, -352.0, 0.0, 7.0])))
        struct.pack_into("<h", out, 40, int(rng.choice([0, 5, 8, 9, -3])))
    return bytes(out)


def gzip_wrap(mutate: Mutation) -> Mutation:
    """A mutation of a ``.nii.gz``'s uncompressed bytes, recompressed."""
    import gzip

    def wrapped(data: bytes, rng: np.random.Generator) -> bytes:
        return gzip.compress(mutate(gzip.decompress(data), rng), compresslevel=1, mtime=0)

    wrapped.__name__ = f"gzip_{mutate.__name__}"
    return wrapped


# --- NRRD -----------------------------------------------------------------------------------------


def nrrd_header_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """A NRRD text header's sizes, type, dimension, directions or encoding replaced by hostile values."""
    end = data.find(b"\n\n")
    if end < 0:
        return flip_bytes(data, rng)
    lines = data[:end].split(b"\n")
    edits = {
        b"sizes:": [b"sizes: 100000 100000 100000", b"sizes: 0 512 3", b"sizes: -5 5 5", b"sizes: 512 512"],
        b"type:": [b"type: complex", b"type: block", b"type: double"],
        b"dimension:": [b"dimension: 9", b"dimension: 0", b"dimension: 2"],
        b"space directions:": [b"space directions: (nan,0,0) (0,1,0) (0,0,1)",
                               b"space directions: (0,0,0) (0,0,0) (0,0,0)"],
        b"encoding:": [b"encoding: raw", b"encoding: bzip2", b"encoding: ascii"],
    }
    key = list(edits)[int(rng.integers(0, len(edits)))]
    options = edits[key]
    lines = [options[int(rng.integers(0, len(options)))] if line.startswith(key) else line for line in lines]
    return b"\n".join(lines) + data[end:]


# --- DICOM -----------------------------------------------------------------------------------------


def _dicom_edit(data: bytes, edit: Callable[[object], None]) -> bytes:
    import pydicom

    ds = pydicom.dcmread(io.BytesIO(data), force=True)
    edit(ds)
    buffer = io.BytesIO()
    ds.save_as(buffer, enforce_file_format=False)
    return buffer.getvalue()


def dicom_field_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """A header field set to a hostile value: giant Rows/Columns/frames, odd bits, NaN geometry, short pixels."""
    choice = int(rng.integers(0, 8))

    def edit(ds: object) -> None:
        d = ds  # type: ignore[assignment]
        if choice == 0:
            d.Rows, d.Columns = 65535, 65535  # type: ignore[attr-defined]
        elif choice == 1:
            d.NumberOfFrames = int(rng.choice([100_000, 2**31 - 1, 0, -5]))  # type: ignore[attr-defined]
        elif choice == 2:
            d.BitsAllocated = int(rng.choice([0, 1, 7, 12, 64]))  # type: ignore[attr-defined]
            d.BitsStored = int(rng.choice([0, 1, 16, 33]))  # type: ignore[attr-defined]
        elif choice == 3:
            d.ImagePositionPatient = ["nan", "0", "inf"]  # type: ignore[attr-defined]
        elif choice == 4:
            d.ImageOrientationPatient = [0, 0, 0, 0, 0, 0]  # type: ignore[attr-defined]
        elif choice == 5:
            d.PixelData = bytes(d.PixelData)[: int(rng.integers(0, 1000))]  # type: ignore[attr-defined]
        elif choice == 6:
            d.SamplesPerPixel = int(rng.choice([0, 3, 4, 200]))  # type: ignore[attr-defined]
        else:
            d.PixelSpacing = [str(rng.choice(["0", "-1", "nan", "1e308"])), "1"]  # type: ignore[attr-defined]

    try:
        return _dicom_edit(data, edit)
    except Exception:  # the seed is not editable this way (no PixelData, ...): flip bytes instead
        return flip_bytes(data, rng)


def dicom_unknown_vr(data: bytes, rng: np.random.Generator) -> bytes:
    """An explicit-VR element's VR replaced by letters that are no VR (pydicom: NotImplementedError)."""
    out = bytearray(data)
    # Explicit VR little endian elements after the meta group: (gggg,eeee) VR. Pick a known short one.
    candidates = [i for i in range(132, min(len(out) - 8, 8192)) if out[i:i + 2] in (b"DS", b"IS", b"US", b"CS", b"LO",
                                                                                  b"UI", b"SH", b"DA", b"TM")]
    if not candidates:
        return flip_bytes(data, rng)
    for _ in range(int(rng.integers(1, 4))):
        i = int(rng.choice(candidates))
        out[i:i + 2] = bytes(rng.choice([b"ZZ", b"XQ", b"\x00\x00", b"ox"]))
    return bytes(out)


def dicom_length_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """An element's 16-bit length field changed (values of the wrong byte count: BytesLengthException)."""
    out = bytearray(data)
    candidates = [i for i in range(132, min(len(out) - 8, 8192)) if out[i:i + 2] in (b"US", b"UL", b"FD", b"FL", b"SS")]
    if not candidates:
        return flip_bytes(data, rng)
    i = int(rng.choice(candidates))
    struct.pack_into("<H", out, i + 2, int(rng.choice([1, 3, 5, 7, 0])))
    return bytes(out)


DEFLATED = "1.2.840.10008.1.2.1.99"


def dicom_deflate_bomb(inflated_bytes: int = 64 << 20) -> bytes:
    """A deflated-explicit-VR DICOM file whose dataset inflates to ``inflated_bytes`` (an OB element of zeros)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.4"
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.Modality = "MR"
    ds.Rows, ds.Columns = 8, 8
    buffer = io.BytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    plain = buffer.getvalue()
    meta_end = 132 + 12 + struct.unpack("<I", plain[140:144])[0]
    header, body = plain[:meta_end], plain[meta_end:]
    # Rewrite the transfer syntax in the meta group and deflate a body padded with a huge OB element.
    old = str(ExplicitVRLittleEndian).encode() + b"\x00" * (len(str(ExplicitVRLittleEndian)) % 2)
    new = DEFLATED.encode() + b"\x00" * (len(DEFLATED) % 2)
    header = header.replace(struct.pack("<H", len(old)) + old, struct.pack("<H", len(new)) + new)
    header = header[:140] + struct.pack("<I", meta_end - 144 + len(new) - len(old)) + header[144:]
    pad = struct.pack("<HH", 0x0009, 0x1010) + b"OB\x00\x00" + struct.pack("<I", inflated_bytes)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b"\x00" * (1 << 20)
    parts = [comp.compress(body + pad)]
    for _ in range(inflated_bytes >> 20):
        parts.append(comp.compress(chunk))
    parts.append(comp.flush())
    return header + b"".join(parts)


# --- bundle (safetensors) --------------------------------------------------------------------------


def safetensors_with_header(header: object | str) -> bytes:
    """A safetensors file holding only ``header`` (a JSON-able object or raw JSON text)."""
    import json

    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def bundle_metadata_edit(data: bytes, rng: np.random.Generator) -> bytes:
    """A real bundle's FedSM metadata replaced by a wrong type, a deep nest or one field of a wrong type."""
    import json

    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    meta = json.loads(header["__metadata__"]["fedsm"])
    choice = int(rng.integers(0, 5))
    if choice == 0:
        header["__metadata__"]["fedsm"] = json.dumps(int(rng.integers(0, 1000)))
    elif choice == 1:
        depth = int(rng.integers(50, 5000))
        header["__metadata__"]["fedsm"] = "[" * depth + "]" * depth
    elif choice == 2:
        key = str(rng.choice(sorted(meta)))
        meta[key] = [None, 1.5, "x", {"a": []}, [[[]]], -1, 10**30][int(rng.integers(0, 7))]
        header["__metadata__"]["fedsm"] = json.dumps(meta)
    elif choice == 3:
        depth = int(rng.integers(50, 3000))
        meta["extra"] = json.loads("[" * min(depth, 900) + "]" * min(depth, 900))
        header["__metadata__"]["fedsm"] = json.dumps(meta)
    else:
        header["__metadata__"] = [1, 2] if rng.random() < 0.5 else {"fedsm": ["x"]}
    text = json.dumps(header)
    return struct.pack("<Q", len(text)) + text.encode() + data[8 + length:]


def write_small_bundle(path: Path, task_name: str) -> Path:
    """A valid super model of untrained nets at 32 px (what infer needs to run end to end)."""
    import torch

    from engine.bundle import BundleMetadata, SuperModelBundle, save_bundle
    from engine.models import build_segmentation_net, build_selector
    from engine.tasks import get_task

    torch.manual_seed(0)
    task = get_task(task_name)
    sites = ["alpha", "beta"]
    meta = BundleMetadata(task=task.name, label_names=list(task.label_names), in_channels=task.in_channels,
                          image_size=32, selector_size=32, site_names=sites)
    nets = {s: build_segmentation_net(task.in_channels, task.out_channels).state_dict() for s in sites}
    save_bundle(path, SuperModelBundle(meta, build_segmentation_net(task.in_channels, task.out_channels).state_dict(),
                                       nets, build_selector(task.in_channels, meta.selector_classes).state_dict()))
    return path


# --- compressed frames that cost more to decode than their DICOM header says -----------------------


def _ramp(rows: int, columns: int, bits: int) -> np.ndarray:
    """A smooth image (compresses well, decodes to known values)."""
    y, x = np.mgrid[0:rows, 0:columns]
    top = (1 << bits) - 1
    return ((x * 7 + y * 3) % (top + 1)).astype(np.uint16 if bits > 8 else np.uint8)


def j2k_codestream(rows: int = 512, columns: int = 512, bits: int = 16) -> bytes:
    """A real JPEG 2000 codestream (raw, no JP2 boxes) of a ``columns x rows`` grey image, encoded by Pillow."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(_ramp(rows, columns, bits)).save(buffer, format="JPEG2000", no_jp2=True)
    return buffer.getvalue()


def j2k_with_siz(codestream: bytes, **fields: int) -> bytes:
    """``codestream`` with SIZ fields replaced: ``tile_width``, ``tile_height``, ``components`` (copies of the
    first component's Ssiz/XRsiz/YRsiz) or ``precision`` (bits of every component); the rest kept."""
    assert codestream[:4] == b"\xff\x4f\xff\x51"
    (length,) = struct.unpack(">H", codestream[4:6])
    values = list(struct.unpack(">HIIIIIIIIH", codestream[6:42]))
    comps = [codestream[42 + 3 * i:45 + 3 * i] for i in range(values[9])]
    values[5] = fields.get("tile_width", values[5])
    values[6] = fields.get("tile_height", values[6])
    if "components" in fields:
        comps = [comps[0]] * fields["components"]
    if "precision" in fields:
        comps = [bytes([fields["precision"] - 1]) + c[1:] for c in comps]
    values[9] = len(comps)
    body = struct.pack(">HIIIIIIIIH", *values) + b"".join(comps)
    return b"\xff\x4f\xff\x51" + struct.pack(">H", len(body) + 2) + body + codestream[4 + length:]


def jpeg_codestream(rows: int = 512, columns: int = 512, progressive: bool = False) -> bytes:
    """A real 8-bit grey JPEG (baseline, or progressive) encoded by Pillow."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(_ramp(rows, columns, 8)).save(buffer, format="JPEG", quality=90, progressive=progressive)
    return buffer.getvalue()


def jpeg_with_scans(jpeg: bytes, scans: int) -> bytes:
    """``jpeg`` with tiny scans (its first scan's header and one byte of data) added until it holds ``scans``
    scans: a progressive-JPEG CPU bomb (each scan is a pass over the whole image)."""
    first = jpeg.index(b"\xff\xda")
    (length,) = struct.unpack(">H", jpeg[first + 2:first + 4])
    header = jpeg[first:first + 2 + length]
    end = jpeg.rindex(b"\xff\xd9")
    extra = scans - jpeg.count(b"\xff\xda")
    return jpeg[:end] + (header + b"\x00") * extra + b"\xff\xd9"


def rle_frame(pixels: np.ndarray) -> bytes:
    """One grey frame encoded by pydicom's own RLE encoder."""
    from pydicom.pixels.encoders import RLELosslessEncoder

    rows, columns = pixels.shape
    bits = pixels.dtype.itemsize * 8
    return RLELosslessEncoder.encode(pixels, rows=rows, columns=columns, samples_per_pixel=1, bits_allocated=bits,
                                     bits_stored=bits, pixel_representation=0, number_of_frames=1,
                                     photometric_interpretation="MONOCHROME2")


def jpeg_ls_codestream(rows: int = 512, columns: int = 512, bits: int = 16) -> bytes:
    """A real JPEG-LS stream (CharLS through pyjpegls) of a grey image."""
    import jpeg_ls

    return bytes(jpeg_ls.encode(_ramp(rows, columns, bits)))


def jpeg_with_frame_header(jpeg: bytes, precision: int | None = None, components: int | None = None) -> bytes:
    """``jpeg`` (JPEG or JPEG-LS) with the frame header's precision or number of components changed."""
    for marker in (b"\xff\xc0", b"\xff\xc2", b"\xff\xf7"):
        at = jpeg.find(marker)
        if at >= 0:
            break
    (length,) = struct.unpack(">H", jpeg[at + 2:at + 4])
    p, y, x, n = jpeg[at + 4], *struct.unpack(">HH", jpeg[at + 5:at + 9]), jpeg[at + 9]
    comps = [jpeg[at + 10 + 3 * i:at + 13 + 3 * i] for i in range(n)]
    if components is not None:
        comps = [bytes([i + 1]) + comps[0][1:] for i in range(components)]
    body = struct.pack(">BHHB", precision or p, y, x, len(comps)) + b"".join(comps)
    return jpeg[:at + 2] + struct.pack(">H", len(body) + 2) + body + jpeg[at + 2 + length:]


def rle_bomb_frame(segments: int, compressed_bytes: int) -> bytes:
    """An RLE frame of ``segments`` segments, each ``compressed_bytes`` of 2-byte runs that repeat a byte 128 times
    (each segment decodes to 64 times its size, whatever the header says)."""
    segment = b"\x81\x00" * (compressed_bytes // 2)
    offsets = [64 + i * len(segment) for i in range(segments)]
    header = struct.pack("<I", segments) + b"".join(struct.pack("<I", o) for o in offsets)
    return header + b"\x00" * (64 - len(header)) + segment * segments


def compressed_dicom(path: Path, frame: bytes, syntax: str, rows: int = 512, columns: int = 512, samples: int = 1,
                     bits: int = 16) -> Path:
    """A one-slice MR DICOM file at ``path`` whose encapsulated pixel data is ``frame`` under ``syntax``."""
    import pydicom
    from pydicom.dataset import FileMetaDataset
    from pydicom.encaps import encapsulate
    from pydicom.uid import MRImageStorage, generate_uid

    ds = pydicom.Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = syntax
    ds.file_meta.MediaStorageSOPClassUID = MRImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID = generate_uid()
    ds.SOPClassUID = MRImageStorage
    ds.StudyInstanceUID, ds.SeriesInstanceUID = generate_uid(), generate_uid()
    ds.Modality = "MR"
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    ds.ImagePositionPatient = [0, 0, 0]
    ds.PixelSpacing = [0.5, 0.5]
    ds.SliceThickness = 3
    ds.Rows, ds.Columns, ds.SamplesPerPixel = rows, columns, samples
    ds.PhotometricInterpretation = "MONOCHROME2" if samples == 1 else "RGB"
    if samples > 1:
        ds.PlanarConfiguration = 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = bits, bits, bits - 1, 0
    ds.PixelData = encapsulate([frame])
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def tiff_with_tiles(width: int, height: int, tile_width: int, tile_height: int) -> bytes:
    """A little-endian 8-bit grey TIFF declaring ``width x height`` pixels in tiles of ``tile_width x tile_height``."""
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (277, 3, 1, 1), (322, 4, 1, tile_width), (323, 4, 1, tile_height), (324, 4, 1, 0), (325, 4, 1, 16)]
    data_at = 8 + 2 + 12 * len(entries) + 4
    entries[-2] = (324, 4, 1, data_at)
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\x00" * 4
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\x00" * 16
