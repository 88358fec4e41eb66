"""The segmentation panel's words fit the study: a photo is one *image*, a volume has *slices*."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
from gui_helpers import SyncTaskRunner

from engine.io.study import LabelMap
from fedsm_gui.controllers.segmentation import SegmentationController
from fedsm_gui.models.overlay import OverlayState
from fedsm_gui.models.segmentation import SegmentationState
from fedsm_gui.models.viewer import ViewerState
from fedsm_gui.views.bases import MainView
from fedsm_gui.views.segmentation_panel import SegmentationPanel

METADATA = {"task": "fundus", "site_names": ["site1", "site2"], "gamma": 0.6, "routing": "gamma", "rounds": 2,
            "lam": 0.7, "val_dice": {"site1": 0.8, "site2": 0.7}, "label_names": ["disc", "cup"]}


def _segment(bundle, study, gamma=None, device="auto", force_model=None, progress=None, cancel=None):
    """A routed result with one record per image (photo) or axial slice (volume)."""
    count = 1 if study.kind == "photo" else study.shape[2]
    records = [{"index": i, "model": "site2", "confidence": 0.9, "probabilities": {"site2": 0.9, "site1": 0.1},
                "runner_up": "site1", "reason": ""} for i in range(count)]
    shape = study.shape[:2] if study.kind == "photo" else study.shape
    return SimpleNamespace(labels=LabelMap(np.zeros(shape, dtype=np.uint8), {1: "disc", 2: "cup"}), records=records,
                           model_names=["global", "site1", "site2"], device="cpu")


def _panel_with_controller(qtbot):
    panel = SegmentationPanel()
    qtbot.addWidget(panel)
    api = SimpleNamespace(read_bundle_metadata=MagicMock(return_value=METADATA),
                          preload_super_model=MagicMock(return_value={}),
                          describe_device=MagicMock(return_value={"device": "cpu", "reason": "no CUDA GPU found"}),
                          cup_to_disc_ratio=MagicMock(return_value=None), segment_study=_segment)
    viewer = ViewerState()
    ctrl = SegmentationController(SegmentationState(), viewer, OverlayState(), panel, MagicMock(spec=MainView),
                                  SyncTaskRunner(), api)
    ctrl.load_bundle(Path("model.safetensors"))
    return panel, viewer, ctrl


def test_a_photo_is_routed_per_image(qtbot, photo_study):
    panel, viewer, ctrl = _panel_with_controller(qtbot)
    viewer.set_study(photo_study)
    ctrl.run()
    assert ctrl.state.status == "done"
    assert panel.routing_title.text().startswith("Routing per image ")
    current = panel.current_label.text()
    assert current.startswith("Image: ") and "site2" in current
    assert "slice" not in current.lower() and "slice" not in panel.routing_title.text().lower()


def test_a_volume_is_routed_per_slice_and_words_follow_the_open_study(qtbot, photo_study, volume_study):
    panel, viewer, ctrl = _panel_with_controller(qtbot)
    viewer.set_study(volume_study)
    ctrl.run()
    assert panel.routing_title.text().startswith("Routing per slice ")
    index = viewer.cursor[2]
    assert panel.current_label.text().startswith(f"Slice {index + 1}: ")
    # opening a photo after the volume changes the words (before any run, the title already fits)
    viewer.set_study(photo_study)
    assert panel.routing_title.text().startswith("Routing per image ")
    assert panel.current_label.text() == ""
    viewer.set_study(volume_study)
    assert panel.routing_title.text().startswith("Routing per slice ")
