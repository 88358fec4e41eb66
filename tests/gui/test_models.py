"""Qt-free state objects: viewer, overlays, segmentation, federation events, recent files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from engine.io.study import LabelMap
from fedsm_gui.models.federation import (
    CONNECTED,
    FAILED,
    FINISHED,
    LEDGER,
    METRICS,
    RECONNECTING,
    STOPPED,
    FederationState,
    describe_contents,
    format_bytes,
)
from fedsm_gui.models.overlay import MODEL_LAYER, REFERENCE_LAYER, OverlayState
from fedsm_gui.models.recent import RecentFiles
from fedsm_gui.models.segmentation import DONE, NO_MODEL, READY, RUNNING, SegmentationState
from fedsm_gui.models.viewer import MAX_ZOOM, ViewerState


def test_viewer_state_centres_cursor_and_clamps_slices(volume_study):
    state = ViewerState()
    changes = []
    state.slices_changed.connect(lambda: changes.append("slices"))
    state.set_study(volume_study)
    assert state.cursor == [20, 15, 6]
    assert state.window == (250.0, 500.0)  # the study's own default
    assert state.num_slices("axial") == 12 and state.num_slices("sagittal") == 40
    assert state.set_slice("axial", 99) and state.slice_index("axial") == 11
    assert not state.set_slice("axial", 11)  # no change, no signal
    assert state.set_slice("coronal", -5) and state.slice_index("coronal") == 0
    assert changes == ["slices", "slices"]
    state.set_cursor((3, 4, 5))
    assert state.cursor == [3, 4, 5]


def test_viewer_state_zoom_pan_fit_and_photo(photo_study):
    state = ViewerState()
    state.set_study(photo_study)
    assert state.views == ("photo",)
    assert state.num_slices("photo") == 1 and not state.set_slice("photo", 3)
    for _ in range(50):
        state.zoom("photo", 2.0)
    assert state.transform("photo").zoom == MAX_ZOOM
    state.pan("photo", 10, -4)
    assert (state.transform("photo").pan_x, state.transform("photo").pan_y) == (10, -4)
    state.fit()
    assert state.transform("photo").zoom == 1.0 and state.transform("photo").pan_x == 0
    state.set_photo_adjustment(brightness=3.0, contrast=0.0, green_only=True)
    assert (state.brightness, state.contrast, state.green_only) == (1.0, 0.1, True)


def test_overlay_state_layers_styles_and_lut(volume_labels):
    overlays = OverlayState()
    seen = []
    overlays.changed.connect(lambda: seen.append(1))
    overlays.set_layer(MODEL_LAYER, volume_labels)
    overlays.set_layer(REFERENCE_LAYER, LabelMap(volume_labels.array * 2, {2: "gland"}))
    # reference first (drawn below), model on top; reference outlined by default
    assert [k for k, _ in overlays.shown_layers()] == [REFERENCE_LAYER, MODEL_LAYER]
    assert overlays.layers[REFERENCE_LAYER].outline and not overlays.layers[MODEL_LAYER].outline
    assert overlays.layers[MODEL_LAYER].styles[1].name == "prostate"
    overlays.set_opacity(1.0)
    assert overlays.lut(MODEL_LAYER)[1, 3] == 255
    overlays.set_label_visible(MODEL_LAYER, 1, False)
    assert overlays.lut(MODEL_LAYER)[1, 3] == 0
    overlays.set_label_colour(MODEL_LAYER, 1, (1, 2, 3))
    overlays.set_label_visible(MODEL_LAYER, 1, True)
    assert overlays.lut(MODEL_LAYER)[1].tolist() == [1, 2, 3, 255]
    # a new mask for the same layer keeps the user's colour
    overlays.set_layer(MODEL_LAYER, volume_labels)
    assert overlays.layers[MODEL_LAYER].styles[1].colour == (1, 2, 3)
    overlays.toggle_visible()
    assert overlays.shown_layers() == []
    assert len(seen) == 8


def _result(models, confidences):
    pairs = enumerate(zip(models, confidences, strict=True))
    records = [{"index": i, "model": m, "confidence": c, "probabilities": {"site1": c, "site2": 1 - c},
                "runner_up": "site2" if m != "site2" else "site1"} for i, (m, c) in pairs]
    return SimpleNamespace(records=records, model_names=["global", "site1", "site2"])


def test_segmentation_state_lifecycle():
    state = SegmentationState()
    assert state.status == NO_MODEL and state.model_names == []
    state.set_bundle("model.safetensors", {"gamma": 0.6, "site_names": ["site1", "site2"], "routing": "gamma"})
    assert state.status == READY and state.gamma == 0.6 and state.uses_gamma
    assert state.model_names == ["global", "site1", "site2"]
    with pytest.raises(ValueError, match="unknown model"):
        state.set_forced_model("site9")
    state.start()
    assert state.status == RUNNING
    state.finish(_result(["site1", "global"], [0.9, 0.4]))
    assert state.status == DONE
    assert state.routing_at(1).model == "global" and state.routing_at(1).runner_up == "site2"
    assert state.routing_at(5) is None
    state.fail("cancelled")
    assert state.status == DONE and state.message == "cancelled"  # earlier result kept
    state.clear_result()
    assert state.status == READY and state.routing == []


def _event(kind, **fields):
    return json.dumps({"event": kind, "time": 1700000000.0, "source": "site", "site": "site1", **fields})


def test_federation_state_folds_a_site_event_stream():
    state = FederationState()
    parts_seen = []
    state.changed.connect(parts_seen.append)
    state.starting(["fedsm", "site"])
    lines = [
        _event("status", message="checking data"),
        _event("connected", coordinator="127.0.0.1:9092"),
        _event("round_start", round=1, rounds=2, method="fedsm"),
        _event("received", round=1, rounds=2, method="fedsm", bytes=2048, contents={"global": 10, "personal": 10}),
        _event("batch", round=1, batch=1, batches=4, loss={"global": 0.9}, method="fedsm"),
        _event("batch", round=1, batch=2, batches=4, loss={"global": 0.8}, method="fedsm"),
        "a plain stderr line",
        _event("metrics", round=1, loss={"global": 0.85}, dice={"global": 0.3, "personalized": 0.4, "local": 0.5}),
        _event("sent", round=1, bytes=4096, contents={"tensors": {"global": 10}, "num_examples": 8,
                                                      "metrics": ["loss_global"]}),
        _event("round_end", round=1, rounds=2, wall_s=3.5),
        _event("disconnected", reason="network down", reconnecting=True),
    ]
    for line in lines:
        state.apply_line(line)
    assert state.status == RECONNECTING
    assert (state.round, state.rounds, state.batch, state.batches) == (1, 2, 4, 4)
    assert state.metrics[1].dice == {"global": 0.3, "personalized": 0.4, "local": 0.5}
    assert [(e.direction, e.bytes) for e in state.ledger] == [("received", 2048), ("sent", 4096)]
    assert state.sent_total() == 4096
    assert any("a plain stderr line" in line for line in state.log)
    assert not any("batch" in line for line in state.log)  # batches drive the bar, not the log
    assert {METRICS, "log"} in parts_seen and any(LEDGER in p for p in parts_seen)
    state.apply_line(_event("connected", coordinator="127.0.0.1:9092"))
    assert state.status == CONNECTED and state.reconnects == 1
    state.apply_line(_event("error", message="boom", round=2))
    assert state.error == "boom"
    state.apply_line(_event("finished", rounds=2))
    assert state.status == FINISHED and state.round == 2
    state.process_ended(0, False)
    assert state.status == FINISHED


def test_federation_state_process_exit_codes():
    state = FederationState()
    state.starting(["x"])
    state.process_ended(3, False)
    assert state.status == FAILED and "code 3" in state.error
    state.starting(["x"])
    state.process_ended(0, True)
    assert state.status == STOPPED and not state.running


def test_ledger_descriptions():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**20) == "3.0 MiB"
    text = describe_contents("sent", {"tensors": {"global": 63, "selector": 60}, "num_examples": 6,
                                      "metrics": ["loss_global"]})
    assert text == "global: 63 tensors; selector: 60 tensors; sample count 6; metrics: loss_global"
    assert describe_contents("received", {"selector": 60}) == "selector: 60 tensors"


def test_recent_files_persist_most_recent_first(tmp_path):
    store = tmp_path / "cfg" / "recent.json"
    recent = RecentFiles(store, limit=3)
    for name in ("a", "b", "c", "a", "d"):
        recent.add(tmp_path / name)
    assert [p.rsplit("/", 1)[1] for p in recent.paths] == ["d", "a", "c"]
    again = RecentFiles(store, limit=3)
    assert again.paths == recent.paths
    again.remove(tmp_path / "a")
    assert len(RecentFiles(store).paths) == 2
    store.write_text("not json")
    assert RecentFiles(store).paths == []


def test_unused_labels_still_get_a_legend_entry():
    overlays = OverlayState()
    overlays.set_layer(MODEL_LAYER, LabelMap(np.zeros((4, 4), np.uint8), {1: "disc", 2: "cup"}))
    assert sorted(overlays.layers[MODEL_LAYER].styles) == [1, 2]


def test_single_model_bundle_offers_only_the_global_model():
    state = SegmentationState()
    state.set_bundle("fedavg.safetensors", {"gamma": 0.0, "site_names": ["site1", "site2"], "routing": "none",
                                            "method": "fedavg"})
    assert state.model_names == ["global"] and not state.uses_gamma and state.gamma_not_used == "one model"
    with pytest.raises(ValueError, match="unknown model"):
        state.set_forced_model("site1")


def test_style_routed_bundle_has_no_gamma_to_set():
    state = SegmentationState()
    meta = {"gamma": 0.6, "site_names": ["site1", "site2"], "routing": "gamma", "method": "fedsm"}
    state.set_bundle("fedsm.safetensors", {**meta, "site_routing": "selector"})
    assert state.uses_gamma and state.gamma_not_used is None
    state.set_bundle("fedsm.safetensors", {**meta, "site_routing": "style"})  # the style gate picks the site
    assert not state.uses_gamma and state.model_names == ["global", "site1", "site2"]
    assert state.gamma_not_used == "style routing"  # what the panel shows beside the disabled slider, not "argmax"
    state.set_bundle("extra.safetensors", {**meta, "routing": "argmax", "method": "fedsm-extra"})
    assert state.gamma_not_used == "argmax routing"
