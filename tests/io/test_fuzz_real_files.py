"""Fuzz every reader with mutated real files from ../shared/data: only engine errors may escape.

Seeds are real public files (ORIGA PNG crops, a FedDG JPEG photo, a ProstateX DICOM slice, the dcmqi
DICOM SEG, TotalSegmentator NIfTI volumes and a FedSM bundle header). Mutations (see
``hostile_files.py``): byte flips, truncation, header field edits and giant dimensions. Hypothesis
runs derandomized (same examples on every run) with no example database, so CI is deterministic.

Property: a reader returns a valid result or raises a :class:`engine.errors.FedSMError` subclass;
any other exception (``ValueError``, ``MemoryError``, ``RecursionError``, pydicom's
``BytesLengthException``, Pillow's ``DecompressionBombError`` ...) fails the test.
"""

from __future__ import annotations

import gzip
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import hostile_files as hf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testsupport import SHARED_DATA

from engine.errors import FedSMError

pytestmark = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")

ORIGA = SHARED_DATA / "fundus" / "ORIGA"
PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"
DCMQI = SHARED_DATA / "dicom" / "dcmqi_ct3slice_with_SEG"
NIFTI = SHARED_DATA / "nifti" / "TotalSegmentator_examples"
FEDDG_JPEG = SHARED_DATA / "fundus" / "FedDG_demo_images_no_masks" / "fundus_client2.jpg"

#: Examples per reader family: 5 families x 90 + 60 SEG + 40 NRRD = 550 mutated files per run.
EXAMPLES = 90
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
#: Non-project exceptions seen: the test asserts this list stays empty.
COUNT: dict[str, int] = {"files": 0}
#: Families whose fuzz test ran in this session (the coverage check needs all of them).
RAN: set[str] = set()


