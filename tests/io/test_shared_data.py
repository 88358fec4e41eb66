"""The readers on real public images with expert masks (../shared/data; skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from PIL import Image
from testsupport import SHARED_DATA

from engine.data.preprocess import label_channels
from engine.io.masks import open_mask, read_mask
from engine.io.readers import list_series, open_study
from engine.tasks import get_task

pytestmark = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")

PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"
TOTALSEG_DICOM = SHARED_DATA / "dicom" / "TotalSegmentator_example_ct_dicom"
DCMQI = SHARED_DATA / "dicom" / "dcmqi_ct3slice_with_SEG"
I2CVB = SHARED_DATA / "prostate" / "I2CVB_T2W"
ORIGA = SHARED_DATA / "fundus" / "ORIGA"
DRISHTI = SHARED_DATA / "fundus" / "DrishtiGS1"
NIFTI = SHARED_DATA / "nifti" / "TotalSegmentator_examples"


def _sitk_canonical(folder: Path) -> nib.Nifti1Image:
    """SimpleITK's reading of a DICOM series, put in RAS+ closest-canonical order by nibabel."""
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    image = reader.Execute()
    lps = np.eye(4)
    lps[:3, :3] = np.asarray(image.GetDirection()).reshape(3, 3) * np.asarray(image.GetSpacing())
    lps[:3, 3] = image.GetOrigin()
    data = sitk.GetArrayFromImage(image).transpose(2, 1, 0).astype(np.float32)
    return nib.as_closest_canonical(nib.Nifti1Image(data, np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps))


def test_prostatex_geometry() -> None:
    study = open_study(PROSTATEX)
    # Canonical RAS+ order: i -> Right (the 384 columns), j -> Anterior (the 384 rows), k -> Superior (19 slices)
    assert study.shape == (384, 384, 19)
    assert nib.aff2axcodes(study.affine) == ("R", "A", "S")
    assert study.spacing == pytest.approx((0.5, 0.5, 3.0), abs=1e-6)
    assert study.modality == "MR" and study.description["SeriesDescription"] == "t2_tse_tra"
    assert study.window == (514.0, 1060.0)  # the header's WindowCenter/Width of the first slice along k
    # The oblique acquisition (tilted ~18.5 degrees about x) is kept in the affine
    assert abs(study.affine[2, 1]) > 0.1
    # dicom_files run inferior -> superior along k
    z = [float(pydicom.dcmread(p, stop_before_pixels=True).ImagePositionPatient[2]) for p in study.dicom_files]
    assert z == sorted(z) and len(z) == 19
    [info] = list_series(PROSTATEX)
    assert (info.count, info.size, info.modality) == (19, (384, 384), "MR")


@pytest.mark.parametrize("folder", [PROSTATEX, I2CVB / "t2w_series", TOTALSEG_DICOM],
                         ids=["prostatex", "i2cvb", "totalsegmentator"])
def test_dicom_series_equals_simpleitk(folder: Path) -> None:
    study = open_study(folder)
    expected = _sitk_canonical(folder)
    np.testing.assert_array_equal(study.array, np.asarray(expected.dataobj))
    np.testing.assert_allclose(study.affine, expected.affine, atol=1e-3)


def test_jpeg2000_series_decoded_by_pydicom_equals_gdcm(monkeypatch: pytest.MonkeyPatch) -> None:
    # GDCM decodes single-frame compressed files first (speed); pydicom is the fallback: same voxels
    import engine.io.dicom_series as dicom_series

    by_gdcm = open_study(TOTALSEG_DICOM).array

    def gdcm_fails(item: object) -> None:
        raise RuntimeError("GDCM disabled for this test")

    monkeypatch.setattr(dicom_series, "_gdcm_pixels", gdcm_fails)
    np.testing.assert_array_equal(open_study(TOTALSEG_DICOM).array, by_gdcm)


