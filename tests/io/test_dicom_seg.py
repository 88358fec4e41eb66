"""DICOM SEG: written on a real or synthetic series, read back voxel for voxel; foreign SEGs read."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from synthetic_dicom import canonical_study, write_series
from testsupport import SHARED_DATA

from engine.errors import DataError
from engine.io.dicom_seg import build_dicom_seg, read_dicom_seg, write_dicom_seg
from engine.io.export import export_mask, read_provenance, sidecar_path
from engine.io.masks import open_mask
from engine.io.provenance import ImageRecord, Provenance
from engine.io.study import LabelMap, Study

DCMQI = SHARED_DATA / "dicom" / "dcmqi_ct3slice_with_SEG"
PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"


def random_labels(shape: tuple[int, ...], values: int = 2, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, values + 1, shape, dtype=np.uint8)


def provenance(slices: int) -> Provenance:
    return Provenance(
        bundle_name="supermodel.safetensors",
        bundle_sha256="ab" * 32,
        task="prostate",
        method="fedsm",
        routing="gamma",
        gamma=0.6,
        device="cpu",
        labels={1: "prostate", 2: "lesion"},
        images=tuple(
            ImageRecord(k, "north", 0.9, {"north": 0.9, "south": 0.1}, "south") for k in range(slices)
        ),
    )


# --- synthetic round trips -----------------------------------------------------------------------


@pytest.mark.parametrize(("angle", "sagittal"), [(0.0, False), (20.0, False), (135.0, False), (0.0, True)])
def test_seg_round_trip_on_a_synthetic_series(tmp_path: Path, angle: float, sagittal: bool) -> None:
    # Prepare: axial, mildly oblique, strongly rotated and sagittal acquisitions
    paths, pixels = write_series(tmp_path / "series", angle_deg=angle, sagittal=sagittal)
    study = canonical_study(paths, pixels)
    labels = LabelMap(random_labels(study.shape), {1: "prostate", 2: "lesion"})
    # Execute
    out = write_dicom_seg(study, labels, tmp_path / "mask.dcm", provenance(study.num_slices))
    back = read_dicom_seg(out, study)
    # Assert
    np.testing.assert_array_equal(back.array, labels.array)
    assert back.names == {1: "prostate", 2: "lesion"}
    assert back.array.dtype == np.uint8


def test_seg_frames_are_the_mask_in_each_source_image_pixel_order(tmp_path: Path) -> None:
    """Check the SEG against the source pixels directly, independently of our own reader."""
    paths, pixels = write_series(tmp_path / "series", angle_deg=0.0)
    # A mask that is exactly "pixel value above 500" in the source images' own (row, column) order.
    study = canonical_study(paths, pixels)
    canonical_mask = (study.array > 500).astype(np.uint8)
    seg = build_dicom_seg(study, LabelMap(canonical_mask, {1: "bright"}), None)
    seg_path = tmp_path / "seg.dcm"
    seg.save_as(seg_path, enforce_file_format=True)

    import highdicom as hd

    reread = hd.seg.segread(seg_path)
    by_file = {str(pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID): k for k, p in enumerate(paths)}
    uids = list(by_file)
    frames = reread.get_pixels_by_source_instance(uids, combine_segments=True, assert_missing_frames_are_empty=True)
    for uid, frame in zip(uids, frames, strict=True):
        np.testing.assert_array_equal(frame, (pixels[by_file[uid]] > 500).astype(frame.dtype))
    # References: the source series, every source image
    assert {u[2] for u in reread.get_source_image_uids()} <= set(uids)
    assert reread.ReferencedSeriesSequence[0].SeriesInstanceUID == study.series_uid


def test_empty_mask_round_trips(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "series", slices=3)
    study = canonical_study(paths, pixels)
    labels = LabelMap(np.zeros(study.shape, np.uint8), {1: "prostate"})
    back = read_dicom_seg(write_dicom_seg(study, labels, tmp_path / "m.dcm"), study)
    assert not back.array.any() and back.names == {1: "prostate"}


def test_export_dcm_writes_seg_and_provenance(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "series")
    study = canonical_study(paths, pixels)
    labels = LabelMap(random_labels(study.shape, values=1), {1: "prostate"})
    prov = provenance(study.num_slices)
    out = export_mask(study, labels, tmp_path / "out" / "case_mask.dcm", prov)
    ds = pydicom.dcmread(out)
    assert ds.Modality == "SEG"
    assert "gamma=0.6" in ds.ContentDescription and "abababab" in ds.ContentDescription
    algo = ds.SegmentSequence[0].SegmentAlgorithmName
    assert algo == "FedSM super model" and ds.SegmentSequence[0].SegmentAlgorithmType == "AUTOMATIC"
    params = ds.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0].AlgorithmParameters
    assert "bundle_sha256=" + "ab" * 32 in params
    assert read_provenance(out) == prov
    assert json.loads(sidecar_path(out).read_text())["images"][0]["model"] == "north"
    # Without the sidecar, the SEG's own summary is what is left.
    sidecar_path(out).unlink()
    summary = read_provenance(out)
    assert (summary.bundle_sha256, summary.gamma, summary.task, summary.images) == ("ab" * 32, 0.6, "prostate", ())


def highdicom_seg(paths: list[Path], pixel_array: np.ndarray, segments: list[str], seg_type: str, out: Path) -> Path:
    """A SEG written by highdicom itself (not by our writer), frames in source-file order."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    sources = [pydicom.dcmread(p) for p in paths]
    descriptions = [
        hd.seg.SegmentDescription(
            segment_number=n, segment_label=name, segmented_property_category=codes.cid7150.Tissue,
            segmented_property_type=codes.cid7150.Tissue, algorithm_type="MANUAL",
        )
        for n, name in enumerate(segments, start=1)
    ]
    seg = hd.seg.Segmentation(
        source_images=sources, pixel_array=pixel_array, segmentation_type=seg_type,
        segment_descriptions=descriptions, series_instance_uid=hd.UID(), series_number=5,
        sop_instance_uid=hd.UID(), instance_number=1, manufacturer="test", manufacturer_model_name="test",
        software_versions="1", device_serial_number="1",
    )
    seg.save_as(out, enforce_file_format=True)
    return out