def _bundle_seed() -> bytes:
    from engine.bundle.supermodel import BundleMetadata

    meta = BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32,
                          selector_size=32, site_names=["alpha", "beta"])
    header = {"__metadata__": {"fedsm": meta.to_json()}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return hf.safetensors_with_header(header) + b"\x00" * 4


def _run(name: str, suffix: str, data: bytes, readers: list[Callable[[Path], object]]) -> None:
    """Write ``data`` and call each reader on it; only FedSMError (or success) is allowed."""
    COUNT["files"] += 1
    RAN.add(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}{suffix}"
        path.write_bytes(data)
        for read in readers:
            try:
                read(path)
            except FedSMError as exc:
                assert str(exc).strip(), "an engine error must say something"
            except Exception as exc:  # the property under test
                raise AssertionError(f"{read.__name__} on a mutated {name}{suffix} raised "
                                     f"{type(exc).__name__}: {exc}") from exc


# --- readers ---------------------------------------------------------------------------------------


def _open_study(path: Path) -> object:
    from engine.io.readers import open_study

    return open_study(path)


def _list_series(path: Path) -> object:
    from engine.io.readers import list_series

    return list_series(path)


def _read_rgb(path: Path) -> object:
    from engine.io.files import read_rgb_image

    return read_rgb_image(path)


def _read_label_png(path: Path) -> object:
    from engine.io.files import read_label_png

    return read_label_png(path)


def _read_nifti(path: Path) -> object:
    from engine.io.files import read_nifti

    return read_nifti(path)


def _read_metadata(path: Path) -> object:
    from engine.bundle.supermodel import read_metadata

    return read_metadata(path)


@pytest.fixture(scope="module")
def studies() -> dict[str, object]:
    """Real studies the mutated masks are read onto."""
    from engine.io.readers import open_study

    return {"photo": open_study(ORIGA / "images" / "621.png"), "ct": open_study(DCMQI)}


def _mask_on(study: object) -> Callable[[Path], object]:
    def read_mask_onto(path: Path) -> object:
        from engine.io.masks import read_mask

        return read_mask(path, study)  # type: ignore[arg-type]

    return read_mask_onto


def _seg_on(study: object) -> Callable[[Path], object]:
    def read_seg_onto(path: Path) -> object:
        from engine.io.dicom_seg import read_dicom_seg

        return read_dicom_seg(path, study)  # type: ignore[arg-type]

    return read_seg_onto


SEEDS = {
    "png": (ORIGA / "images" / "622.png", [hf.flip_bytes, hf.truncate, hf.png_dims]),
    "label": (ORIGA / "masks" / "621.png", [hf.flip_bytes, hf.truncate, hf.png_dims]),
    "jpeg": (FEDDG_JPEG, [hf.flip_bytes, hf.truncate, hf.jpeg_dims]),
    "dicom": (PROSTATEX / "1-01.dcm", [hf.flip_bytes, hf.truncate, hf.dicom_field_edit, hf.dicom_unknown_vr,
                                       hf.dicom_length_edit]),
    "seg": (DCMQI / "liver.dcm", [hf.flip_bytes, hf.truncate, hf.dicom_field_edit, hf.dicom_unknown_vr,
                                  hf.dicom_length_edit]),
    "nifti": (NIFTI / "example_seg_mr.nii.gz", [hf.flip_bytes, hf.truncate, hf.nifti_header_edit]),
    "nrrd": (DCMQI / "liver_seg.nrrd", [hf.flip_bytes, hf.truncate, hf.nrrd_header_edit]),
}
_CACHE: dict[str, bytes] = {}


def _seed(name: str) -> bytes:
    if name not in _CACHE:
        if name == "nifti":  # fuzz the uncompressed file: header edits reach nibabel directly
            _CACHE[name] = gzip.decompress(SEEDS[name][0].read_bytes())
        elif name == "jpeg":  # a smaller JPEG of the real photo keeps each decode fast
            import io

            from PIL import Image

            with Image.open(SEEDS[name][0]) as img:
                small = img.convert("RGB").resize((400, 400))
            buffer = io.BytesIO()
            small.save(buffer, format="JPEG", quality=85)
            _CACHE[name] = buffer.getvalue()
        else:
            _CACHE[name] = SEEDS[name][0].read_bytes()
    return _CACHE[name]


def _mutated(name: str, which: int, seed: int) -> bytes:
    mutations = SEEDS[name][1]
    rng = np.random.default_rng(seed)
    data = mutations[which % len(mutations)](_seed(name), rng)
    if rng.random() < 0.2:  # sometimes two mutations
        data = mutations[int(rng.integers(0, len(mutations)))](data, rng) if data else data
    return data


SEED_INTS = st.integers(0, 2**32 - 1)
WHICH = st.integers(0, 11)


@FUZZ
@given(which=WHICH, seed=SEED_INTS, label=st.booleans())
def test_fuzz_photos_and_label_maps(studies: dict[str, object], which: int, seed: int, label: bool) -> None:
    name = "label" if label else "png"
    readers = [_open_study, _list_series, _read_rgb, _read_label_png, _mask_on(studies["photo"])]
    _run(name, ".png", _mutated(name, which, seed), readers)


@FUZZ
@given(which=WHICH, seed=SEED_INTS)
def test_fuzz_jpeg(which: int, seed: int) -> None:
    _run("photo", ".jpg", _mutated("jpeg", which, seed), [_open_study, _list_series, _read_rgb])


@FUZZ
@given(which=WHICH, seed=SEED_INTS)
def test_fuzz_dicom_slices(which: int, seed: int) -> None:
    _run("slice", ".dcm", _mutated("dicom", which, seed), [_open_study, _list_series])


@settings(FUZZ, max_examples=60)  # highdicom reads each SEG whole: the slowest family
@given(which=WHICH, seed=SEED_INTS)
def test_fuzz_dicom_seg(studies: dict[str, object], which: int, seed: int) -> None:
    # read_mask dispatches a SEG to read_dicom_seg (after its own header check): both are covered.
    _run("liver", ".dcm", _mutated("seg", which, seed), [_mask_on(studies["ct"]), _list_series])


@FUZZ
@given(which=WHICH, seed=SEED_INTS, compressed=st.booleans())
def test_fuzz_nifti(which: int, seed: int, compressed: bool) -> None:
    data = _mutated("nifti", which, seed)
    suffix = ".nii"
    if compressed:
        data, suffix = gzip.compress(data, compresslevel=1, mtime=0), ".nii.gz"
    _run("volume", suffix, data, [_open_study, _list_series, _read_nifti])


@settings(FUZZ, max_examples=40)
@given(which=WHICH, seed=SEED_INTS)
def test_fuzz_nrrd(studies: dict[str, object], which: int, seed: int) -> None:
    _run("labels", ".nrrd", _mutated("nrrd", which, seed), [_open_study, _list_series, _mask_on(studies["ct"])])


@FUZZ
@given(seed=SEED_INTS, flip=st.booleans())
def test_fuzz_bundle_metadata(seed: int, flip: bool) -> None:
    rng = np.random.default_rng(seed)
    data = hf.bundle_metadata_edit(_bundle_seed(), rng)
    if flip:
        data = hf.flip_bytes(data, rng)
    _run("model", ".safetensors", data, [_read_metadata])


def test_fuzz_covered_enough_files() -> None:
    """Runs after the fuzz tests above (file order): at least 500 mutated files were read."""
    if len(RAN) < 8:  # png, label, photo, slice, liver, volume, labels, model
        pytest.skip("run with all the fuzz tests of this module")
    assert COUNT["files"] >= 500, COUNT


def test_seeds_are_valid_files(studies: dict[str, object]) -> None:
    """The unmutated seeds read fine, so the fuzz starts from real, valid files."""
    start = time.perf_counter()
    for name in ("png", "label", "jpeg", "dicom"):
        _run(name, ".dcm" if name == "dicom" else (".jpg" if name == "jpeg" else ".png"), _seed(name), [_open_study])
    _run("liver", ".dcm", _seed("seg"), [_seg_on(studies["ct"])])
    _run("volume", ".nii", _seed("nifti"), [_open_study])
    _run("model", ".safetensors", _bundle_seed(), [_read_metadata])
    assert time.perf_counter() - start < 30
