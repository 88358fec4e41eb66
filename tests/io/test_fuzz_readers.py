"""Property tests: whatever bytes or arrays a file holds, the readers give a valid Study, mask or a DataError.

The only exceptions a reader may raise are the engine's own (:mod:`engine.errors`); anything else
(``ValueError``, ``struct.error``, ``zlib.error`` ...) escaping a reader fails these tests.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from synthetic_dicom import canonical_study, write_series

from engine.errors import DataError, FedSMError
from engine.io.dicom_seg import read_dicom_seg, write_dicom_seg
from engine.io.masks import open_mask, read_mask
from engine.io.photos import SENSOR_DEPTHS
from engine.io.readers import list_series, open_study
from engine.io.study import LabelMap, Study

SUFFIXES = [".png", ".jpg", ".tif", ".bmp", ".nii", ".nii.gz", ".mha", ".nrrd", ".dcm", ""]
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_study(study: Study) -> None:
    if study.kind == "photo":
        assert study.array.dtype == np.uint8 and study.array.ndim == 3 and study.array.shape[2] == 3
    else:
        assert study.kind == "volume" and study.array.dtype == np.float32 and study.array.ndim == 3
        assert len(study.spacing) == 3 and all(s > 0 for s in study.spacing)
    assert study.affine.shape == (4, 4) and np.isfinite(study.affine).all()


def _open_or_data_error(path: Path) -> None:
    """The property: a valid study, or DataError; any other exception fails the test."""
    try:
        study = open_study(path)
    except DataError as exc:
        assert str(path.name) in str(exc) or str(path.parent) in str(exc)
        return
    _check_study(study)


@FUZZ
@given(data=st.binary(max_size=2048), suffix=st.sampled_from(SUFFIXES))
def test_random_bytes(data: bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"file{suffix}"
        path.write_bytes(data)
        _open_or_data_error(path)
        try:
            list_series(path)
        except DataError:
            pass


def _sample_files() -> dict[str, bytes]:
    """One small valid file of every format, as bytes."""
    rng = np.random.default_rng(0)
    out: dict[str, bytes] = {}
    rgb = rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    for suffix, fmt in ((".png", "PNG"), (".jpg", "JPEG"), (".tif", "TIFF"), (".bmp", "BMP")):
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format=fmt)
        out[suffix] = buffer.getvalue()
    with tempfile.TemporaryDirectory() as tmp:
        volume = rng.normal(size=(10, 9, 6)).astype(np.float32)
        for suffix in (".nii", ".nii.gz"):
            nib.save(nib.Nifti1Image(volume, np.diag([0.5, 0.5, 2.0, 1.0])), Path(tmp) / f"v{suffix}")
            out[suffix] = (Path(tmp) / f"v{suffix}").read_bytes()
        for suffix in (".mha", ".nrrd"):
            sitk.WriteImage(sitk.GetImageFromArray(volume), str(Path(tmp) / f"v{suffix}"))
            out[suffix] = (Path(tmp) / f"v{suffix}").read_bytes()
        paths, _ = write_series(Path(tmp) / "dicom", slices=1)
        out[".dcm"] = paths[0].read_bytes()
    return out


SAMPLES = _sample_files()


@FUZZ
@given(suffix=st.sampled_from(sorted(SAMPLES)), fraction=st.floats(0.0, 1.0), flip=st.integers(0, 10**6))
@example(suffix=".tif", fraction=0.13790676001749172, flip=783)  # Pillow's TIFF plugin raised TypeError
def test_truncated_or_corrupted_real_files(suffix: str, fraction: float, flip: int) -> None:
    data = bytearray(SAMPLES[suffix])
    data = data[: int(len(data) * fraction)]
    if data and flip % 3 == 0:  # sometimes a flipped byte as well
        data[flip % len(data)] ^= 0xFF
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"file{suffix}"
        path.write_bytes(bytes(data))
        _open_or_data_error(path)


def _expected_grey(stored: np.ndarray) -> np.ndarray:
    """The 8-bit grey :mod:`engine.io.photos` documents for a single-channel photo's stored values."""
    if stored.dtype == np.uint8:
        return stored
    if stored.dtype.kind == "f":
        lo, hi = float(stored.min()), float(stored.max())
        if lo >= 0.0 and hi <= 1.0:
            lo, hi = 0.0, 1.0
        return np.clip(np.rint((stored - lo) / ((hi - lo) or 1.0) * 255.0), 0, 255).astype(np.uint8)
    top = int(stored.max())
    bits = next((b for b in SENSOR_DEPTHS if top < 1 << b), top.bit_length())
    return np.rint(stored.astype(np.float64) * (255.0 / ((1 << bits) - 1))).astype(np.uint8)


