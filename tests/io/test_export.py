"""Mask export: NIfTI on the study's affine, PNG for photos, provenance read back, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from PIL import Image

from engine.errors import DataError
from engine.io.export import export_mask, mask_format, read_provenance, sidecar_path
from engine.io.provenance import ImageRecord, Provenance
from engine.io.study import LabelMap, Study


def oblique_affine() -> np.ndarray:
    """A DICOM-like affine: 0.5 x 0.5 x 3 mm voxels, tilted 18 degrees about x, off-centre origin."""
    a = np.deg2rad(18.0)
    rotation = np.array([[1.0, 0.0, 0.0], [0.0, np.cos(a), -np.sin(a)], [0.0, np.sin(a), np.cos(a)]])
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag([0.5, 0.5, 3.0])
    affine[:3, 3] = [-133.8, -99.2, -88.0]
    return affine


def volume_study(shape: tuple[int, int, int] = (20, 16, 5), affine: np.ndarray | None = None) -> Study:
    rng = np.random.default_rng(0)
    affine = oblique_affine() if affine is None else affine
    return Study(
        array=rng.normal(100.0, 10.0, shape).astype(np.float32),
        kind="volume",
        affine=affine,
        spacing=tuple(float(s) for s in nib.affines.voxel_sizes(affine)),
        modality="MR",
        source_format="dicom",
    )


def photo_study(height: int = 30, width: int = 40) -> Study:
    rng = np.random.default_rng(1)
    return Study(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "photo", np.eye(4), (1.0, 1.0),
                 modality="OP", source_format="png")


def labels_for(study: Study, values: int = 2, seed: int = 2) -> LabelMap:
    array = np.random.default_rng(seed).integers(0, values + 1, study.shape, dtype=np.uint8)
    names = {1: "rim", 2: "cup"} if study.kind == "photo" else {v: f"s{v}" for v in range(1, values + 1)}
    return LabelMap(array, names)


def provenance(n: int = 5, task: str = "prostate") -> Provenance:
    return Provenance(
        bundle_name="sm.safetensors",
        bundle_sha256="0123456789abcdef" * 4,
        task=task,
        method="fedsm",
        routing="gamma",
        gamma=0.75,
        device="cpu",
        forced_model=None,
        labels={1: "prostate"},
        images=tuple(
            ImageRecord(k, "global" if k % 2 else "siteA", 0.6 + 0.05 * k, {"siteA": 0.6 + 0.05 * k,
                        "siteB": 0.4 - 0.05 * k}, "siteB")
            for k in range(n)
        ),
    )


# --- NIfTI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mask.nii.gz", "mask.nii"])
def test_nifti_keeps_the_affine_and_the_labels(tmp_path: Path, name: str) -> None:
    study = volume_study()
    labels = labels_for(study)
    out = export_mask(study, labels, tmp_path / name)
    img = nib.load(str(out))
    assert img.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(np.asarray(img.dataobj), labels.array)
    np.testing.assert_allclose(img.get_sform(), study.affine, atol=1e-5)
    np.testing.assert_allclose(img.get_qform(), study.affine, atol=1e-5)
    assert int(img.header["sform_code"]) == 1 and int(img.header["qform_code"]) == 1
    assert img.header.get_intent()[0] == "label"


def test_nifti_lies_on_the_study_in_itk(tmp_path: Path) -> None:
    """ITK (Slicer, ITK-SNAP) puts every mask voxel where the study's affine says, in LPS."""
    study = volume_study()
    out = export_mask(study, labels_for(study), tmp_path / "mask.nii.gz")
    image = sitk.ReadImage(str(out))
    assert image.GetSize() == study.shape
    for index in [(0, 0, 0), (19, 0, 0), (0, 15, 4), (7, 11, 3)]:
        ras = study.affine @ np.r_[index, 1.0]
        lps = np.array(image.TransformIndexToPhysicalPoint(index))
        np.testing.assert_allclose(lps, ras[:3] * [-1, -1, 1], atol=1e-3)
    np.testing.assert_array_equal(sitk.GetArrayFromImage(image).transpose(2, 1, 0),
                                  np.asarray(nib.load(str(out)).dataobj))


def test_nifti_provenance_in_header_and_sidecar(tmp_path: Path) -> None:
    study = volume_study()
    prov = provenance(study.num_slices)
    out = export_mask(study, labels_for(study, 1), tmp_path / "case_mask.nii.gz", prov)
    side = sidecar_path(out)
    assert side == tmp_path / "case_mask.provenance.json"
    assert Provenance.from_dict(json.loads(side.read_text())) == prov
    header = nib.load(str(out)).header
    [ext] = [e for e in header.extensions if e.get_code() == 6]
    assert json.loads(ext.get_content())["bundle_sha256"] == prov.bundle_sha256
    assert header["descrip"].item().decode().startswith("FedSM prostate gamma=0.75")
    side.unlink()  # the header alone still carries the full record
    assert read_provenance(out) == prov
    assert read_provenance(out).models_used == {"global": 2, "siteA": 3}


def test_export_without_provenance_removes_a_stale_sidecar(tmp_path: Path) -> None:
    study = volume_study()
    out = export_mask(study, labels_for(study), tmp_path / "m.nii.gz", provenance(study.num_slices))
    export_mask(study, labels_for(study), out)
    assert not sidecar_path(out).exists()
    with pytest.raises(DataError, match="carries no FedSM provenance"):
        read_provenance(out)


