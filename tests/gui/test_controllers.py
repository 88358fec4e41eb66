"""Controllers without Qt: mock views (spec'd on the abstract views), fake engine api, sync runners."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
from gui_helpers import DeferredTaskRunner, FakeProcess, SyncTaskRunner

import engine.api
from engine.errors import DataError
from engine.io.study import LabelMap, SeriesInfo
from fedsm_gui.controllers.federation import FederationController, check_rows, setup_from_config
from fedsm_gui.controllers.overlay import OverlayController
from fedsm_gui.controllers.segmentation import COMPARE_LAYER, SegmentationController
from fedsm_gui.controllers.study import StudyController
from fedsm_gui.controllers.viewer import ViewerController
from fedsm_gui.models.display import VOLUME_VIEWS
from fedsm_gui.models.federation import FederationState
from fedsm_gui.models.overlay import MODEL_LAYER, REFERENCE_LAYER, OverlayState
from fedsm_gui.models.recent import RecentFiles
from fedsm_gui.models.segmentation import SegmentationState
from fedsm_gui.models.viewer import ViewerState
from fedsm_gui.views.bases import FederationView, MainView, OverlayView, SegmentationView, ViewerView


def _viewer(study=None):
    state, overlays = ViewerState(), OverlayState()
    view = MagicMock(spec=ViewerView)
    ctrl = ViewerController(state, overlays, view)
    if study is not None:
        state.set_study(study)
    return SimpleNamespace(ctrl=ctrl, state=state, overlays=overlays, view=view)


def _last_slice_call(view, name):
    calls = [c for c in view.set_slice.call_args_list if c.args[0] == name]
    return calls[-1].args


def test_viewer_controller_renders_three_oriented_views(volume_study):
    t = _viewer(volume_study)
    t.view.set_views.assert_called_with(VOLUME_VIEWS, "")
    _, image, layers, _, markers, crosshair, index, count = _last_slice_call(t.view, "axial")
    assert image.shape == (30, 40) and image.dtype == np.uint8
    assert markers == ("A", "P", "R", "L") and (index, count) == (6, 12)
    assert crosshair == (30 - 1 - 15, 40 - 1 - 20)
    assert layers == []
    t.view.set_window.assert_called_with(250.0, 500.0, ["Default (from file)", "Auto (1–99 %)", "Full range"])


def test_viewer_controller_scrolls_clicks_and_windows(volume_study, volume_labels):
    t = _viewer(volume_study)
    t.ctrl.step_slice("axial", 3)
    assert t.state.slice_index("axial") == 9
    assert _last_slice_call(t.view, "axial")[6] == 9
    t.ctrl.step_slice("axial", 50)
    assert t.state.slice_index("axial") == 11
    # a click in the axial t.view at the screen's top-left is the patient's right-anterior corner
    t.ctrl.click("axial", 0.2, 0.7)
    assert t.state.cursor == [39, 29, 11]
    t.ctrl.drag_window(0, 50)  # drag down: level up by a fifth of the width
    assert t.state.window == pytest.approx((350.0, 500.0))
    t.ctrl.drag_window(250, 0)  # drag right: width times e
    assert t.state.window[1] == pytest.approx(500.0 * np.e)
    t.ctrl.apply_preset("Full range")
    assert t.state.window == t.state.presets["Full range"]
    t.overlays.set_layer(MODEL_LAYER, volume_labels)
    layers = _last_slice_call(t.view, "axial")[2]
    assert len(layers) == 1 and layers[0].shape == (30, 40, 4)


def test_viewer_controller_only_rerenders_what_changed(volume_study, monkeypatch):
    t = _viewer(volume_study)
    rendered = []
    original = t.ctrl._render_slice
    monkeypatch.setattr(t.ctrl, "_render_slice", lambda v, i: rendered.append(v) or original(v, i))
    t.ctrl.step_slice("axial", 1)
    assert rendered == ["axial"]  # coronal/sagittal images unchanged, only their crosshair moves
    assert t.view.set_slice.call_count >= 3


def test_viewer_controller_photo_adjustments(photo_study):
    t = _viewer(photo_study)
    t.view.set_views.assert_called_with(("photo",), "")
    t.ctrl.toggle_green(True)
    image = _last_slice_call(t.view, "photo")[1]
    assert (image[..., 0] == image[..., 1]).all() and (image[..., 1] == photo_study.array[..., 1]).all()
    t.ctrl.drag_window(0, -100)  # drag up on a photo: brighter
    assert t.state.brightness > 0
    t.ctrl.zoom("photo", 2.0)
    t.view.set_transform.assert_called_with("photo", 2.0, 0.0, 0.0)


def test_viewer_controller_empty_state_message():
    t = _viewer()
    args = t.view.set_views.call_args.args
    assert args[0] == () and "No study open" in args[1]


def test_overlay_controller_builds_the_legend(volume_labels):
    overlays = OverlayState()
    view = MagicMock(spec=OverlayView)
    view.choose_colour.return_value = (9, 9, 9)
    ctrl = OverlayController(overlays, view)
    view.set_legend.assert_called_with([])
    overlays.set_layer(MODEL_LAYER, volume_labels, title="model")
    legend = view.set_legend.call_args.args[0]
    assert legend[0]["key"] == MODEL_LAYER and legend[0]["labels"][0]["name"] == "prostate"
    ctrl.choose_colour(MODEL_LAYER, 1)
    assert overlays.layers[MODEL_LAYER].styles[1].colour == (9, 9, 9)
    ctrl.set_outline(MODEL_LAYER, True)
    ctrl.set_label_visible(MODEL_LAYER, 1, False)
    assert overlays.layers[MODEL_LAYER].outline and not overlays.layers[MODEL_LAYER].styles[1].visible
    ctrl.set_outline("nope", True)  # unknown layers are ignored


def _studies(api, tmp_path, runner=None):
    viewer, overlays = ViewerState(), OverlayState()
    main = MagicMock(spec=MainView)
    ctrl = StudyController(viewer, overlays, main, runner or SyncTaskRunner(), RecentFiles(tmp_path / "r.json"), api)
    return SimpleNamespace(ctrl=ctrl, viewer=viewer, overlays=overlays, main=main)


def test_study_controller_opens_a_file_and_remembers_it(tmp_path, photo_study):
    path = tmp_path / "photo.png"
    path.write_bytes(b"x")
    api = SimpleNamespace(open_study=MagicMock(return_value=photo_study))
    t = _studies(api, tmp_path)
    opened = []
    t.ctrl.open_path(path, then=opened.append)
    api.open_study.assert_called_once()
    assert api.open_study.call_args.args[0] == path
    assert t.viewer.study is photo_study and opened == [photo_study]
    assert t.ctrl.recent.paths == [str(path.absolute())]
    t.main.set_busy.assert_called_with(None)
    t.main.show_error.assert_not_called()


def test_study_controller_asks_which_series(tmp_path, volume_study):
    series = [SeriesInfo("1.2.3", "T2 ax", "MR", 20, (384, 384)), SeriesInfo("1.2.4", "ADC", "MR", 20)]
    api = SimpleNamespace(list_series=MagicMock(return_value=series), open_study=MagicMock(return_value=volume_study))
    t = _studies(api, tmp_path)
    t.main.choose_series.return_value = "1.2.4"
    t.ctrl.open_path(tmp_path)
    t.main.choose_series.assert_called_once_with(series)
    assert api.open_study.call_args.kwargs["series_uid"] == "1.2.4"
    t.main.choose_series.return_value = None
    t.ctrl.open_path(tmp_path)
    assert api.open_study.call_count == 1  # cancelled: nothing opened


def test_study_controller_computes_window_presets_in_the_job_not_on_the_gui_side(tmp_path, volume_study,
                                                                                 monkeypatch):
    """Percentiles over a big volume stall the GUI thread for ~0.1 s: the open job computes them,
    and showing the study uses them without computing them again."""
    import fedsm_gui.models.viewer as viewer_module

    calls: list[str] = []
    real = viewer_module.window_presets

    def recording(*args, **kwargs):
        calls.append("computed")
        return real(*args, **kwargs)

    monkeypatch.setattr(viewer_module, "window_presets", recording)
    api = SimpleNamespace(open_study=MagicMock(return_value=volume_study))
    t = _studies(api, tmp_path)
    shown = []
    original_set_study = t.viewer.set_study
    t.viewer.set_study = lambda study, slicer=None, defaults=None: (shown.append(defaults),
                                                                      original_set_study(study, slicer, defaults))
    target = tmp_path / "volume.nii.gz"
    target.write_bytes(b"x")
    t.ctrl.open_path(target)
    assert calls == ["computed"]  # once, inside the job
    assert shown[0] is not None and "Auto (1–99 %)" in shown[0][0]
    assert t.viewer.presets == shown[0][0] and t.viewer.window == shown[0][1]


def test_study_controller_shows_errors_in_the_window(tmp_path, volume_study):
    broken = tmp_path / "broken.nii.gz"
    broken.write_bytes(b"garbage")
    api = SimpleNamespace(open_study=MagicMock(side_effect=DataError(f"{broken}: not a readable NIfTI file")),
                          open_mask=MagicMock(return_value=LabelMap(np.zeros((2, 2), np.uint8), {})))
    t = _studies(api, tmp_path)
    t.ctrl.open_path(broken)
    t.main.show_error.assert_called_with("Cannot open", f"{broken}: not a readable NIfTI file")
    t.ctrl.open_path(tmp_path / "missing.png")
    assert "no such file" in t.main.show_error.call_args.args[1]
    t.ctrl.open_mask(tmp_path / "mask.png")  # no study open
    assert t.main.show_error.call_args.args[0] == "No study open"
    t.ctrl.show_study(volume_study)
    t.ctrl.open_mask(broken)  # wrong shape
    assert "does not match the study" in t.main.show_error.call_args.args[1]
    assert REFERENCE_LAYER not in t.overlays.layers


def _segmentation(api, study, runner=None):
    viewer, overlays = ViewerState(), OverlayState()
    view, main = MagicMock(spec=SegmentationView), MagicMock(spec=MainView)
    state = SegmentationState()
    ctrl = SegmentationController(state, viewer, overlays, view, main, runner or SyncTaskRunner(), api)
    if study is not None:
        viewer.set_study(study)
    return SimpleNamespace(ctrl=ctrl, state=state, viewer=viewer, overlays=overlays, view=view, main=main)


def _fake_segmentation(study, forced=None):
    n = study.num_slices
    models = [forced or ("site1" if i % 2 else "global") for i in range(n)]
    records = [{"index": i, "model": m, "confidence": 0.5 + i / (4 * n),
                "probabilities": {"site1": 0.5 + i / (4 * n), "site2": 0.5 - i / (4 * n)},
                "runner_up": "site2"} for i, m in enumerate(models)]
    labels = np.zeros(study.shape, dtype=np.uint8)
    labels[5:10, 5:10] = 1
    return SimpleNamespace(labels=LabelMap(labels, {1: "prostate"}), records=records,
                           model_names=["global", "site1", "site2"], device="cpu", gamma=0.6,
                           bundle_sha256="ab" * 32, provenance=lambda: {"model": "x"})


def _api_for_segmentation(tmp_path):
    metadata = {"task": "prostate", "site_names": ["site1", "site2"], "gamma": 0.6, "routing": "gamma",
                "rounds": 3, "lam": 0.5, "val_dice": {"site1": 0.8, "site2": None}, "label_names": ["prostate"]}
    api = SimpleNamespace(
        read_bundle_metadata=MagicMock(return_value=metadata),
        preload_super_model=MagicMock(return_value={"sha256": "ab" * 32, "device": "cpu"}),
        describe_device=MagicMock(return_value={"device": "cpu", "reason": "no CUDA GPU found"}),
        export_mask=MagicMock(side_effect=lambda study, labels, out, provenance=None: Path(out)),
        cup_to_disc_ratio=engine.api.cup_to_disc_ratio,
        mask_file_stem=engine.api.mask_file_stem,
    )
    api.segment_study = MagicMock(side_effect=lambda bundle, study, gamma=None, device="auto", force_model=None,
                                  progress=None, cancel=None: (progress(3, 4) if progress else None)
                                  or _fake_segmentation(study, force_model))
    return api


def test_segmentation_controller_runs_and_shows_routing(tmp_path, volume_study):
    api = _api_for_segmentation(tmp_path)
    t = _segmentation(api, volume_study)
    t.view.set_metadata.assert_called_with(None, None, t.view.set_metadata.call_args.args[2])
    assert "No super model" in t.view.set_metadata.call_args.args[2]
    t.view.set_device.assert_called_with("cpu — no CUDA GPU found")  # asked at start-up
    t.ctrl.load_bundle(tmp_path / "model.safetensors")
    api.preload_super_model.assert_called_once_with(tmp_path / "model.safetensors", "auto")
    t.view.set_gamma.assert_called_with(0.6, None)  # gamma changes this bundle's routing
    t.ctrl.state.set_gamma(0.8)
    t.ctrl.run()
    kwargs = api.segment_study.call_args.kwargs
    assert kwargs["gamma"] == 0.8 and kwargs["force_model"] is None and kwargs["device"] == "auto"
    assert MODEL_LAYER in t.overlays.layers
    strip = t.view.set_routing.call_args.args[0]
    assert len(strip) == 12 and strip[1][0] == "site1"
    assert t.state.progress == (3, 4)
    # current slice is the axial cursor (6): the panel shows its routed model and confidence
    index, model, confidence, _, runner_up, _reason = t.view.set_current.call_args.args
    assert (index, model, runner_up) == (6, "global", "site2") and confidence == pytest.approx(0.625)
    t.viewer.set_slice("axial", 7)
    assert t.view.set_current.call_args.args[1] == "site1"
    t.ctrl.go_to_slice(2)
    assert t.viewer.slice_index("axial") == 2


def test_segmentation_controller_force_compare_and_export(tmp_path, volume_study):
    api = _api_for_segmentation(tmp_path)
    t = _segmentation(api, volume_study)
    t.ctrl.load_bundle(tmp_path / "model.safetensors")
    t.ctrl.force_model("site2")
    t.ctrl.run()
    assert api.segment_study.call_args.kwargs["force_model"] == "site2"
    assert {r.model for r in t.state.routing} == {"site2"}
    t.ctrl.force_model("")
    t.ctrl.run()
    t.ctrl.compare()  # runner-up of the current slice
    assert api.segment_study.call_args.kwargs["force_model"] == "site2"
    assert COMPARE_LAYER in t.overlays.layers and t.overlays.layers[COMPARE_LAYER].outline
    assert t.state.routing_at(1).model == "site1"  # the routed result stays in the panel
    out = tmp_path / "mask.nii.gz"
    t.ctrl.export(out)
    study, _, path = api.export_mask.call_args.args
    assert study is volume_study and path == out and api.export_mask.call_args.kwargs["provenance"] == {"model": "x"}
    t.main.show_status.assert_called_with(f"Exported {out}")


def test_segmentation_controller_guards_and_cancel(tmp_path, volume_study, photo_study):
    api = _api_for_segmentation(tmp_path)
    runner = DeferredTaskRunner()
    t = _segmentation(api, None, runner)
    t.ctrl.run()
    t.main.show_error.assert_called()
    t.ctrl.export(tmp_path / "x.nii.gz")
    assert t.main.show_error.call_args.args[0] == "Nothing to export"
    t.viewer.set_study(volume_study)
    t.ctrl.load_bundle(tmp_path / "model.safetensors")
    runner.run_all()
    t.ctrl.run()
    t.ctrl.cancel()
    runner.run_all()
    assert t.state.message == "cancelled" and MODEL_LAYER not in t.overlays.layers
    # a result arriving after another study was opened is dropped
    t.ctrl.run()
    t.viewer.set_study(photo_study)
    runner.run_all()
    assert t.state.result is None


def test_segmentation_controller_cup_to_disc_for_photos(tmp_path, photo_study):
    api = _api_for_segmentation(tmp_path)
    t = _segmentation(api, photo_study)
    labels = np.zeros(photo_study.shape, dtype=np.uint8)
    labels[10:30, 10:30] = 1
    labels[15:25, 15:25] = 2
    t.overlays.set_layer(REFERENCE_LAYER, LabelMap(labels, {1: "rim", 2: "cup"}))
    model, reference = t.view.set_cup_to_disc.call_args.args
    assert model is None and reference.value == pytest.approx(0.5) and reference.trusted
    # a cup that fills the disc is shown, but flagged
    labels[10:30, 10:30] = 2
    t.overlays.set_layer(MODEL_LAYER, LabelMap(labels, {1: "rim", 2: "cup"}))
    model, _ = t.view.set_cup_to_disc.call_args.args
    assert model.value == 1.0 and not model.trusted and "fills the disc" in model.reason


def _federation(api, tmp_path):
    state, view, process = FederationState(), MagicMock(spec=FederationView), FakeProcess()
    ctrl = FederationController(state, view, SyncTaskRunner(), process, api, demo_workdir=tmp_path, demo_rounds=2)
    return SimpleNamespace(ctrl=ctrl, state=state, view=view, process=process)


def test_federation_controller_joins_the_demo_site_and_shows_events(tmp_path):
    api = SimpleNamespace(demo_site_command=MagicMock(return_value=["python", "-m", "demo"]))
    t = _federation(api, tmp_path)
    assert t.ctrl.demo
    t.ctrl.join()
    api.demo_site_command.assert_called_once_with(tmp_path, site="site1", rounds=2)
    assert t.process.argv == ["python", "-m", "demo"]
    t.view.set_status.assert_called_with("starting", "Starting the site …", True)
    t.process.on_line('{"event": "connected", "time": 1, "source": "site", "site": "site1", "coordinator": "x"}')
    assert t.view.set_status.call_args.args[:2] == ("connected", "Connected to x")
    t.process.on_line('{"event": "sent", "time": 2, "source": "site", "site": "site1", "round": 1, "bytes": 10, '
                    '"contents": {"tensors": {"global": 2}, "num_examples": 3, "metrics": []}}')
    entries, total = t.view.set_ledger.call_args.args
    assert total == 10 and entries[0].contents["num_examples"] == 3
    t.view.append_log.assert_called()
    t.ctrl.join()  # already running: ignored
    assert api.demo_site_command.call_count == 1
    t.ctrl.leave()
    assert t.process.stopped and t.state.status == "stopped"
    assert t.view.set_status.call_args.args[2] is False  # Join enabled again


def test_federation_controller_shows_a_lost_connection_and_the_reconnect_as_such(tmp_path):
    api = SimpleNamespace(demo_site_command=MagicMock(return_value=["python", "-m", "demo"]))
    t = _federation(api, tmp_path)
    t.ctrl.join()
    head = '"time": 1, "source": "site", "site": "site1"'
    t.process.on_line('{"event": "connected", ' + head + ', "coordinator": "x"}')
    t.process.on_line('{"event": "disconnected", ' + head + ', "reason": "network down", "reconnecting": true}')
    status, text, running = t.view.set_status.call_args.args
    assert status == "reconnecting" and "reconnecting" in text and running  # not "stopped", still Leave-able
    t.process.on_line('{"event": "connected", ' + head + ', "coordinator": "x"}')
    status, text, _ = t.view.set_status.call_args.args
    assert status == "connected" and "Connected to x" in text and "reconnected 1×" in text


def test_federation_controller_uses_a_site_config_when_loaded(tmp_path):
    config = {"name": "hospital-a", "task": "prostate", "coordinator": "10.0.0.1:9092", "datalist": "/d/datalist.json",
              "ca_cert": "/d/ca.pem", "private_key": "/d/site.key", "approved_apps": ["ab" * 32]}
    api = SimpleNamespace(read_site_config=MagicMock(return_value=config),
                          site_command=MagicMock(return_value=["fedsm", "site", "--json"]),
                          validate_data=MagicMock(return_value={"ok": False, "files": [
                              {"file": "/d/a.png", "ok": True}, {"file": "/d/b.png", "label": "/d/b_mask.png",
                                                                 "ok": False, "problems": ["mask is RGB"]}]}))
    t = _federation(api, tmp_path)
    t.ctrl.load_config(str(tmp_path / "site.toml"))
    setup = t.view.set_setup.call_args.args[0]
    assert (setup.site_name, setup.site_key, setup.app_hash) == ("hospital-a", "/d/site.key", "ab" * 32)
    assert t.view.set_setup.call_args.args[1] is False  # not the demo any more
    t.ctrl.join()
    api.site_command.assert_called_once_with(tmp_path / "site.toml", json_events=True, confirm_runs=True)
    t.process.exit(1)
    assert t.state.status == "failed"
    t.ctrl.check_data()
    api.validate_data.assert_called_once_with([Path("/d/datalist.json")], task="prostate")
    rows, summary = t.view.set_check_results.call_args.args
    assert rows[1] == {"file": "b.png + b_mask.png", "status": "problem", "message": "mask is RGB"}
    assert "1 with problems" in summary


def test_check_rows_and_config_mapping_tolerate_missing_keys():
    rows, summary = check_rows({})
    assert rows == [] and "0 file(s) checked" in summary
    setup = setup_from_config({}, "x.toml")
    assert setup.coordinator == "" and setup.config_path == "x.toml"


def test_demo_site_command_is_a_python_module_call(tmp_path):
    import sys

    import engine.api

    argv = engine.api.demo_site_command(tmp_path, site="site2", rounds=4)
    assert argv[:3] == [sys.executable, "-m", "engine.federation.demo_site"]
    assert argv[argv.index("--site") + 1] == "site2" and argv[argv.index("--rounds") + 1] == "4"



def test_site_toml_from_the_form_is_read_back_by_the_engine(tmp_path):
    import tomllib

    from engine.federation.config import load_site_config
    from fedsm_gui.controllers.federation import site_toml
    from fedsm_gui.models.federation import SiteSetup

    setup = SiteSetup(coordinator="10.0.0.5:9092", ca_cert="/pki/ca.pem", site_key="/pki/site \"a\".key",
                      site_name="hospital-a", task="prostate", datalist="/data/datalist.json",
                      app_hash=f"{'ab' * 32}, {'cd' * 32}")
    text = site_toml(setup)
    doc = tomllib.loads(text)
    assert doc["site"] == {"name": "hospital-a", "coordinator": "10.0.0.5:9092", "task": "prostate",
                           "datalist": "/data/datalist.json"}
    assert doc["security"]["private_key"] == '/pki/site "a".key'
    assert doc["security"]["approved_apps"] == ["ab" * 32, "cd" * 32]
    path = tmp_path / "site.toml"
    path.write_text(text)
    cfg = load_site_config(path, check_files=False)
    assert (cfg.name, cfg.task) == ("hospital-a", "prostate")
    assert cfg.approved_apps == (f"sha256:{'ab' * 32}", f"sha256:{'cd' * 32}")
    assert "[security]" not in site_toml(SiteSetup(site_name="x", coordinator="127.0.0.1:1"))


def test_save_config_writes_and_validates_through_the_api(tmp_path):
    api = SimpleNamespace(read_site_config=MagicMock(side_effect=lambda p: {"name": "x", "task": "fundus",
                                                                              "coordinator": "127.0.0.1:9092"}))
    t = _federation(api, tmp_path)
    t.ctrl.edit_setup("site_name", "x")
    t.ctrl.save_config(str(tmp_path / "cfg" / "site.toml"))
    assert (tmp_path / "cfg" / "site.toml").read_text().startswith("# FedSM site configuration")
    assert not t.ctrl.demo and "Join now runs this site" in t.view.set_check_results.call_args.args[1]
    api.read_site_config.side_effect = ValueError("bad")
    t.ctrl.save_config(str(tmp_path / "site2.toml"))
    assert "not a usable site configuration" in t.view.set_check_results.call_args.args[1]


def test_export_name_follows_the_study(tmp_path, volume_study, photo_study):
    # By default the proposed name is the study's case (a hash of its content), never the image's name
    t = _segmentation(_api_for_segmentation(tmp_path), volume_study)
    t.view.set_export_name.assert_called_with(f"{engine.api.mask_file_stem(volume_study)}_mask.nii.gz")
    t.viewer.set_study(photo_study)
    case = engine.api.mask_file_stem(photo_study)
    assert case.startswith("case-")
    t.view.set_export_name.assert_called_with(f"{case}_mask.png")
    # The user keeps names: the image's own name
    t.ctrl.set_keep_names(True)
    t.view.set_export_name.assert_called_with("photo_mask.png")
    t.viewer.set_study(volume_study)
    t.view.set_export_name.assert_called_with("volume_mask.nii.gz")


def test_export_name_of_a_replaced_study_is_not_shown(tmp_path, volume_study, photo_study):
    runner = DeferredTaskRunner()
    t = _segmentation(_api_for_segmentation(tmp_path), volume_study, runner)
    t.viewer.set_study(photo_study)
    runner.run_all()  # the volume's name arrives after the photo replaced it: only the photo's is shown
    names = [c.args[0] for c in t.view.set_export_name.call_args_list]
    assert names[-1] == f"{engine.api.mask_file_stem(photo_study)}_mask.png"
    assert f"{engine.api.mask_file_stem(volume_study)}_mask.nii.gz" not in names


def test_app_hash_is_computed_on_request(tmp_path):
    api = SimpleNamespace(app_hash=MagicMock(return_value="sha256:" + "ef" * 32))
    t = _federation(api, tmp_path)
    api.app_hash.assert_not_called()  # packing the app imports Flower: only when asked
    t.ctrl.show_app_hash()
    t.view.set_local_app_hash.assert_called_once_with("sha256:" + "ef" * 32)
