"""Open real public studies (../shared/data) in the app through the engine's readers."""

from __future__ import annotations

import numpy as np
import pytest
from gui_helpers import SHARED_DATA

import engine.api
from fedsm_gui.models.overlay import REFERENCE_LAYER

pytestmark = [
    pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present"),
    pytest.mark.skipif(not hasattr(engine.api, "list_series"), reason="study readers not in engine.api yet"),
]
WAIT_MS = 60_000


def _open(app, qtbot, path):
    before = app.viewer_state.study
    app.studies.open_path(path)
    qtbot.waitUntil(lambda: app.viewer_state.study is not before or app.window.banner.isVisibleTo(app.window),
                    timeout=WAIT_MS)
    assert app.viewer_state.study is not before, app.window.banner.label.text()
    return app.viewer_state.study


def test_fundus_photo_with_its_expert_mask_and_cup_to_disc_ratio(fedsm_app, qtbot):
    app = fedsm_app
    study = _open(app, qtbot, SHARED_DATA / "fundus/ORIGA/images/621.png")
    assert study.kind == "photo" and study.shape == (640, 640)
    assert app.viewer_state.views == ("photo",)
    app.studies.open_mask(SHARED_DATA / "fundus/ORIGA/masks/621.png")
    qtbot.waitUntil(lambda: REFERENCE_LAYER in app.overlays.layers, timeout=WAIT_MS)
    ratio = app.window.segmentation_panel.cdr_label.text()
    assert ratio.startswith("Vertical cup-to-disc ratio: reference 0.")
    assert app.recent.paths[0].endswith("621.png")


def test_drishti_soft_maps_open_as_one_binarised_disc_and_cup_map(fedsm_app, qtbot):
    app = fedsm_app
    drishti = SHARED_DATA / "fundus/DrishtiGS1"
    study = _open(app, qtbot, drishti / "images/drishtiGS_002.png")
    app.studies.open_mask(drishti / "masks/drishtiGS_002_cupsegSoftmap.png")  # either map of the pair
    qtbot.waitUntil(lambda: REFERENCE_LAYER in app.overlays.layers, timeout=WAIT_MS)
    layer = app.overlays.layers[REFERENCE_LAYER]
    assert set(np.unique(layer.labels.array)) == {0, 1, 2}
    assert {v: s.name for v, s in layer.styles.items()} == {1: "rim", 2: "cup"}
    assert layer.labels.array.shape == study.shape
    ratio = app.window.segmentation_panel.cdr_label.text()
    assert ratio.startswith("Vertical cup-to-disc ratio: reference 0.")


def test_dicom_series_in_three_views(fedsm_app, qtbot):
    app = fedsm_app
    study = _open(app, qtbot, SHARED_DATA / "dicom/ProstateX-0000_t2_tse_tra")
    assert study.kind == "volume" and study.shape == (384, 384, 19)
    assert app.viewer_state.views == ("axial", "coronal", "sagittal")
    assert next(iter(app.viewer_state.presets)) == "Default (from file)"  # the DICOM window
    axial = app.window.viewer.canvas("axial")
    assert axial._arrays[0].shape == (384, 384) and axial._markers == ("A", "P", "R", "L")
    coronal = app.window.viewer.canvas("coronal")
    assert coronal._arrays[0].shape == (19, 384)
    # 3 mm slices against 0.5 mm pixels: the coronal view is drawn 6x taller per row than wide per column
    assert coronal._pixel_mm[0] / coronal._pixel_mm[1] == pytest.approx(6.0, rel=0.05)


def test_folder_with_several_series_asks_which(fedsm_app, qtbot, monkeypatch):
    app = fedsm_app
    offered = []

    def choose(series):
        offered.extend(series)
        return next(s.uid for s in series if s.modality != "SEG")

    monkeypatch.setattr(app.window, "choose_series", choose)
    study = _open(app, qtbot, SHARED_DATA / "dicom/dcmqi_ct3slice_with_SEG")
    assert len(offered) >= 2 and {s.modality for s in offered} >= {"CT", "SEG"}
    assert study.kind == "volume" and study.shape[2] == 3 and study.modality == "CT"
    assert "Soft tissue" in app.viewer_state.presets  # CT presets offered


def test_nifti_volume_with_its_label_map(fedsm_app, qtbot):
    app = fedsm_app
    study = _open(app, qtbot, SHARED_DATA / "nifti/TotalSegmentator_examples/example_mr_sm.nii.gz")
    assert study.kind == "volume" and study.array.ndim == 3
    app.studies.open_mask(SHARED_DATA / "nifti/TotalSegmentator_examples/example_seg_mr.nii.gz")
    qtbot.waitUntil(lambda: REFERENCE_LAYER in app.overlays.layers, timeout=WAIT_MS)
    layer = app.overlays.layers[REFERENCE_LAYER]
    assert layer.labels.array.shape == study.shape and len(layer.styles) > 1
    assert len(app.window.viewer.canvas("axial")._arrays) == 2  # the image and the label overlay


def test_mha_and_nrrd_volumes(fedsm_app, qtbot, tmp_path):
    import SimpleITK as sitk

    app = fedsm_app
    array = np.random.default_rng(0).random((6, 8, 10)).astype(np.float32)  # z, y, x for SimpleITK
    image = sitk.GetImageFromArray(array)
    image.SetSpacing((0.5, 0.7, 2.0))
    for suffix in (".mha", ".nrrd"):
        path = tmp_path / f"volume{suffix}"
        sitk.WriteImage(image, str(path))
        study = _open(app, qtbot, path)
        assert study.kind == "volume" and sorted(study.shape) == [6, 8, 10]
        assert sorted(round(s, 3) for s in study.spacing) == [0.5, 0.7, 2.0]
