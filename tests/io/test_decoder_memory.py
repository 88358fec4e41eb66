"""Decoder memory is bounded by the header: small crafted files of every codec are refused before decoding.

Each family's crafted file is read in a child process whose address space is capped (so a regression
fails instead of eating the machine's memory) and whose peak resident memory is measured after the
decoders were warmed up on a legitimate file of the same kind. Before these checks (c453317), the
JPEG 2000 slice below (1 KiB, a 512x512 header, 43,776 tiles in its codestream) added 413 MiB and was
read as garbage; the JPEG-LS one (36 KiB, 200 components) 201 MiB; the RLE one (4 MiB) 277 MiB, read as
garbage; the deflated one (128 KiB) 218 MiB; a JPEG 2000 tile bomb named ``photo.png`` 359 MiB
(docs/io.md, Hostile files). Now each adds under 8 MiB and is refused in under 0.4 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hostile_files as hf
import numpy as np
import pydicom
import pytest
from PIL import Image, features

from engine.errors import DataError
from engine.io import codestream
from engine.io.readers import open_study

ROOT = Path(__file__).resolve().parents[2]
J2K, J2K_LOSSY = "1.2.840.10008.1.2.4.90", "1.2.840.10008.1.2.4.91"
JPEG_BASELINE, JPEG_LS, RLE = "1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.5"
#: What a refused file may add to the child's peak memory after the warm-up read (bombs cost 100s of MB).
EXTRA_MIB = 48
needs_openjpeg = pytest.mark.skipif(not features.check("jpg_2000"), reason="Pillow without OpenJPEG")

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from engine.errors import FedSMError
    from engine.io.readers import open_study

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    target, warm = sys.argv[1], sys.argv[2]
    if warm:
        open_study(warm)  # loads the decoders (GDCM, OpenJPEG, libjpeg, CharLS) the crafted file would use
    with open("/proc/self/status") as fh:
        vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    base, start = peak(), time.perf_counter()
    try:
        open_study(target)
        outcome = "read"
    except FedSMError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    except MemoryError:
        outcome = "MemoryError"
    print(json.dumps({"outcome": outcome, "extra_mib": (peak() - base) / 2**20,
                      "seconds": time.perf_counter() - start}))
""")


def _read_in_child(target: Path, warm: Path | None) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(target), str(warm or "")], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _refused_with_bounded_memory(target: Path, warm: Path | None, message: str) -> None:
    result = _read_in_child(target, warm)
    assert result["outcome"].startswith("DataError: "), result
    assert message in str(result["outcome"]), result
    assert result["extra_mib"] < EXTRA_MIB, result
    assert result["seconds"] < 5, result


# --- crafted files, one family each ----------------------------------------------------------------


def _j2k_tiles(tmp: Path) -> tuple[Path, Path, str]:
    good = hf.j2k_codestream()
    bomb = hf.j2k_with_siz(good, tile_width=2, tile_height=3)  # 43,776 tiles; the size still 512x512
    return (hf.compressed_dicom(tmp / "bomb" / "slice.dcm", bomb, J2K),
            hf.compressed_dicom(tmp / "good" / "slice.dcm", good, J2K),
            "the JPEG 2000 codestream declares 43,776 tiles of 2x3 pixels for an image of 512x512 pixels")


def _jpeg_scans(tmp: Path) -> tuple[Path, Path, str]:
    good = hf.jpeg_codestream(progressive=True)
    bomb = hf.jpeg_with_scans(good, 2000)
    return (hf.compressed_dicom(tmp / "bomb" / "slice.dcm", bomb, JPEG_BASELINE, bits=8),
            hf.compressed_dicom(tmp / "good" / "slice.dcm", good, JPEG_BASELINE, bits=8),
            "the JPEG frame holds 2,000 scans, more than the 500 FedSM decodes")


def _jpeg_ls_components(tmp: Path) -> tuple[Path, Path, str]:
    good = hf.jpeg_ls_codestream()
    bomb = hf.jpeg_with_frame_header(good, components=200)
    return (hf.compressed_dicom(tmp / "bomb" / "slice.dcm", bomb, JPEG_LS),
            hf.compressed_dicom(tmp / "good" / "slice.dcm", good, JPEG_LS),
            "the JPEG-LS frame declares 200 components but the header says Columns x Rows 512x512, "
            "SamplesPerPixel 1")


def _rle_runs(tmp: Path) -> tuple[Path, Path, str]:
    bomb = hf.rle_bomb_frame(2, 2 << 20)  # each 2 MiB segment decodes to 128 MiB; the header needs 256 KiB
    good = hf.compressed_dicom(tmp / "good" / "slice.dcm", hf.rle_frame(hf._ramp(512, 512, 16)), RLE)
    return (hf.compressed_dicom(tmp / "bomb" / "slice.dcm", bomb, RLE), good,
            "RLE segment 1 holds 2,097,152 compressed bytes for the 262,144 bytes")


