"""DICOM folders: series listing, slice order by position, rescale, geometry checks and clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import generate_uid
from synthetic_dicom import canonical_study, write_series

from engine.errors import CancelledError, DataError
from engine.io.readers import list_series, open_study


def _edit(paths: list[Path], **values: object) -> None:
    for path in paths:
        ds = pydicom.dcmread(path)
        for keyword, value in values.items():
            setattr(ds, keyword, value)
        ds.save_as(path)


@pytest.mark.parametrize(("angle", "sagittal"), [(0.0, False), (20.0, False), (135.0, False), (0.0, True)])
def test_series_matches_nibabel_canonical_form(tmp_path: Path, angle: float, sagittal: bool) -> None:
    # Prepare: file names are shuffled against slice order by write_series
    paths, pixels = write_series(tmp_path / "s", slices=5, angle_deg=angle, sagittal=sagittal)
    expected = canonical_study(paths, pixels)
    # Execute
    study = open_study(tmp_path / "s")
    # Assert: voxels, affine and spacing equal nibabel's closest-canonical form of the DICOM geometry
    assert study.kind == "volume" and study.array.dtype == np.float32
    # A view of a slice-major buffer: positive strides (torch.from_numpy works), axial slices contiguous
    assert all(stride > 0 for stride in study.array.strides)
    assert study.array.flags.f_contiguous or sagittal
    np.testing.assert_array_equal(study.array, expected.array)
    np.testing.assert_allclose(study.affine, expected.affine, atol=1e-6)
    np.testing.assert_allclose(study.spacing, expected.spacing, atol=1e-6)
    assert study.series_uid == expected.series_uid and study.modality == "MR" and study.source_format == "dicom"
    assert sorted(study.dicom_files) == sorted(paths)
    if not sagittal:
        assert study.dicom_files == expected.dicom_files  # ordered along canonical k


def test_slices_are_ordered_by_position_not_by_name_or_instance_number(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=4)
    # Instance numbers that contradict the positions must not matter
    for path, number in zip(paths, (4, 1, 3, 2), strict=True):
        _edit([path], InstanceNumber=number)
    study = open_study(tmp_path / "s")
    np.testing.assert_array_equal(study.array, canonical_study(paths, pixels).array)
    assert study.description["slice_order"] == "ImagePositionPatient"


def test_rescale_slope_and_intercept_are_applied_per_slice(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=3)
    _edit(paths[:2], RescaleSlope="2", RescaleIntercept="-1024")
    _edit(paths[2:], RescaleSlope="0.5", RescaleIntercept="10")
    rescaled = pixels.astype(np.float32)
    rescaled[:2] = rescaled[:2] * 2 - 1024
    rescaled[2] = rescaled[2] * 0.5 + 10
    study = open_study(tmp_path / "s")
    np.testing.assert_allclose(study.array, canonical_study(paths, rescaled).array, rtol=1e-6)


def test_window_from_header_else_from_percentiles(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "a", slices=2)
    _edit(paths, WindowCenter=["40", "300"], WindowWidth=["400", "1500"])
    assert open_study(tmp_path / "a").window == (40.0, 400.0)
    write_series(tmp_path / "b", slices=2)
    center, width = open_study(tmp_path / "b").window
    assert 300 < center < 700 and 800 < width <= 1000  # pixels are uniform in [0, 1000)


def test_only_deidentified_descriptors_are_kept(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "s", slices=2)
    _edit(paths, PatientName="Doe^Jane", PatientID="MRN123", PatientBirthDate="19700101", AccessionNumber="ACC9",
          InstitutionName="General Hospital", SeriesDescription="t2 axial", MagneticFieldStrength="3")
    study = open_study(tmp_path / "s")
    text = repr(study.description)
    for secret in ("Doe", "MRN123", "19700101", "ACC9", "General Hospital", "20240101"):
        assert secret not in text
    assert study.description["SeriesDescription"] == "t2 axial"
    assert study.description["MagneticFieldStrength"] == "3"


def test_folder_with_two_series_lists_both_and_asks_which(tmp_path: Path) -> None:
    a_paths, a_pixels = write_series(tmp_path / "mixed", slices=3, seed=1)
    b_paths, _ = write_series(tmp_path / "other", slices=2, rows=8, columns=8, seed=2)
    for path in b_paths:  # the second series in the same folder, under other names
        shutil.move(str(path), tmp_path / "mixed" / f"b_{path.name}")
    _edit(list((tmp_path / "mixed").glob("b_*")), SeriesDescription="second")
    # Execute
    series = list_series(tmp_path / "mixed")
    # Assert
    assert len(series) == 2
    by_count = {s.count: s for s in series}
    assert by_count[3].size == (12, 10) and by_count[2].size == (8, 8) and by_count[2].description == "second"
    with pytest.raises(DataError) as info:
        open_study(tmp_path / "mixed")
    message = str(info.value)
    assert "2 image series" in message and by_count[3].uid in message and by_count[2].uid in message
    assert "second" in message and "3 images" in message
    study = open_study(tmp_path / "mixed", series_uid=by_count[3].uid)
    np.testing.assert_array_equal(study.array, canonical_study(a_paths, a_pixels).array)
    with pytest.raises(DataError, match=r"has no series 1.2.3"):
        open_study(tmp_path / "mixed", series_uid="1.2.3")


def test_one_series_of_two_sizes_names_the_series_and_both_sizes(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "s", slices=3)
    ds = pydicom.dcmread(paths[1])
    ds.Rows, ds.Columns = 6, 5
    ds.PixelData = np.zeros((6, 5), np.uint16).tobytes()
    ds.save_as(paths[1])
    with pytest.raises(DataError) as info:
        open_study(tmp_path / "s")
    message = str(info.value)
    assert ds.SeriesInstanceUID in message and "10x12" in message and "5x6" in message
    assert "choose one series" in message


def test_two_orientations_duplicate_positions_and_a_missing_slice_are_refused(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "o", slices=3)
    _edit(paths[:1], ImageOrientationPatient=["0", "1", "0", "0", "0", "-1"])
    with pytest.raises(DataError, match="two orientations"):
        open_study(tmp_path / "o")
    paths, _ = write_series(tmp_path / "d", slices=3)
    position = pydicom.dcmread(paths[0]).ImagePositionPatient
    _edit(paths[1:2], ImagePositionPatient=position)
    with pytest.raises(DataError, match="same position"):
        open_study(tmp_path / "d")
    paths, _ = write_series(tmp_path / "m", slices=5)
    paths[2].unlink()
    with pytest.raises(DataError, match=r"not evenly spaced.*missing"):
        open_study(tmp_path / "m")


def test_extension_less_files_in_subfolders_load_and_other_files_are_ignored(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "study" / "sub", slices=3)
    renamed = []
    for i, path in enumerate(paths):
        target = path.with_name(f"IM{i:04d}")
        path.rename(target)
        renamed.append(target)
    (tmp_path / "study" / "README").write_text("not dicom\n")
    (tmp_path / "study" / "notes.txt").write_text("hello\n")
    (tmp_path / "study" / "sub" / "label.nrrd").write_bytes(b"NRRD0004\n")
    study = open_study(tmp_path / "study")
    np.testing.assert_array_equal(study.array, canonical_study(renamed, pixels).array)
    assert study.source == tmp_path / "study"


def test_a_single_file_opens_its_whole_series(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=4)
    study = open_study(paths[2])
    assert study.shape[2] == 4
    np.testing.assert_array_equal(study.array, canonical_study(paths, pixels).array)
    [info] = list_series(paths[0])
    assert info.count == 4 and info.modality == "MR"


def test_single_slice_is_a_volume_of_one_slice_with_its_thickness(tmp_path: Path) -> None:
    write_series(tmp_path / "s", slices=1, thickness=2.5)
    study = open_study(tmp_path / "s")
    assert study.shape == (10, 12, 1)
    assert study.spacing == pytest.approx((0.6, 0.8, 2.5))
    assert study.num_slices == 1


def test_damaged_files_raise_data_errors_naming_them(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "t", slices=3)
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) - 100])  # pixel data cut short
    with pytest.raises(DataError, match=paths[1].name):
        open_study(tmp_path / "t")
    paths, _ = write_series(tmp_path / "h", slices=3)
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[:200])  # header cut short
    with pytest.raises(DataError, match=paths[0].name):
        open_study(tmp_path / "h")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "noise.dcm").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match=r"noise\.dcm"):
        open_study(tmp_path / "g")


def test_empty_folder_and_folder_without_dicom_say_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert list_series(tmp_path / "empty") == []
    with pytest.raises(DataError, match="no DICOM image series found"):
        open_study(tmp_path / "empty")
    with pytest.raises(DataError, match="no such file or folder"):
        open_study(tmp_path / "absent")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.png").write_bytes(b"")
    (tmp_path / "photos" / "b.nii.gz").write_bytes(b"")
    with pytest.raises(DataError, match=r"no DICOM series but 2 image file\(s\) \(a\.png, b\.nii\.gz\); open one"):
        open_study(tmp_path / "photos")


def test_seg_objects_are_listed_but_not_opened_as_images(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=2)
    seg = pydicom.dcmread(paths[0])
    seg.Modality, seg.SeriesInstanceUID, seg.SeriesDescription = "SEG", generate_uid(), "Prostate segmentation"
    seg.SOPClassUID = seg.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.66.4"
    seg.save_as(tmp_path / "s" / "seg.dcm")
    series = list_series(tmp_path / "s")
    assert [s.modality for s in series] == ["MR", "SEG"]  # images first
    assert series[1].description == "Prostate segmentation"
    study = open_study(tmp_path / "s")  # one image series: the SEG does not make it ambiguous
    np.testing.assert_array_equal(study.array, canonical_study(paths, pixels).array)
    with pytest.raises(DataError, match="DICOM SEG"):
        open_study(tmp_path / "s", series_uid=series[1].uid)
    with pytest.raises(DataError, match="DICOM SEG"):
        open_study(tmp_path / "s" / "seg.dcm")


def test_files_without_series_uid_group_under_a_stable_key(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "s", slices=3)
    _edit(paths, SeriesInstanceUID="")
    [info] = list_series(tmp_path / "s")
    assert info.uid.startswith("nouid:") and info.count == 3
    study = open_study(tmp_path / "s", series_uid=info.uid)
    np.testing.assert_array_equal(study.array, canonical_study(paths, pixels).array)


def test_progress_and_cancel(tmp_path: Path) -> None:
    write_series(tmp_path / "s", slices=4)
    events: list[dict] = []
    open_study(tmp_path / "s", progress=events.append)
    reads = [e for e in events if "done" in e]
    assert [e["done"] for e in reads] == [1, 2, 3, 4] and all(e["total"] == 4 for e in reads)
    assert all(e["event"] == "status" and e["message"] for e in reads)
    calls = iter(range(100))
    with pytest.raises(CancelledError):
        open_study(tmp_path / "s", cancel=lambda: next(calls) >= 6)  # after the scan, during the read


def test_files_pydicom_cannot_decode_go_through_simpleitk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths, _ = write_series(tmp_path / "s", slices=3)
    _edit(paths, RescaleSlope="2", RescaleIntercept="-5")
    expected = open_study(tmp_path / "s").array

    def no_decoder(self: object) -> None:
        raise NotImplementedError("no pixel data handler for this transfer syntax")

    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array", property(no_decoder))
    np.testing.assert_allclose(open_study(tmp_path / "s").array, expected)  # GDCM applies the rescale itself


def _enhanced_from(paths: list[Path], out: Path) -> None:
    """One enhanced multi-frame file with the frames of ``paths`` in reverse order."""
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    slices = [pydicom.dcmread(p) for p in paths][::-1]
    ds = pydicom.dcmread(paths[-1])
    ds.NumberOfFrames = len(slices)
    ds.PixelData = b"".join(s.PixelData for s in slices)
    for keyword in ("ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing"):
        delattr(ds, keyword)
    shared = Dataset()
    orientation, measures = Dataset(), Dataset()
    orientation.ImageOrientationPatient = slices[0].ImageOrientationPatient
    measures.PixelSpacing, measures.SliceThickness = slices[0].PixelSpacing, slices[0].SliceThickness
    shared.PlaneOrientationSequence, shared.PixelMeasuresSequence = Sequence([orientation]), Sequence([measures])
    ds.SharedFunctionalGroupsSequence = Sequence([shared])
    frames = []
    for s in slices:
        group, position = Dataset(), Dataset()
        position.ImagePositionPatient = s.ImagePositionPatient
        group.PlanePositionSequence = Sequence([position])
        frames.append(group)
    ds.PerFrameFunctionalGroupsSequence = Sequence(frames)
    ds.save_as(out)


def test_enhanced_multiframe_file_reads_like_its_single_frames(tmp_path: Path) -> None:
    paths, pixels = write_series(tmp_path / "single", slices=4, angle_deg=10.0)
    (tmp_path / "multi").mkdir()
    _enhanced_from(paths, tmp_path / "multi" / "enhanced.dcm")
    study = open_study(tmp_path / "multi")
    expected = canonical_study(paths, pixels)
    np.testing.assert_array_equal(study.array, expected.array)
    np.testing.assert_allclose(study.affine, expected.affine, atol=1e-6)
    assert list_series(tmp_path / "multi")[0].count == 4


def _rle_compress(paths: list[Path]) -> None:
    from pydicom.uid import RLELossless

    for path in paths:
        ds = pydicom.dcmread(path)
        ds.compress(RLELossless)
        ds.save_as(path)


def test_compressed_series_decodes_in_parallel_to_the_same_voxels(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "s", slices=6)
    _edit(paths, RescaleSlope="2", RescaleIntercept="-5")
    expected = open_study(tmp_path / "s").array
    _rle_compress(paths)
    events: list[dict] = []
    study = open_study(tmp_path / "s", progress=events.append)
    np.testing.assert_array_equal(study.array, expected)
    assert [e["done"] for e in events if "done" in e] == [1, 2, 3, 4, 5, 6]


def test_compressed_series_cancel_stops_the_decoders(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "s", slices=6)
    _rle_compress(paths)
    calls = iter(range(100))
    with pytest.raises(CancelledError):
        open_study(tmp_path / "s", cancel=lambda: next(calls) >= 9)  # after the scan, during the read


def test_compressed_files_gdcm_cannot_read_go_through_pydicom(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.io.dicom_series as dicom_series

    paths, _ = write_series(tmp_path / "s", slices=3)
    _edit(paths, RescaleSlope="2", RescaleIntercept="-5")
    expected = open_study(tmp_path / "s").array
    _rle_compress(paths)

    def gdcm_fails(item: object) -> None:
        raise RuntimeError("GDCM cannot read this file")

    monkeypatch.setattr(dicom_series, "_gdcm_pixels", gdcm_fails)
    np.testing.assert_array_equal(open_study(tmp_path / "s").array, expected)