# --- PNG -----------------------------------------------------------------------------------------


def test_png_for_a_photo_with_provenance(tmp_path: Path) -> None:
    study = photo_study()
    labels = labels_for(study)
    prov = provenance(1, task="fundus")
    out = export_mask(study, labels, tmp_path / "eye_mask.png", prov)
    with Image.open(out) as img:
        assert img.mode == "L"
        np.testing.assert_array_equal(np.asarray(img), labels.array)
    assert read_provenance(out) == prov
    assert not sidecar_path(out).exists()


def test_png_for_a_volume_is_refused(tmp_path: Path) -> None:
    study = volume_study()
    with pytest.raises(DataError, match=r"PNG holds one 2D image.*5 slices.*\.nii\.gz"):
        export_mask(study, labels_for(study), tmp_path / "m.png")
    assert list(tmp_path.iterdir()) == []


# --- bad input -----------------------------------------------------------------------------------


def test_mask_of_another_shape(tmp_path: Path) -> None:
    study = volume_study()
    with pytest.raises(DataError, match=r"\(20, 16, 4\) differs from the study's \(20, 16, 5\)"):
        export_mask(study, LabelMap(np.zeros((20, 16, 4), np.uint8), {}), tmp_path / "m.nii.gz")


def test_values_beyond_eight_bits(tmp_path: Path) -> None:
    study = volume_study()
    array = np.zeros(study.shape, np.int32)
    array[0, 0, 0] = 300
    with pytest.raises(DataError, match=r"0\.\.255.*0\.\.300"):
        export_mask(study, LabelMap(array, {300: "x"}), tmp_path / "m.nii.gz")
    # Smaller integer or boolean masks are stored as uint8.
    out = export_mask(study, LabelMap(array.clip(0, 1).astype(bool), {1: "x"}), tmp_path / "b.nii.gz")
    assert nib.load(str(out)).get_data_dtype() == np.uint8


def test_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"\.nii\.gz, \.nii, \.png, \.dcm"):
        mask_format(tmp_path / "m.mha")


def test_provenance_of_a_plain_file(tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(b"no png")
    with pytest.raises(DataError, match=r"x\.png: not an image file Pillow can read"):
        read_provenance(tmp_path / "x.png")
    with pytest.raises(DataError, match="not found"):
        read_provenance(tmp_path / "missing.nii.gz")


# --- atomicity -----------------------------------------------------------------------------------


def test_failed_nifti_write_leaves_nothing_and_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    study = volume_study()
    out = export_mask(study, labels_for(study), tmp_path / "m.nii.gz", provenance(study.num_slices))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def half_write(img: object, filename: str) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(nib, "save", half_write)
    with pytest.raises(DataError, match="disk full"):
        export_mask(study, labels_for(study, seed=9), out, provenance(study.num_slices))
    with pytest.raises(DataError, match="disk full"):
        export_mask(study, labels_for(study), tmp_path / "new.nii.gz", provenance(study.num_slices))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp files, no new mask


def test_failed_sidecar_leaves_no_mask(tmp_path: Path) -> None:
    study = volume_study()
    sidecar_path(tmp_path / "m.nii.gz").mkdir()  # the sidecar cannot be renamed onto a folder
    with pytest.raises(DataError, match="could not write"):
        export_mask(study, labels_for(study), tmp_path / "m.nii.gz", provenance(study.num_slices))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.provenance.json"]


# --- the provenance record itself -----------------------------------------------------------------


def test_provenance_json_round_trip_and_refusals() -> None:
    prov = provenance()
    assert Provenance.from_json(prov.to_json()) == prov
    data = prov.to_dict()
    with pytest.raises(DataError, match="not a FedSM provenance record"):
        Provenance.from_dict({**data, "format": "other"})
    with pytest.raises(DataError, match="version 99 is not supported"):
        Provenance.from_dict({**data, "format_version": 99})
    with pytest.raises(DataError, match="lacks the field 'task'"):
        Provenance.from_dict({k: v for k, v in data.items() if k != "task"})
    with pytest.raises(DataError, match=r"malformed.*confidence"):
        Provenance.from_dict({**data, "images": [{**data["images"][0], "confidence": "high"}]})
    with pytest.raises(DataError, match="not valid JSON"):
        Provenance.from_json("{")


# --- names back on re-open -------------------------------------------------------------------------


def test_exported_masks_reopen_with_their_label_names(tmp_path: Path) -> None:
    from dataclasses import replace

    from engine.io.masks import read_mask

    study = volume_study()
    out = export_mask(study, labels_for(study, 1), tmp_path / "case_mask.nii.gz", provenance(study.num_slices))
    assert read_mask(out, study).labels.names == {1: "prostate"}
    photo = photo_study()
    prov = replace(provenance(1, task="fundus"), labels={1: "optic disc rim", 2: "optic cup", 3: "absent"})
    out = export_mask(photo, labels_for(photo), tmp_path / "eye_mask.png", prov)
    assert read_mask(out, photo).labels.names == {1: "optic disc rim", 2: "optic cup"}  # only values present
    plain = export_mask(study, labels_for(study, 1), tmp_path / "plain.nii.gz")  # no provenance: generic names
    assert read_mask(plain, study).labels.names == {1: "label 1"}