def _deflate(tmp: Path) -> tuple[Path, Path | None, str]:
    (tmp / "bomb").mkdir()
    bomb = tmp / "bomb" / "slice.dcm"
    bomb.write_bytes(hf.dicom_deflate_bomb(128 << 20))  # an 8x8 header, 128 MiB inflated
    return bomb, None, "inflates to more than 16 MiB (a 'zip bomb'), while its header declares 128 bytes of pixels"


def _photo_j2k_named_png(tmp: Path) -> tuple[Path, Path, str]:
    bomb = tmp / "photo.png"
    bomb.write_bytes(hf.j2k_with_siz(hf.j2k_codestream(bits=8), tile_width=2, tile_height=3))
    good = tmp / "good.png"
    Image.fromarray(hf._ramp(512, 512, 8)).save(good)
    return bomb, good, "not an image file Pillow can read (the content is not PNG, JPEG, TIFF or BMP)"


def _photo_jpeg_scans(tmp: Path) -> tuple[Path, Path, str]:
    good = tmp / "good.jpg"
    good.write_bytes(hf.jpeg_codestream(progressive=True))
    bomb = tmp / "photo.jpg"
    bomb.write_bytes(hf.jpeg_with_scans(good.read_bytes(), 2000))
    return bomb, good, "the image is a JPEG of 2,000 scans, more than the 500 FedSM decodes"


def _photo_tiff_tiles(tmp: Path) -> tuple[Path, Path, str]:
    bomb = tmp / "photo.tif"
    bomb.write_bytes(hf.tiff_with_tiles(64, 64, 65536, 32768))
    good = tmp / "good.tif"
    Image.fromarray(hf._ramp(64, 64, 8)).save(good)
    return bomb, good, "the image is a 64x64 TIFF whose tiles are 65536x32768 pixels"


def _photo_png_bomb(tmp: Path) -> tuple[Path, Path, str]:
    bomb = tmp / "photo.png"
    bomb.write_bytes(hf.png_bomb(12_000, 12_000, rows=4))
    good = tmp / "good.png"
    Image.fromarray(hf._ramp(512, 512, 8)).save(good)
    return bomb, good, "the image is 12000x12000 pixels (144.0 megapixels), more than the 100 megapixels"


FAMILIES = {
    "jpeg2000": pytest.param(_j2k_tiles, marks=needs_openjpeg),
    "jpeg": _jpeg_scans,
    "jpeg-ls": _jpeg_ls_components,
    "rle": _rle_runs,
    "deflate": _deflate,
    "photo-jpeg2000-named-png": pytest.param(_photo_j2k_named_png, marks=needs_openjpeg),
    "photo-jpeg": _photo_jpeg_scans,
    "photo-tiff": _photo_tiff_tiles,
    "photo-png": _photo_png_bomb,
}


@pytest.mark.parametrize("craft", list(FAMILIES.values()), ids=list(FAMILIES))
def test_crafted_file_is_refused_with_bounded_memory(tmp_path: Path, craft: object) -> None:
    # Prepare: a small crafted file of the family, and a legitimate one of the same codec
    bomb, good, message = craft(tmp_path)  # type: ignore[operator]
    assert bomb.stat().st_size < 5 << 20
    # Execute / Assert: the legitimate file reads; the crafted one is refused in the child, memory flat
    if good is not None:
        assert open_study(good).array.size > 0
    _refused_with_bounded_memory(bomb, good, message)


# --- header and codestream that disagree, in-process -----------------------------------------------


@needs_openjpeg
@pytest.mark.parametrize(("fields", "message"), [
    ({"components": 3}, "the JPEG 2000 codestream declares 3 components but the header says Columns x Rows "
                        "64x64, SamplesPerPixel 1, BitsAllocated 16"),
    ({"precision": 32}, "the JPEG 2000 codestream declares 32-bit samples"),
    ({"tile_width": 0}, "the JPEG 2000 codestream's tile grid is invalid"),
])
def test_jpeg2000_disagreeing_with_its_header(tmp_path: Path, fields: dict[str, int], message: str) -> None:
    frame = hf.j2k_with_siz(hf.j2k_codestream(64, 64), **fields)
    path = hf.compressed_dicom(tmp_path / "s" / "slice.dcm", frame, J2K, rows=64, columns=64)
    with pytest.raises(DataError, match=rf"slice\.dcm: {message}.*remove it from the folder"):
        open_study(path)


def test_jpeg_disagreeing_with_its_header(tmp_path: Path) -> None:
    twelve = hf.jpeg_with_frame_header(hf.jpeg_codestream(64, 64), precision=12)
    with pytest.raises(DataError, match=r"a\.dcm: the JPEG frame declares 12-bit samples but the header says "
                                        r"Columns x Rows 64x64, SamplesPerPixel 1, BitsAllocated 8"):
        open_study(hf.compressed_dicom(tmp_path / "a" / "a.dcm", twelve, JPEG_BASELINE, 64, 64, bits=8))
    with pytest.raises(DataError, match=r"b\.dcm: the transfer syntax says JPEG-LS but the frame is a JPEG stream"):
        open_study(hf.compressed_dicom(tmp_path / "b" / "b.dcm", hf.jpeg_codestream(64, 64), JPEG_LS, 64, 64, bits=8))
    with pytest.raises(DataError, match=r"c\.dcm: the JPEG baseline frame cannot be used: it does not start with a "
                                        r"JPEG stream"):
        open_study(hf.compressed_dicom(tmp_path / "c" / "c.dcm", b"\x00" * 64, JPEG_BASELINE, 64, 64, bits=8))