def test_extension_less_totalsegmentator_folder_loads_with_its_label_map() -> None:
    assert all(p.suffix == "" or p.suffix[1:].isdigit() for p in TOTALSEG_DICOM.iterdir())
    [info] = list_series(TOTALSEG_DICOM)
    assert info.uid.startswith("nouid:") and info.count == 20  # the files have an empty SeriesInstanceUID
    study = open_study(TOTALSEG_DICOM)
    assert study.shape == (512, 512, 20) and study.modality == "CT"
    assert study.spacing == pytest.approx((0.9765625, 0.9765625, 2.0))
    assert study.array.min() == -1024.0  # RescaleIntercept -1024 applied: air in Hounsfield units
    assert study.window == (40.0, 300.0)
    labels = open_mask(NIFTI / "example_seg_dicom.nii.gz", study)  # same grid: no error, no resampling
    assert labels.array.shape == study.shape and len(labels.names) > 10
    body = study.array[labels.array > 0]
    assert body.mean() > -200  # organs are tissue, not air


def test_i2cvb_masks_lie_on_their_t2w_slices() -> None:
    t2w = open_study(I2CVB / "t2w_series")
    assert t2w.shape == (448, 360, 64) and t2w.spacing == pytest.approx((0.676, 0.676, 1.25), abs=1e-3)
    k_of = {p.name: k for k, p in enumerate(t2w.dicom_files)}
    gland = open_study(I2CVB / "gt_prostate")
    inverse = np.linalg.inv(t2w.affine)
    for k, path in enumerate(gland.dicom_files):
        # Mask slice k is at the world position of the T2W slice of the same file name
        voxel = inverse @ gland.affine @ np.array([0.0, 0.0, k, 1.0])
        np.testing.assert_allclose(voxel[:3], [0.0, 0.0, k_of[path.name]], atol=0.01)
    assert [k_of[p.name] for p in gland.dicom_files] == [29, 30, 31, 32, 33]
    reading = read_mask(I2CVB / "gt_prostate", t2w, "binary")
    assert reading.partial == "covers k 29..33 of 64" and reading.raw_values == ((0, 255),)
    prostate = reading.labels.array
    assert prostate[:, :, 29:34].sum(axis=(0, 1)).min() > 2000 and not prostate[:, :, :29].any()
    # The two zones lie inside the gland, and the cancer mostly (experts drew it separately)
    for zone in ("pz", "cg"):
        inside = open_mask(I2CVB / f"gt_{zone}", t2w, "binary").array
        assert inside.any() and not (inside & (prostate == 0)).any()
    cancer = open_mask(I2CVB / "gt_cap", t2w, "binary").array
    assert (cancer & prostate).sum() > 0.8 * cancer.sum()
    # The gland is brighter than the slices' average on T2W
    assert t2w.array[prostate > 0].mean() > t2w.array[:, :, 29:34].mean()
    with pytest.raises(Exception, match="covers only part"):
        read_mask(I2CVB / "gt_prostate", t2w, "binary", allow_partial=False)


@pytest.mark.parametrize("case", ["621", "622", "623", "624", "625", "626"])
def test_origa_label_mapping(case: str) -> None:
    photo = open_study(ORIGA / "images" / f"{case}.png")
    assert photo.kind == "photo" and photo.shape == (640, 640)
    labels = open_mask(ORIGA / "masks" / f"{case}.png", photo, "origa")
    assert labels.names == {1: "rim", 2: "cup"} and set(np.unique(labels.array)) == {0, 1, 2}
    disc, cup = label_channels(get_task("fundus"), labels.array)
    raw = np.asarray(Image.open(ORIGA / "masks" / f"{case}.png"))
    np.testing.assert_array_equal(disc, raw >= 1)
    np.testing.assert_array_equal(cup, raw == 2)
    assert cup.sum() < disc.sum()


