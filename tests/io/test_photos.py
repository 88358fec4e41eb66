"""Fundus photos: formats, modes (grey, palette, alpha, 16-bit), huge and broken files."""

from __future__ import annotations

import logging
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import DataError
from engine.io import photos
from engine.io.readers import list_series, open_study


def _rgb(h: int = 30, w: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(("suffix", "fmt"), [(".png", "png"), (".tif", "tiff"), (".bmp", "bmp")])
def test_lossless_formats_read_back_exactly(tmp_path: Path, suffix: str, fmt: str) -> None:
    rgb = _rgb()
    Image.fromarray(rgb).save(tmp_path / f"p{suffix}")
    study = open_study(tmp_path / f"p{suffix}")
    assert study.kind == "photo" and study.source_format == fmt and study.shape == (30, 40)
    assert study.array.dtype == np.uint8 and study.array.shape == (30, 40, 3)
    np.testing.assert_array_equal(study.array, rgb)
    np.testing.assert_array_equal(study.affine, np.eye(4))
    assert study.spacing == (1.0, 1.0) and study.num_slices == 1


def test_jpeg_and_content_over_name(tmp_path: Path) -> None:
    rgb = _rgb()
    Image.fromarray(rgb).save(tmp_path / "p.jpg", quality=95)
    study = open_study(tmp_path / "p.jpg")
    assert study.source_format == "jpeg" and study.shape == (30, 40)
    np.testing.assert_array_equal(study.array, np.asarray(Image.open(tmp_path / "p.jpg").convert("RGB")))
    Image.fromarray(rgb).save(tmp_path / "really_png.jpg", format="PNG")  # mislabelled file
    assert open_study(tmp_path / "really_png.jpg").source_format == "png"


def test_grey_palette_and_alpha_become_rgb(tmp_path: Path) -> None:
    grey = _rgb()[:, :, 0]
    Image.fromarray(grey, mode="L").save(tmp_path / "grey.png")
    np.testing.assert_array_equal(open_study(tmp_path / "grey.png").array, np.repeat(grey[:, :, None], 3, axis=2))
    palette = Image.fromarray(_rgb(seed=1)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.save(tmp_path / "palette.png")
    np.testing.assert_array_equal(open_study(tmp_path / "palette.png").array, np.asarray(palette.convert("RGB")))
    rgba = np.dstack([_rgb(seed=2), np.full((30, 40), 7, np.uint8)])
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "alpha.png")
    np.testing.assert_array_equal(open_study(tmp_path / "alpha.png").array, rgba[:, :, :3])  # alpha dropped


def test_16_bit_grey_png_is_scaled_by_its_bit_depth(tmp_path: Path) -> None:
    full = np.linspace(0, 65535, 30 * 40).reshape(30, 40).astype(np.uint16)
    Image.fromarray(full).save(tmp_path / "full.png")
    with Image.open(tmp_path / "full.png") as img:
        assert img.mode.startswith("I")  # really a 16-bit file
    study = open_study(tmp_path / "full.png")
    np.testing.assert_array_equal(study.array[:, :, 0], np.rint(full / 257.0).astype(np.uint8))
    assert study.description["scaling"].startswith("16-bit grey read as 16-bit data")
    twelve = (full // 16).astype(np.uint16)  # 12-bit data: 0..4095
    Image.fromarray(twelve).save(tmp_path / "twelve.png")
    out = open_study(tmp_path / "twelve.png").array[:, :, 0]
    assert out.max() == 255 and out.min() == 0
    np.testing.assert_array_equal(out, np.rint(twelve * (255.0 / 4095)).astype(np.uint8))


def _save_png(path: Path, values: np.ndarray, significant_bits: int | None = None) -> None:
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    if significant_bits is not None:
        info.add(b"sBIT", bytes([significant_bits]))
    Image.fromarray(values).save(path, pnginfo=info)


def test_16_bit_grey_is_never_stretched_to_its_own_maximum(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 12-bit data whose brightest pixel is 3000: divided by 4095 (the 12-bit range), not by 3000
    dim = np.linspace(0, 3000, 30 * 40).reshape(30, 40).astype(np.uint16)
    _save_png(tmp_path / "dim.png", dim)
    with caplog.at_level(logging.INFO, logger="engine.io.photos"):
        study = open_study(tmp_path / "dim.png")
    np.testing.assert_array_equal(study.array[:, :, 0], np.rint(dim * (255.0 / 4095)).astype(np.uint8))
    assert study.array.max() == round(3000 * 255 / 4095) < 255
    note = study.description["scaling"]
    assert note == "16-bit grey read as 12-bit data (inferred from the largest value 3000): 0..4095 scaled to 0..255"
    [record] = [r for r in caplog.records if "dim.png" in r.getMessage()]
    assert record.levelno == logging.WARNING and note in record.getMessage()
    # 14-bit data: the 14-bit range
    fourteen = np.linspace(0, 16000, 30 * 40).reshape(30, 40).astype(np.uint16)
    _save_png(tmp_path / "fourteen.png", fourteen)
    np.testing.assert_array_equal(open_study(tmp_path / "fourteen.png").array[:, :, 0],
                                  np.rint(fourteen * (255.0 / 16383)).astype(np.uint8))


def test_16_bit_grey_uses_the_depth_the_png_declares(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # sBIT says 12 bits: a dark image (up to 1000) stays dark instead of being read as 10-bit data
    dark = np.linspace(0, 1000, 30 * 40).reshape(30, 40).astype(np.uint16)
    _save_png(tmp_path / "declared.png", dark, significant_bits=12)
    with caplog.at_level(logging.INFO, logger="engine.io.photos"):
        study = open_study(tmp_path / "declared.png")
    np.testing.assert_array_equal(study.array[:, :, 0], np.rint(dark * (255.0 / 4095)).astype(np.uint8))
    assert study.description["scaling"] == (
        "16-bit grey read as 12-bit data (declared by the file): 0..4095 scaled to 0..255")
    assert [r.levelno for r in caplog.records if "declared.png" in r.getMessage()] == [logging.INFO]
    # Without sBIT the same pixels are read as 10-bit data
    _save_png(tmp_path / "undeclared.png", dark)
    assert "10-bit data" in open_study(tmp_path / "undeclared.png").description["scaling"]
    # A declaration the values contradict is overruled, and the note says so
    _save_png(tmp_path / "wrong.png", dark * 16, significant_bits=10)
    assert "the 10 bits the file declares cannot hold it" in open_study(tmp_path / "wrong.png").description["scaling"]


def test_8_bit_photos_carry_no_scaling_note(tmp_path: Path) -> None:
    Image.fromarray(_rgb()).save(tmp_path / "p.png")
    assert "scaling" not in open_study(tmp_path / "p.png").description


def test_float_tiff_is_scaled_to_8_bits(tmp_path: Path) -> None:
    values = np.linspace(0.0, 1.0, 30 * 40, dtype=np.float32).reshape(30, 40)
    Image.fromarray(values, mode="F").save(tmp_path / "f.tif")
    study = open_study(tmp_path / "f.tif")
    assert study.array[0, 0, 0] == 0 and study.array[-1, -1, 0] == 255
    assert study.description["scaling"] == "float grey 0..1 scaled to 0..255"
    Image.fromarray(values * 500 - 20, mode="F").save(tmp_path / "wide.tif")
    assert open_study(tmp_path / "wide.tif").description["scaling"] == (
        "float grey scaled from its own range -20..480 to 0..255")


def test_multipage_tiff_uses_the_first_page(tmp_path: Path) -> None:
    first, second = Image.fromarray(_rgb(seed=3)), Image.fromarray(_rgb(seed=4))
    first.save(tmp_path / "pages.tif", save_all=True, append_images=[second])
    study = open_study(tmp_path / "pages.tif")
    np.testing.assert_array_equal(study.array, np.asarray(first))
    assert study.description["pages"].startswith("2")


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize(("width", "height"), [(12_000, 10_000), (30_000, 20_000)])
def test_huge_image_is_refused_before_decoding(tmp_path: Path, width: int, height: int) -> None:
    # A few hundred bytes declaring 120 and 600 megapixels: refused from the header alone
    path = tmp_path / "bomb.png"
    path.write_bytes(_png_header_only(width, height))
    with pytest.raises(DataError, match=r"megapixels|more pixels than FedSM reads") as info:
        open_study(path)
    assert "downscale" in str(info.value)


def test_limit_is_the_module_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Image.fromarray(_rgb()).save(tmp_path / "p.png")
    monkeypatch.setattr(photos, "MAX_PIXELS", 1000)
    with pytest.raises(DataError, match="40x30 pixels"):
        photos.read_photo(tmp_path / "p.png")


def test_broken_files_raise_data_errors(tmp_path: Path) -> None:
    (tmp_path / "text.png").write_text("this is not an image\n")
    with pytest.raises(DataError, match=r"text\.png.*not an image"):
        open_study(tmp_path / "text.png")
    Image.fromarray(_rgb()).save(tmp_path / "whole.png")
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.png.*(damaged|truncated)"):
        open_study(tmp_path / "cut.png")
    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        open_study(tmp_path / "empty.jpg")
    (tmp_path / "photo.gif").write_bytes(b"GIF89a")
    with pytest.raises(DataError, match="unsupported file type"):
        open_study(tmp_path / "photo.gif")


def test_list_series_of_a_photo_reads_only_the_header(tmp_path: Path) -> None:
    Image.fromarray(_rgb(20, 50)).save(tmp_path / "p.png")
    [info] = list_series(tmp_path / "p.png")
    assert info.uid == str(tmp_path / "p.png") and info.count == 1 and info.size == (20, 50)
    assert open_study(tmp_path / "p.png", series_uid=info.uid).shape == (20, 50)