def test_rle_segments_must_match_the_header(tmp_path: Path) -> None:
    frame = hf.rle_bomb_frame(3, 256)  # three segments; 16-bit grey needs two
    with pytest.raises(DataError, match=r"the RLE frame has 3 segment\(s\) but the header \(Columns x Rows 64x64, "
                                        r"SamplesPerPixel 1, BitsAllocated 16\) needs 2"):
        open_study(hf.compressed_dicom(tmp_path / "s" / "s.dcm", frame, RLE, 64, 64))


def test_unchecked_compressed_syntax_is_refused(tmp_path: Path) -> None:
    mpeg2 = "1.2.840.10008.1.2.4.100"
    with pytest.raises(DataError, match=rf"compressed with transfer syntax {mpeg2}, which FedSM does not decode"):
        open_study(hf.compressed_dicom(tmp_path / "s" / "s.dcm", b"\x00" * 64, mpeg2, 64, 64))


def test_native_pixel_data_longer_than_the_header_is_refused_before_reading(tmp_path: Path) -> None:
    from synthetic_dicom import write_series

    [path], _ = write_series(tmp_path / "s", rows=16, columns=16, slices=1)
    ds = pydicom.dcmread(path)
    ds.PixelData = bytes(2 << 20)  # 2 MiB for a 16x16 16-bit slice (512 bytes)
    ds.save_as(path, enforce_file_format=True)
    with pytest.raises(DataError, match=r"its pixel data element holds 2,097,152 bytes but the header declares 1 "
                                        r"frame\(s\) of Columns x Rows 16x16"):
        open_study(path)


# --- legitimate files of every codec still read, with their values ----------------------------------


@pytest.mark.parametrize("syntax", [pytest.param(J2K, marks=needs_openjpeg), JPEG_LS, RLE])
def test_lossless_codecs_still_read_exactly(tmp_path: Path, syntax: str) -> None:
    pixels = hf._ramp(48, 40, 16)
    if syntax == J2K:
        frame = hf.j2k_codestream(48, 40)
    elif syntax == JPEG_LS:
        frame = hf.jpeg_ls_codestream(48, 40)
    else:
        frame = hf.rle_frame(pixels)
    study = open_study(hf.compressed_dicom(tmp_path / "s" / "s.dcm", frame, syntax, 48, 40))
    # A single axial slice: RAS+ flips the LPS rows and columns of the stored image.
    np.testing.assert_array_equal(study.array[:, :, 0], pixels.T[::-1, ::-1].astype(np.float32))


def test_frame_header_bound_is_derived_from_the_header() -> None:
    header = codestream.FrameHeader(rows=512, columns=512, samples=1, bits_allocated=16)
    assert header.decode_limit == 512 * 512 * codestream.DECODE_BYTES_PER_SAMPLE + codestream.DECODE_SLACK
    one_tile = codestream.parse_j2k(hf.j2k_codestream(64, 64))
    assert (one_tile.size, one_tile.components, one_tile.tiles, one_tile.precisions) == ((64, 64), 1, 1, (16,))
    tiled = codestream.parse_j2k(hf.j2k_with_siz(hf.j2k_codestream(64, 64), tile_width=16, tile_height=16))
    assert tiled.tiles == 16


def test_dicom_seg_with_a_run_length_bomb_frame_is_refused(tmp_path: Path) -> None:
    from pydicom.encaps import encapsulate
    from synthetic_dicom import write_series

    from engine.io.dicom_seg import read_dicom_seg, write_dicom_seg
    from engine.io.study import LabelMap

    # Prepare: a real SEG of a 64x64x2 series, its frames swapped for RLE segments that decode to 64x their size
    write_series(tmp_path / "s", rows=64, columns=64, slices=2)
    study = open_study(tmp_path / "s")
    labels = np.zeros(study.shape, np.uint8)
    labels[10:20, 10:20, :] = 1
    path = write_dicom_seg(study, LabelMap(labels, {1: "gland"}), tmp_path / "seg.dcm")
    seg = pydicom.dcmread(path)
    frames = int(seg.NumberOfFrames)
    seg.file_meta.TransferSyntaxUID = RLE
    seg.PixelData = encapsulate([hf.rle_bomb_frame(1, 256 << 10)] * frames)
    seg.save_as(path, enforce_file_format=True)
    # Execute / Assert: refused before highdicom decodes a frame
    with pytest.raises(DataError, match=rf"seg\.dcm: frame 1 of {frames}: RLE segment 1 holds 262,144 compressed "
                                        r"bytes for the 4,096 bytes"):
        read_dicom_seg(path, study)