def to_canonical(study: Study, paths: list[Path], per_file: np.ndarray) -> np.ndarray:
    """Place ``(files, rows, columns)`` arrays (in ``paths`` order) into the study's canonical order."""
    return canonical_study(paths, per_file.astype(np.float32)).array.astype(np.uint8)


def test_fractional_seg_is_thresholded_at_half(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", angle_deg=20.0)
    study = canonical_study(paths, pixels)
    probability = np.random.default_rng(3).random(pixels.shape).astype(np.float32)
    seg = highdicom_seg(paths, probability, ["tumour"], "FRACTIONAL", tmp_path / "frac.dcm")
    labels = read_dicom_seg(seg, study)
    # Stored as 0..255 (MaximumFractionalValue 255): inside when above 127.5, i.e. p > ~0.5.
    expected = to_canonical(study, paths, np.round(probability * 255) > 127.5)
    np.testing.assert_array_equal(labels.array, expected)
    assert labels.names == {1: "tumour"}


def test_several_overlapping_segments_become_values_by_segment_number(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s")
    study = canonical_study(paths, pixels)
    rng = np.random.default_rng(4)
    stacked = (rng.random((*pixels.shape, 3)) > 0.6).astype(np.uint8)  # 3 segments, overlapping
    stacked[..., 1] = 0  # segment 2 described but empty
    seg = highdicom_seg(paths, stacked, ["gland", "zone", "lesion"], "BINARY", tmp_path / "multi.dcm")
    labels = read_dicom_seg(seg, study)
    per_file = np.where(stacked[..., 2] > 0, 3, np.where(stacked[..., 0] > 0, 1, 0))  # higher number wins
    np.testing.assert_array_equal(labels.array, to_canonical(study, paths, per_file))
    assert labels.names == {1: "gland", 2: "zone", 3: "lesion"}


def test_seg_on_an_enhanced_multiframe_source(tmp_path: Path) -> None:
    """One multi-frame file (here highdicom's legacy conversion of a series) read by our DICOM reader."""
    import warnings

    import highdicom as hd

    paths, pixels = write_series(tmp_path / "s", angle_deg=20.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter notes attributes our synthetic files lack
        enhanced = hd.legacy.LegacyConvertedEnhancedMRImage(
            [pydicom.dcmread(p) for p in paths], hd.UID(), 9, hd.UID(), 1
        )
    (tmp_path / "mf").mkdir()
    enhanced.save_as(tmp_path / "mf" / "enhanced.dcm", enforce_file_format=True)
    study = _open_study(tmp_path / "mf")
    assert len(study.dicom_files) == 1 and study.shape == canonical_study(paths, pixels).shape
    labels = LabelMap(random_labels(study.shape), {1: "prostate", 2: "lesion"})
    back = read_dicom_seg(write_dicom_seg(study, labels, tmp_path / "seg.dcm"), study)
    np.testing.assert_array_equal(back.array, labels.array)


def test_seg_without_plane_positions_is_placed_by_its_source_references(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", angle_deg=20.0)
    study = canonical_study(paths, pixels)
    labels = LabelMap(random_labels(study.shape, 1), {1: "x"})
    ds = pydicom.dcmread(write_dicom_seg(study, labels, tmp_path / "seg.dcm"))
    # Strip the plane positions (and the dimension indexing on them), keep the source references.
    ds.DimensionIndexSequence = [d for d in ds.DimensionIndexSequence if d.DimensionIndexPointer != 0x00200032]
    for item in ds.PerFrameFunctionalGroupsSequence:
        del item.PlanePositionSequence
        content = item.FrameContentSequence[0]
        content.DimensionIndexValues = content.DimensionIndexValues[:1]
    ds.save_as(tmp_path / "no_positions.dcm")
    back = read_dicom_seg(tmp_path / "no_positions.dcm", study)
    np.testing.assert_array_equal(back.array, labels.array)


# --- refusals ------------------------------------------------------------------------------------


def test_seg_of_another_geometry_is_refused_with_both_geometries(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "a", spacing=(0.8, 0.6))
    study = canonical_study(paths, pixels)
    seg = write_dicom_seg(study, LabelMap(random_labels(study.shape, 1), {1: "x"}), tmp_path / "a.dcm")
    other_paths, other_pixels = write_series(tmp_path / "b", spacing=(0.4, 0.6), rows=24)
    other = canonical_study(other_paths, other_pixels)
    with pytest.raises(DataError, match=r"does not match the study's geometry") as info:
        read_dicom_seg(seg, other)
    message = str(info.value)
    assert "12x10 pixels of 0.8x0.6 mm" in message  # the SEG's geometry
    assert "shape (10, 24, 4), spacing 0.6x0.4x2.5 mm" in message  # the study's
    assert "pixel size differs" in message


def test_seg_shifted_by_half_a_voxel_is_refused(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "a")
    study = canonical_study(paths, pixels)
    seg = write_dicom_seg(study, LabelMap(random_labels(study.shape, 1), {1: "x"}), tmp_path / "a.dcm")
    shifted_affine = study.affine.copy()
    shifted_affine[0, 3] += 0.5 * study.spacing[0]
    shifted = Study(study.array, "volume", shifted_affine, study.spacing, source_format="nifti")
    with pytest.raises(DataError, match=r"fall up to 0\.50 voxel"):
        read_dicom_seg(seg, shifted)


def test_seg_needs_a_dicom_study(tmp_path: Path) -> None:
    study = Study(np.zeros((4, 4, 2), np.float32), "volume", np.eye(4), (1.0, 1.0, 1.0), source_format="nifti")
    with pytest.raises(DataError, match=r"export the mask as NIfTI"):
        export_mask(study, LabelMap(np.zeros((4, 4, 2), np.uint8), {1: "x"}), tmp_path / "m.dcm")
    assert list(tmp_path.iterdir()) == []


def test_unnamed_label_values_are_refused(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=2)
    study = canonical_study(paths, pixels)
    with pytest.raises(DataError, match=r"values \[2\] have no structure name"):
        write_dicom_seg(study, LabelMap(random_labels(study.shape), {1: "x"}), tmp_path / "m.dcm")
    assert not (tmp_path / "m.dcm").exists()


def test_reading_a_non_seg_dicom(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=2)
    study = canonical_study(paths, pixels)
    with pytest.raises(DataError, match=r"DICOM MR, not a segmentation"):
        read_dicom_seg(paths[0], study)


def test_reading_garbage(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=2)
    study = canonical_study(paths, pixels)
    (tmp_path / "bad.dcm").write_bytes(b"\x00" * 200)
    with pytest.raises(DataError, match=r"bad\.dcm"):
        read_dicom_seg(tmp_path / "bad.dcm", study)


# --- damaged files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seg_on_series(tmp_path_factory: pytest.TempPathFactory) -> tuple[Study, Path]:
    """A 4-slice synthetic series, its study, and a two-segment SEG written on it."""
    folder = tmp_path_factory.mktemp("seg")
    paths, pixels = write_series(folder / "series")
    study = canonical_study(paths, pixels)
    seg = write_dicom_seg(study, LabelMap(random_labels(study.shape), {1: "prostate", 2: "lesion"}), folder / "m.dcm")
    return study, seg


# Fractions of the file kept: in the file meta, the header, its functional groups, the pixel data;
# negative: that many bytes cut from the end (the last frames' pixels).
CUTS = [0.0, 0.02, 0.05, 0.25, 0.5, 0.55, 0.75, 0.99, -1, -16]


@pytest.mark.parametrize("cut", CUTS)
def test_truncated_seg_is_a_data_error_naming_the_file(tmp_path: Path, seg_on_series: tuple[Study, Path],
                                                        cut: float) -> None:
    # Prepare
    study, seg = seg_on_series
    data = seg.read_bytes()
    keep = len(data) + int(cut) if cut < 0 else int(len(data) * cut)
    path = tmp_path / "cut_seg.dcm"
    path.write_bytes(data[:keep])
    # Execute / Assert: through the SEG reader and the mask reader that dispatches to it
    for read in (read_dicom_seg, open_mask):
        with pytest.raises(DataError, match=r"cut_seg\.dcm") as info:
            read(path, study)
        message = str(info.value)
        assert "truncated" in message or "damaged" in message or "empty" in message or "no DICOM" in message
        assert "copy" in message or "export" in message or "remove" in message  # what to do


def test_a_frame_that_cannot_be_decoded_names_the_frame(seg_on_series: tuple[Study, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import highdicom as hd

    study, seg = seg_on_series
    decode = hd.seg.Segmentation.get_stored_frame

    def broken(self: hd.seg.Segmentation, frame: int, as_index: bool = False) -> np.ndarray:
        if frame == 2:  # what highdicom raises for a frame whose pixel data is cut short
            raise ValueError("cannot reshape array of size 0 into shape (12,10)")
        return decode(self, frame, as_index=as_index)

    monkeypatch.setattr(hd.seg.Segmentation, "get_stored_frame", broken)
    with pytest.raises(DataError, match=r"m\.dcm: frame 3 of \d+ cannot be read \(ValueError: cannot reshape.*"
                                        r"damaged or truncated — export or copy it again"):
        read_dicom_seg(seg, study)


# --- real public data ------------------------------------------------------------------------------


def _open_study(path: Path) -> Study:
    """The study through the project's DICOM reader."""
    from engine.api import open_study

    return open_study(path)


@pytest.mark.skipif(not DCMQI.is_dir(), reason="shared data absent")
def test_dcmqi_seg_reads_back_as_its_nrrd_label_map() -> None:
    import SimpleITK as sitk

    study = _open_study(DCMQI)
    assert study.shape == (512, 512, 3)
    labels = read_dicom_seg(DCMQI / "liver.dcm", study)
    assert labels.names == {1: "Liver"}
    # The NRRD label map, put into the study's canonical order through its own LPS geometry.
    nrrd = sitk.ReadImage(str(DCMQI / "liver_seg.nrrd"))
    data = sitk.GetArrayFromImage(nrrd).transpose(2, 1, 0)  # (z, y, x) -> (x, y, z) = (c, r, k)
    lps = np.eye(4)
    lps[:3, :3] = np.asarray(nrrd.GetDirection()).reshape(3, 3) * np.asarray(nrrd.GetSpacing())
    lps[:3, 3] = nrrd.GetOrigin()
    canonical = nib.as_closest_canonical(nib.Nifti1Image(data.astype(np.uint8), np.diag([-1, -1, 1, 1]) @ lps))
    np.testing.assert_allclose(canonical.affine, study.affine, atol=1e-3)
    expected = np.asarray(canonical.dataobj)
    assert expected.sum() > 1000
    np.testing.assert_array_equal(labels.array, expected)


@pytest.mark.skipif(not PROSTATEX.is_dir(), reason="shared data absent")
def test_prostatex_seg_export_reads_back_identical(tmp_path: Path) -> None:
    study = _open_study(PROSTATEX)
    assert study.shape == (384, 384, 19)
    assert len(study.dicom_files) == 19
    # A mask with structure: an ellipsoid "gland" and a "lesion" inside it, plus an empty slice.
    i, j, k = np.meshgrid(*(np.arange(n) for n in study.shape), indexing="ij")
    gland = ((i - 190) / 60.0) ** 2 + ((j - 200) / 45.0) ** 2 + ((k - 9) / 6.0) ** 2 <= 1
    lesion = gland & (i > 200) & (j < 190)
    array = gland.astype(np.uint8) + lesion.astype(np.uint8)
    labels = LabelMap(array, {1: "prostate", 2: "lesion"})
    out = export_mask(study, labels, tmp_path / "prostatex_mask.dcm", provenance(study.num_slices))
    back = read_dicom_seg(out, study)
    np.testing.assert_array_equal(back.array, array)
    assert back.names == {1: "prostate", 2: "lesion"}
    from engine.api import open_mask  # the mask reader the app uses dispatches SEG files here

    np.testing.assert_array_equal(open_mask(out, study).array, array)
    ds = pydicom.dcmread(out, stop_before_pixels=True)
    assert ds.ReferencedSeriesSequence[0].SeriesInstanceUID == study.series_uid