@pytest.mark.parametrize("case", ["002", "004"])
def test_drishti_soft_maps_binarised_by_majority(case: str) -> None:
    photo = open_study(DRISHTI / "images" / f"drishtiGS_{case}.png")
    labels = open_mask(DRISHTI / "masks" / f"drishtiGS_{case}_ODsegSoftmap.png", photo, "drishti").array
    disc_soft = np.asarray(Image.open(DRISHTI / "masks" / f"drishtiGS_{case}_ODsegSoftmap.png"))
    cup_soft = np.asarray(Image.open(DRISHTI / "masks" / f"drishtiGS_{case}_cupsegSoftmap.png"))
    assert set(np.unique(disc_soft)) == {0, 64, 128, 191, 255}
    np.testing.assert_array_equal(labels >= 1, disc_soft >= 128)
    np.testing.assert_array_equal(labels == 2, cup_soft >= 128)
    assert not ((cup_soft >= 128) & (disc_soft < 128)).any()  # the cup lies inside the disc
    # The vertical cup-to-disc ratio of the majority masks is close to the experts' own ratios
    rows = lambda mask: np.flatnonzero(mask.any(axis=1))  # noqa: E731
    disc_rows, cup_rows = rows(labels >= 1), rows(labels == 2)
    ratio = (cup_rows[-1] - cup_rows[0] + 1) / (disc_rows[-1] - disc_rows[0] + 1)
    experts = [float(v) for v in (DRISHTI / "masks" / f"drishtiGS_{case}_cdrValues.txt").read_text().split()]
    assert abs(ratio - np.mean(experts)) < 0.06


def test_feddg_photos_of_four_sites() -> None:
    sizes = {}
    for path in sorted((SHARED_DATA / "fundus" / "FedDG_demo_images_no_masks").iterdir()):
        study = open_study(path)
        sizes[path.name] = study.shape
        assert study.kind == "photo" and study.array.mean() > 10
    assert sizes["fundus_client2.jpg"] == (1474, 1474) and sizes["fundus_client1.png"] == (1845, 2050)


def test_nrrd_label_map_equals_the_dicom_seg_and_mha_loads(tmp_path: Path) -> None:
    ct = open_study(DCMQI)
    series = list_series(DCMQI)
    assert [s.modality for s in series] == ["CT", "SEG"]
    nrrd = open_study(DCMQI / "liver_seg.nrrd")
    assert nrrd.kind == "volume" and nrrd.shape == (512, 512, 3) and nrrd.source_format == "nrrd"
    np.testing.assert_allclose(nrrd.affine, ct.affine, atol=1e-3)
    from_nrrd = open_mask(DCMQI / "liver_seg.nrrd", ct)
    assert from_nrrd.array.sum() > 1000
    if Path(__file__).parent.joinpath("test_dicom_seg.py").exists():
        from_seg = open_mask(DCMQI / "liver.dcm", ct)
        assert from_seg.names == {1: "Liver"}
        np.testing.assert_array_equal(from_seg.array, from_nrrd.array)
    # MHA: the same volume written by SimpleITK reads back identical to its NIfTI source
    nifti = open_study(NIFTI / "example_ct_sm.nii.gz")
    sitk.WriteImage(sitk.ReadImage(str(NIFTI / "example_ct_sm.nii.gz")), str(tmp_path / "ct.mha"))
    mha = open_study(tmp_path / "ct.mha")
    np.testing.assert_array_equal(mha.array, nifti.array)
    np.testing.assert_allclose(mha.affine, nifti.affine, atol=1e-3)


@pytest.mark.parametrize(("image", "seg"), [("example_ct_sm", "example_seg"), ("example_mr_sm", "example_seg_mr")])
def test_nifti_examples_with_their_label_maps(image: str, seg: str) -> None:
    study = open_study(NIFTI / f"{image}.nii.gz")
    assert nib.aff2axcodes(study.affine) == ("R", "A", "S") and study.spacing == pytest.approx((3.0, 3.0, 3.0))
    labels = open_mask(NIFTI / f"{seg}.nii.gz", study)
    assert labels.array.shape == study.shape and len(labels.names) > 10