@FUZZ
@given(
    shape=st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 5)),
    dtype=st.sampled_from(["uint8", "int16", "uint16", "float32", "float64", "int32"]),
    suffix=st.sampled_from([".nii.gz", ".mha", ".nrrd", ".png", ".tif"]),
    seed=st.integers(0, 1000),
)
def test_random_arrays_written_with_an_image_suffix(shape: tuple[int, int, int], dtype: str, suffix: str,
                                                    seed: int) -> None:
    """A file a real writer made must load and round-trip; only a photo with negative values is refused."""
    rng = np.random.default_rng(seed)
    array = (rng.normal(size=shape) * 1000).astype(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"a{suffix}"
        if suffix == ".nii.gz":
            nib.save(nib.Nifti1Image(array, np.eye(4)), path)
        elif suffix in (".mha", ".nrrd"):
            sitk.WriteImage(sitk.GetImageFromArray(array), str(path))
        else:
            try:
                Image.fromarray(array[:, :, 0]).save(path)
            except OSError:
                return  # Pillow cannot store this dtype in this format (float or int32 PNG): no file to read
        if suffix in (".png", ".tif"):
            with Image.open(path) as img:
                stored = np.asarray(img)
            if stored.dtype.kind == "i" and stored.min() < 0:  # a photo stores 0 (dark) upwards: invalid
                with pytest.raises(DataError, match=r"a\.(png|tif): has negative pixel values"):
                    open_study(path)
                return
        study = open_study(path)
        _check_study(study)
        if suffix in (".nii.gz", ".mha", ".nrrd"):
            assert sorted(study.shape) == sorted(shape)
            assert np.isclose(np.sort(study.array.ravel()), np.sort(array.astype(np.float32).ravel())).all()
        else:
            assert study.shape == shape[:2]
            expected = _expected_grey(stored)
            for channel in range(3):
                np.testing.assert_array_equal(study.array[:, :, channel], expected)


@settings(max_examples=20, deadline=None)
@given(cut=st.floats(0.0, 0.99), victim=st.integers(0, 2))
def test_dicom_folder_with_a_damaged_file(cut: float, victim: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths, _ = write_series(Path(tmp) / "s", slices=3)
        data = paths[victim].read_bytes()
        paths[victim].write_bytes(data[: int(len(data) * cut)])
        try:
            study = open_study(Path(tmp) / "s")
        except DataError:
            return
        _check_study(study)
        assert study.shape[2] == 3  # a study is never silently missing a slice


# --- masks ---------------------------------------------------------------------------------------

MASK_SUFFIXES = [".png", ".tif", ".nii", ".nii.gz", ".mha", ".nrrd", ".dcm", ""]


@pytest.fixture(scope="module")
def mask_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Study, bytes]]:
    """A study of each kind with one valid mask file per format, as bytes (the series stays on disk)."""
    folder = tmp_path_factory.mktemp("masks")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)).save(folder / "photo.png")
    photo = open_study(folder / "photo.png")
    paths, pixels = write_series(folder / "series", slices=3)
    volume = canonical_study(paths, pixels)
    labels = rng.integers(0, 3, volume.shape, dtype=np.uint8)
    Image.fromarray(rng.integers(0, 3, (24, 20), dtype=np.uint8)).save(folder / "m.png")
    nib.save(nib.Nifti1Image(labels, volume.affine), folder / "m.nii.gz")
    write_dicom_seg(volume, LabelMap(labels, {1: "prostate", 2: "lesion"}), folder / "m.dcm")
    return {suffix: (photo if suffix == ".png" else volume, (folder / f"m{suffix}").read_bytes())
            for suffix in (".png", ".nii.gz", ".dcm")}


def _mask_or_engine_error(path: Path, study: Study) -> None:
    """The property for masks: a label map on the study's grid, or an engine error naming the file."""
    readers = [lambda: read_mask(path, study).labels, lambda: open_mask(path, study)]
    if study.kind == "volume":
        readers.append(lambda: read_dicom_seg(path, study))
    for read in readers:
        try:
            labels = read()
        except FedSMError as exc:
            assert path.name in str(exc) or str(path.parent) in str(exc)
            continue
        assert labels.array.dtype == np.uint8 and labels.array.shape == tuple(study.shape)


@FUZZ
@given(data=st.binary(max_size=2048), suffix=st.sampled_from(MASK_SUFFIXES), photo=st.booleans())
def test_random_bytes_as_masks(mask_cases: dict[str, tuple[Study, bytes]], data: bytes, suffix: str,
                               photo: bool) -> None:
    study = mask_cases[".png" if photo else ".dcm"][0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"mask{suffix}"
        path.write_bytes(data)
        _mask_or_engine_error(path, study)


@FUZZ
@given(suffix=st.sampled_from([".png", ".nii.gz", ".dcm"]), fraction=st.floats(0.0, 1.0),
       flip=st.integers(0, 10**6))
def test_truncated_or_corrupted_masks(mask_cases: dict[str, tuple[Study, bytes]], suffix: str, fraction: float,
                                      flip: int) -> None:
    study, valid = mask_cases[suffix]
    data = bytearray(valid[: int(len(valid) * fraction)])
    if data and flip % 3 == 0:  # sometimes a flipped byte as well
        data[flip % len(data)] ^= 0xFF
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"mask{suffix}"
        path.write_bytes(bytes(data))
        _mask_or_engine_error(path, study)
