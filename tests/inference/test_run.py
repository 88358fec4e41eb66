"""Segmenting files on disk: masks, routing.json, and clear errors for inputs that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from engine.bundle import BundleMetadata, SuperModelBundle, file_sha256, load_bundle, save_bundle
from engine.data.preprocess import normalise_volume, slices_to_volume, volume_to_slices
from engine.errors import DataError
from engine.inference.predictor import SuperModelPredictor
from engine.inference.run import infer_path
from engine.inference.study import masks_to_label_map
from engine.io.files import read_label_png, read_nifti, write_nifti, write_rgb_png
from engine.io.privacy import content_name
from engine.models import build_segmentation_net, build_selector
from engine.tasks import TaskSpec, get_task

SITES = ["north", "south"]


def write_bundle(path: Path, task_name: str, method: str = "fedsm") -> Path:
    torch.manual_seed(0)
    task = get_task(task_name)
    meta = BundleMetadata(
        task=task.name,
        label_names=list(task.label_names),
        in_channels=task.in_channels,
        image_size=32,
        selector_size=32,
        site_names=SITES,
        method=method,
        routing="argmax" if method == "fedsm-extra" else "gamma",
        gamma=0.5,
    )
    out = task.out_channels
    save_bundle(
        path,
        SuperModelBundle(
            metadata=meta,
            global_weights=build_segmentation_net(task.in_channels, out).state_dict(),
            personal_weights={s: build_segmentation_net(task.in_channels, out).state_dict() for s in SITES},
            selector_weights=build_selector(task.in_channels, meta.selector_classes).state_dict(),
        ),
    )
    return path


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bundles")
    return {
        "fundus": write_bundle(folder / "fundus.safetensors", "fundus"),
        "prostate": write_bundle(folder / "prostate.safetensors", "prostate", method="fedsm-extra"),
    }


def photo(path: Path, height: int = 50, width: int = 70, seed: int = 0) -> Path:
    write_rgb_png(path, np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    return path


AFFINE = np.array(
    [
        [0.6, 0.0, 0.0, -12.5],
        [0.0, 0.7, 0.1, 30.0],
        [0.0, 0.0, 3.0, 7.25],
        [0.0, 0.0, 0.0, 1.0],
    ]
)


def volume(path: Path, shape: tuple[int, int, int] = (40, 36, 5)) -> Path:
    data = np.random.default_rng(1).normal(300.0, 80.0, shape).astype(np.float32)
    write_nifti(path, data, AFFINE)
    return path


# --- 2D photos -----------------------------------------------------------------------------------


def test_photo_gives_a_mask_png_and_routing_json(bundles: dict[str, Path], tmp_path: Path) -> None:
    # Prepare
    source = photo(tmp_path / "eye.png")
    out = tmp_path / "out"
    calls: list[tuple[int, int]] = []
    # Execute
    result = infer_path(
        bundles["fundus"], source, out, gamma=0.3, device="cpu", progress=lambda d, t: calls.append((d, t))
    )
    # Assert: the mask is named by the hash of the photo's bytes, never after the file
    case = content_name([source])
    assert case.startswith("case-") and len(case) == len("case-") + 10
    mask = read_label_png(out / f"{case}_mask.png")
    assert mask.shape == (50, 70)
    assert set(np.unique(mask)) <= {0, 1, 2}
    assert json.loads((out / "routing.json").read_text()) == result
    bundle_file = bundles["fundus"]
    # File names only: folders may name patients or sites (issue 16.6).
    assert result["bundle"] == {"path": bundle_file.name, "sha256": file_sha256(bundle_file)}
    assert result["gamma"] == 0.3
    assert result["device"] == "cpu"
    [entry] = result["inputs"]
    assert "input" not in entry and entry["case"] == case and result["names"] == "neutral"
    assert entry["mask"] == f"{case}_mask.png"
    assert entry["shape"] == [50, 70]
    [record] = entry["images"]
    assert record["index"] == 0
    assert record["model"] in ["global", *SITES]
    assert set(record["probabilities"]) == set(SITES)
    assert record["confidence"] == pytest.approx(max(record["probabilities"].values()))
    # routing decision follows Algorithm 2 with the given gamma
    best_site = max(record["probabilities"], key=record["probabilities"].get)
    assert record["model"] == (best_site if record["confidence"] > 0.3 else "global")
    assert calls[-1] == (2, 2)
    assert sorted(p.name for p in out.iterdir()) == [f"{case}_mask.png", "routing.json"]


def test_folder_of_photos(bundles: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    photo(folder / "b.jpg", 40, 40, seed=1)
    photo(folder / "a.png", 33, 47, seed=2)
    (folder / "notes.txt").write_text("ignored")
    result = infer_path(bundles["fundus"], folder, tmp_path / "out", device="cpu")
    # Inputs in name order (a, b), each a case named by its content
    assert [e["case"] for e in result["inputs"]] == [content_name([folder / "a.png"]), content_name([folder / "b.jpg"])]
    assert read_label_png(tmp_path / "out" / result["inputs"][0]["mask"]).shape == (33, 47)
    assert result["gamma"] == 0.5  # the bundle's
    kept = infer_path(bundles["fundus"], folder, tmp_path / "kept", device="cpu", keep_names=True)
    assert [e["mask"] for e in kept["inputs"]] == ["a_mask.png", "b_mask.png"]
    assert [e["input"] for e in kept["inputs"]] == ["a.png", "b.jpg"] and kept["names"] == "kept"


def test_inputs_of_equal_content_are_numbered(bundles: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    photo(folder / "a.png")
    (folder / "copy.png").write_bytes((folder / "a.png").read_bytes())
    result = infer_path(bundles["fundus"], folder, tmp_path / "out", device="cpu")
    case = content_name([folder / "a.png"])
    assert [e["mask"] for e in result["inputs"]] == [f"{case}_mask.png", f"{case}-2_mask.png"]


def test_rerun_into_the_input_folder_skips_old_masks(bundles: dict[str, Path], tmp_path: Path) -> None:
    photo(tmp_path / "eye.png")
    first = infer_path(bundles["fundus"], tmp_path, tmp_path, device="cpu")
    result = infer_path(bundles["fundus"], tmp_path, tmp_path, device="cpu")
    assert [e["mask"] for e in result["inputs"]] == [e["mask"] for e in first["inputs"]]
    assert [e["case"] for e in result["inputs"]] == [content_name([tmp_path / "eye.png"])]


# --- volumes -------------------------------------------------------------------------------------


def test_volume_gives_a_nifti_mask_with_the_source_affine(bundles: dict[str, Path], tmp_path: Path) -> None:
    source = volume(tmp_path / "case01.nii.gz")
    out = tmp_path / "out"
    result = infer_path(bundles["prostate"], source, out, device="cpu")
    img = nib.load(str(out / result["inputs"][0]["mask"]))
    assert img.shape == (40, 36, 5)
    np.testing.assert_allclose(img.affine, AFFINE, atol=1e-5)
    data = np.asarray(img.dataobj)
    assert data.dtype == np.uint8
    assert set(np.unique(data)) <= {0, 1}
    [entry] = result["inputs"]
    assert entry["kind"] == "volume"
    assert [r["index"] for r in entry["images"]] == [0, 1, 2, 3, 4]
    # FedSM-extra: probabilities over global + sites, argmax routing, no gamma.
    assert set(entry["images"][0]["probabilities"]) == {"global", *SITES}
    assert result["routing"] == "argmax" and result["gamma"] is None
    assert sum(entry["models_used"].values()) == 5
    # Slice z of the mask is the predictor's mask of slice z (no flips or transposes on the way).
    slices = volume_to_slices(normalise_volume(read_nifti(source)[0]))
    direct = SuperModelPredictor(load_bundle(bundles["prostate"]), device="cpu").predict(slices)
    np.testing.assert_array_equal(data, slices_to_volume(direct.masks[:, 0]))
    assert [r["model"] for r in entry["images"]] == direct.routed_names(SITES)


def test_multi_label_volumes_number_channels_from_one_later_wins() -> None:
    task = TaskSpec("two", 1, ("outer", "inner"), "volume-percentile-1-99", volumetric=True)
    masks = np.zeros((2, 3, 1, 1), dtype=np.uint8)
    masks[0, :2] = 1  # outer in slices 0, 1
    masks[1, 1:] = 1  # inner in slices 1, 2
    assert masks_to_label_map(task, masks).ravel().tolist() == [1, 2, 2]


def test_uncompressed_nifti(bundles: dict[str, Path], tmp_path: Path) -> None:
    volume(tmp_path / "case.nii", shape=(20, 24, 3))
    result = infer_path(bundles["prostate"], tmp_path / "case.nii", tmp_path / "out", device="cpu", keep_names=True)
    assert result["inputs"][0]["mask"] == "case_mask.nii.gz"
    assert nib.load(str(tmp_path / "out" / "case_mask.nii.gz")).shape == (20, 24, 3)


# --- errors --------------------------------------------------------------------------------------


def test_photo_with_a_prostate_bundle(bundles: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"2D photo.*prostate"):
        infer_path(bundles["prostate"], photo(tmp_path / "eye.png"), tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()


def test_volume_with_a_fundus_bundle(bundles: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"is a volume.*fundus"):
        infer_path(bundles["fundus"], volume(tmp_path / "v.nii.gz"), tmp_path / "out", device="cpu")


def test_unsupported_suffix(bundles: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not an image")
    with pytest.raises(DataError, match=r"unsupported.*\.nii\.gz.*\.png"):
        infer_path(bundles["fundus"], path, tmp_path / "out", device="cpu")


def test_file_named_like_dicom_but_is_not(bundles: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "scan.dcm"
    path.write_bytes(b"DICM")
    with pytest.raises(DataError, match=r"scan\.dcm.*no DICOM image"):
        infer_path(bundles["prostate"], path, tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()


def test_empty_folder(bundles: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no files to segment.*\.png"):
        infer_path(bundles["fundus"], tmp_path / "empty", tmp_path / "out", device="cpu")
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match="no files to segment"):
        infer_path(bundles["fundus"], tmp_path / "empty", tmp_path / "out", device="cpu")


def test_missing_input(bundles: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        infer_path(bundles["fundus"], tmp_path / "nope.png", tmp_path / "out", device="cpu")


def test_two_inputs_for_one_mask_name(bundles: dict[str, Path], tmp_path: Path) -> None:
    photo(tmp_path / "eye.png")
    photo(tmp_path / "eye.jpg", seed=1)
    with pytest.raises(DataError, match=r"eye_mask\.png"):
        infer_path(bundles["fundus"], tmp_path, tmp_path / "out", device="cpu", keep_names=True)
    # Named by content, they do not collide.
    result = infer_path(bundles["fundus"], tmp_path, tmp_path / "out", device="cpu")
    assert len({e["mask"] for e in result["inputs"]}) == 2


def test_unreadable_photo(bundles: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"broken\.png"):
        infer_path(bundles["fundus"], tmp_path / "broken.png", tmp_path / "out", device="cpu")


# --- DICOM series, MHA/NRRD, mask formats --------------------------------------------------------


def _corners_lps(image) -> set[tuple[float, ...]]:
    """Physical (LPS) points of an image's 8 corner voxels, as ITK (Slicer, ITK-SNAP) places them."""
    size = image.GetSize()
    return {
        tuple(round(v, 3) for v in image.TransformIndexToPhysicalPoint((i, j, k)))
        for i in (0, size[0] - 1) for j in (0, size[1] - 1) for k in (0, size[2] - 1)
    }


