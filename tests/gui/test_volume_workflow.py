"""A volume end to end in the app with the real engine: open a NIfTI file, segment it with a
(tiny, really trained) prostate super model, follow the routing per slice with the wheel and the
routing strip, export the mask as NIfTI and read it back on the image."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gui_helpers import SHARED_DATA
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication

import engine.api
from fedsm_gui.models.overlay import MODEL_LAYER
from fedsm_gui.models.segmentation import DONE

WAIT_MS = 120_000

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_prostate(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A prostate FedSM super model from a real (tiny) 2-site federation, and a held-out volume."""
    root = tmp_path_factory.mktemp("prostate")
    engine.api.simulate(root / "run", task="prostate", sites=2, rounds=1, image_size=32, epochs=1,
                        methods=["fedsm"], data_dir=str(root / "data"))
    datalist = json.loads((root / "data" / "site2" / "datalist.json").read_text())
    volume = root / "data" / "site2" / datalist["testing"][0]["image"]
    return {"bundle": root / "run" / "supermodel.safetensors", "volume": volume}


def _wheel(widget, notches: int) -> None:
    centre = QPointF(widget.width() / 2, widget.height() / 2)
    event = QWheelEvent(centre, widget.mapToGlobal(centre), QPoint(0, 0), QPoint(0, 120 * notches),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_volume_is_segmented_routed_per_slice_browsed_and_exported(fedsm_app, qtbot, tiny_prostate, tmp_path):
    app = fedsm_app
    app.window.show()
    opened = []
    app.studies.open_path(tiny_prostate["volume"], then=opened.append)
    qtbot.waitUntil(lambda: bool(opened), timeout=WAIT_MS)
    study = opened[0]
    assert study.kind == "volume" and app.viewer_state.study is study
    app.segmentation.load_bundle(tiny_prostate["bundle"])
    qtbot.waitUntil(lambda: app.segmentation_state.metadata is not None, timeout=WAIT_MS)
    app.segmentation.run()
    qtbot.waitUntil(lambda: app.segmentation_state.status == DONE, timeout=WAIT_MS)

    panel = app.window.segmentation_panel
    depth = study.shape[2]
    assert len(panel.strip.cells) == depth  # one routing cell per axial slice
    names = {"global", "site1", "site2"}
    assert all(model in names and 0.0 <= conf <= 1.0 for model, conf in panel.strip.cells)
    labels = app.overlays.layers[MODEL_LAYER].labels
    assert labels.array.shape == study.shape

    def shows_slice(k: int) -> bool:
        routing = app.segmentation_state.routing_at(k)
        return (app.viewer_state.slice_index("axial") == k and routing.model in panel.current_label.text()
                and f"confidence {routing.confidence:.2f}" in panel.current_label.text())

    # The wheel scrolls the axial view and the panel follows the slice's routing.
    canvas = app.window.viewer.canvas("axial")
    start = app.viewer_state.slice_index("axial")
    _wheel(canvas, 1)
    _wheel(canvas, 1)
    assert shows_slice(min(start + 2, depth - 1))
    _wheel(canvas, -1)
    assert shows_slice(min(start + 2, depth - 1) - 1)

    # A click on the routing strip's first cell goes to slice 0.
    strip = panel.strip
    qtbot.mouseClick(strip, Qt.MouseButton.LeftButton, pos=QPoint(int(strip._plot_rect().x()) + 1,
                                                                   strip.height() // 2))
    assert shows_slice(0)

    # Export as NIfTI: it lies on the image (same affine) and reads back as the shown labels.
    out = tmp_path / "volume_mask.nii.gz"
    panel.export_requested.emit(str(out))
    qtbot.waitUntil(out.exists, timeout=WAIT_MS)
    import nibabel as nib

    assert np.allclose(nib.load(out).affine, nib.load(tiny_prostate["volume"]).affine)
    back = engine.api.open_mask(out, study)
    assert np.array_equal(back.array, labels.array)
    provenance = engine.api.read_provenance(out)
    assert [r.model for r in provenance.images] == [model for model, _ in panel.strip.cells]


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")
def test_dicom_series_is_segmented_and_exported_as_dicom_seg_that_reads_back(fedsm_app, qtbot, tiny_prostate,
                                                                             tmp_path):
    """The real ProstateX T2 series: segment it in the app, export DICOM SEG (the default for a DICOM
    study), read it back on the series: the same labels, with the routing per slice recorded."""
    app = fedsm_app
    opened = []
    app.studies.open_path(SHARED_DATA / "dicom/ProstateX-0000_t2_tse_tra", then=opened.append)
    qtbot.waitUntil(lambda: bool(opened) or app.window.banner.isVisibleTo(app.window), timeout=WAIT_MS)
    assert opened, app.window.banner.label.text()
    study = opened[0]
    app.segmentation.load_bundle(tiny_prostate["bundle"])
    qtbot.waitUntil(lambda: app.segmentation_state.metadata is not None, timeout=WAIT_MS)
    app.segmentation.run()
    qtbot.waitUntil(lambda: app.segmentation_state.status == DONE, timeout=WAIT_MS)
    labels = app.overlays.layers[MODEL_LAYER].labels
    if not labels.array.any():  # a tiny model may find nothing; the export must still carry a segment
        labels.array[180:200, 180:200, 8:11] = 1
    out = tmp_path / "prostatex_seg.dcm"
    app.window.segmentation_panel.export_requested.emit(str(out))
    qtbot.waitUntil(out.exists, timeout=WAIT_MS)
    back = engine.api.open_mask(out, study)
    assert np.array_equal(back.array > 0, labels.array > 0)
    provenance = engine.api.read_provenance(out)
    assert len(provenance.images) == study.shape[2]
    assert [r.model for r in provenance.images] == [model for model, _ in app.window.segmentation_panel.strip.cells]
