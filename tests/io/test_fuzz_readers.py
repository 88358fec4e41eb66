"""Property tests: whatever bytes or arrays a file holds, the readers give a valid Study or a DataError."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import SimpleITK as sitk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from synthetic_dicom import write_series

from engine.errors import DataError
from engine.io.readers import list_series, open_study
from engine.io.study import Study

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
def test_truncated_or_corrupted_real_files(suffix: str, fraction: float, flip: int) -> None:
    data = bytearray(SAMPLES[suffix])
    data = data[: int(len(data) * fraction)]
    if data and flip % 3 == 0:  # sometimes a flipped byte as well
        data[flip % len(data)] ^= 0xFF
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"file{suffix}"
        path.write_bytes(bytes(data))
        _open_or_data_error(path)


@FUZZ
@given(
    shape=st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 5)),
    dtype=st.sampled_from(["uint8", "int16", "uint16", "float32", "float64", "int32"]),
    suffix=st.sampled_from([".nii.gz", ".mha", ".nrrd", ".png", ".tif"]),
    seed=st.integers(0, 1000),
)
def test_random_arrays_written_with_an_image_suffix(shape: tuple[int, int, int], dtype: str, suffix: str,
                                                    seed: int) -> None:
    rng = np.random.default_rng(seed)
    array = (rng.normal(size=shape) * 1000).astype(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"a{suffix}"
        if suffix == ".nii.gz":
            nib.save(nib.Nifti1Image(array, np.eye(4)), path)
        elif suffix in (".mha", ".nrrd"):
            sitk.WriteImage(sitk.GetImageFromArray(array), str(path))
        else:
            plane = array[:, :, 0]
            try:
                Image.fromarray(plane).save(path)
            except (TypeError, OSError, KeyError):
                return  # Pillow cannot store this dtype in this format: nothing to read
        try:
            study = open_study(path)
        except DataError:
            return
        _check_study(study)
        if suffix in (".nii.gz", ".mha", ".nrrd"):
            assert sorted(study.shape) == sorted(shape)
            assert np.isclose(np.sort(study.array.ravel()), np.sort(array.astype(np.float32).ravel())).all()
        else:
            assert study.shape == shape[:2]


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