def test_dicom_folder_gives_a_seg_that_reads_back_as_the_segmentation(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    from synthetic_dicom import canonical_study, write_series

    from engine.inference.study import segment_study
    from engine.io.dicom_seg import read_dicom_seg
    from engine.io.export import read_provenance

    # Prepare: an oblique synthetic MR series in a folder, files named out of slice order
    paths, pixels = write_series(tmp_path / "case7", rows=40, columns=36, slices=5, angle_deg=15.0)
    out = tmp_path / "out"
    # Execute
    result = infer_path(bundles["prostate"], tmp_path / "case7", out, device="cpu", mask_format="dicom-seg")
    # Assert: the case is the hash of the series' files in slice order
    [entry] = result["inputs"]
    case = content_name(canonical_study(paths, pixels).dicom_files)
    assert entry["mask"] == f"{case}_mask.dcm" and entry["format"] == "dicom-seg"
    assert entry["series_uid"] == str(pydicom_uid(paths[0]))
    assert len(entry["images"]) == 5
    study = canonical_study(paths, pixels)
    expected = segment_study(bundles["prostate"], study, device="cpu")
    labels = read_dicom_seg(out / f"{case}_mask.dcm", study)
    np.testing.assert_array_equal(labels.array, expected.labels.array)
    assert [r["model"] for r in entry["images"]] == [r.model for r in expected.records]
    prov = read_provenance(out / f"{case}_mask.dcm")  # from the sidecar
    assert prov.bundle_sha256 == result["bundle"]["sha256"] and len(prov.images) == 5
    assert sorted(p.name for p in out.iterdir()) == [f"{case}_mask.dcm", f"{case}_mask.provenance.json",
                                                      "routing.json"]


def pydicom_uid(path: Path) -> str:
    import pydicom

    return str(pydicom.dcmread(path, stop_before_pixels=True).SeriesInstanceUID)


def test_dicom_folder_default_nifti_lies_on_the_series(bundles: dict[str, Path], tmp_path: Path) -> None:
    import SimpleITK as sitk
    from synthetic_dicom import write_series

    paths, _ = write_series(tmp_path / "case8", rows=20, columns=24, slices=3, angle_deg=30.0)
    result = infer_path(bundles["prostate"], tmp_path / "case8", tmp_path / "out", device="cpu")
    mask = sitk.ReadImage(str(tmp_path / "out" / result["inputs"][0]["mask"]))
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames([str(p) for p in paths])
    series = reader.Execute()
    assert _corners_lps(mask) == _corners_lps(series)


@pytest.mark.parametrize("suffix", [".mha", ".nrrd"])
def test_mha_and_nrrd_volumes(bundles: dict[str, Path], tmp_path: Path, suffix: str) -> None:
    import SimpleITK as sitk

    data = np.random.default_rng(3).normal(200.0, 50.0, (4, 30, 26)).astype(np.float32)  # (z, y, x)
    image = sitk.GetImageFromArray(data)
    image.SetSpacing((0.7, 0.8, 2.5))
    image.SetOrigin((10.0, -20.0, 5.0))
    a = np.deg2rad(10.0)
    image.SetDirection((np.cos(a), -np.sin(a), 0.0, np.sin(a), np.cos(a), 0.0, 0.0, 0.0, 1.0))
    source = tmp_path / f"vol{suffix}"
    sitk.WriteImage(image, str(source))
    calls: list[tuple[int, int]] = []
    result = infer_path(bundles["prostate"], source, tmp_path / "out", device="cpu",
                        progress=lambda d, t: calls.append((d, t)))
    assert result["inputs"][0]["mask"] == f"{content_name([source])}_mask.nii.gz"
    mask = sitk.ReadImage(str(tmp_path / "out" / result["inputs"][0]["mask"]))
    assert _corners_lps(mask) == _corners_lps(image)
    assert calls[-1] == (8, 8)  # 4 axial slices, counted from the header up front


def test_format_that_does_not_fit_the_input_is_refused_up_front(bundles: dict[str, Path], tmp_path: Path) -> None:
    source = volume(tmp_path / "v.nii.gz")
    with pytest.raises(DataError, match=r"PNG holds one 2D image; use --format nifti"):
        infer_path(bundles["prostate"], source, tmp_path / "out", device="cpu", mask_format="png")
    with pytest.raises(DataError, match=r"DICOM SEG must reference a DICOM series.*--format nifti"):
        infer_path(bundles["prostate"], source, tmp_path / "out", device="cpu", mask_format="dicom-seg")
    assert not (tmp_path / "out").exists()
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown mask format 'jpeg'"):
        infer_path(bundles["prostate"], source, tmp_path / "out", device="cpu", mask_format="jpeg")


def test_rerun_into_a_dicom_folder_skips_the_seg_it_wrote(bundles: dict[str, Path], tmp_path: Path) -> None:
    from synthetic_dicom import write_series

    write_series(tmp_path / "case9", rows=16, columns=16, slices=2)
    first = infer_path(bundles["prostate"], tmp_path / "case9", tmp_path / "case9", device="cpu",
                       mask_format="dicom-seg")
    second = infer_path(bundles["prostate"], tmp_path / "case9", tmp_path / "case9", device="cpu",
                        mask_format="dicom-seg")
    assert [e["mask"] for e in second["inputs"]] == [e["mask"] for e in first["inputs"]]
    assert len(first["inputs"]) == 1 and first["inputs"][0]["mask"].endswith("_mask.dcm")


def test_cli_format_flag(bundles: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main

    source = volume(tmp_path / "v.nii.gz", shape=(16, 16, 2))
    assert main(["infer", "--model", str(bundles["prostate"]), "--input", str(source), "--out",
                 str(tmp_path / "out"), "--device", "cpu", "--format", "nifti"]) == 0
    assert (tmp_path / "out" / f"{content_name([source])}_mask.nii.gz").is_file()
    assert main(["infer", "--model", str(bundles["prostate"]), "--input", str(source), "--out",
                 str(tmp_path / "out"), "--device", "cpu", "--format", "dicom-seg"]) == 2
    assert "DICOM SEG must reference a DICOM series" in capsys.readouterr().err


def test_dicom_file_and_folder_with_two_series(bundles: dict[str, Path], tmp_path: Path) -> None:
    from synthetic_dicom import write_series

    first, _ = write_series(tmp_path / "study" / "t2", rows=16, columns=16, slices=2, seed=1)
    write_series(tmp_path / "study" / "adc", rows=12, columns=10, slices=3, seed=2)
    # One file: its series.
    single = infer_path(bundles["prostate"], first[0], tmp_path / "one", device="cpu", keep_names=True)
    assert [(e["mask"], e["shape"]) for e in single["inputs"]] == [("t2_mask.nii.gz", [16, 16, 2])]
    # A folder: every series under it, masks told apart by series UID.
    both = infer_path(bundles["prostate"], tmp_path / "study", tmp_path / "two", device="cpu", keep_names=True)
    masks = sorted(e["mask"] for e in both["inputs"])
    assert len(masks) == 2 and all(m.startswith("study_") and m.endswith("_mask.nii.gz") for m in masks)
    assert sorted(len(e["images"]) for e in both["inputs"]) == [2, 3]
    # Named by content: two cases, neither named after the folder
    neutral = infer_path(bundles["prostate"], tmp_path / "study", tmp_path / "three", device="cpu")
    assert len({e["case"] for e in neutral["inputs"]}) == 2
    assert all(e["mask"].startswith("case-") for e in neutral["inputs"])



def test_colour_dicom_photo_with_a_fundus_bundle(bundles: dict[str, Path], tmp_path: Path) -> None:
    import pydicom
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    rgb = np.random.default_rng(5).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    ds = pydicom.Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.77.1.5.1"  # Ophthalmic Photography 8 Bit Image Storage
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID
    ds.StudyInstanceUID, ds.SeriesInstanceUID = generate_uid(), generate_uid()
    ds.Modality, ds.Rows, ds.Columns = "OP", 30, 40
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = rgb.tobytes()
    (tmp_path / "eye").mkdir()
    ds.save_as(tmp_path / "eye" / "photo.dcm", enforce_file_format=True)
    result = infer_path(bundles["fundus"], tmp_path / "eye", tmp_path / "out", device="cpu")
    [entry] = result["inputs"]
    assert (entry["mask"], entry["kind"], entry["shape"]) == (f"{entry['case']}_mask.png", "image", [30, 40])
    assert read_label_png(tmp_path / "out" / entry["mask"]).shape == (30, 40)
