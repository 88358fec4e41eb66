"""The operator and the clinician see which personalization rule a FedSM run or bundle uses."""

from __future__ import annotations

from engine import api
from fedsm_gui.views.segmentation_panel import SegmentationPanel

SHOWN = {"method": "fedsm", "personalization": "apfl", "task": "fundus", "rounds": 3, "epochs": 1, "batch_size": 8,
         "lr": 0.001, "image_size": 256, "seed": 0, "site_names": ["site1", "site2"],
         "app_hash": "sha256:" + "ab" * 32, "session": "s1", "signed": True}
META = {"task": "fundus", "method": "fedsm", "routing": "gamma", "site_names": ["site1", "site2"], "rounds": 4,
        "lam": 0.7, "gamma": 0.6, "label_names": ["disc", "cup"], "val_dice": {}, "created": "2026-11-28T00:00:00",
        "engine_version": "0.1.0", "extra": {"seed": 0}}


def _row(rows, setting):
    return next(r for r in rows if r["setting"] == setting)


def test_the_run_review_shows_the_rule_against_the_sites_allowed_rules():
    rows = api.review_run_settings(SHOWN, {"allowed_personalizations": ["softpull"]})
    assert _row(rows, "personalization") == {"setting": "personalization", "value": "apfl",
                                             "bound": "one of softpull", "ok": False}
    assert _row(api.review_run_settings(SHOWN, {}), "personalization")["ok"]
    # a run without the setting is SoftPull (older coordinators); other methods have no such row
    assert _row(api.review_run_settings({k: v for k, v in SHOWN.items() if k != "personalization"}, {}),
                "personalization")["value"] == "softpull"
    assert not [r for r in api.review_run_settings({**SHOWN, "method": "fedavg"}, {}) if r["setting"] ==
                "personalization"]
    assert "personalization apfl" in api.format_run_settings(SHOWN)


def test_the_bundle_text_names_the_rule_or_softpulls_lambda(qtbot):
    panel = SegmentationPanel()
    qtbot.addWidget(panel)
    panel.set_metadata("apfl.safetensors", {**META, "personalization": "apfl"})
    assert "personalized by APFL" in panel.metadata_label.text() and "λ" not in panel.metadata_label.text()
    assert "(personalized by APFL)" in panel.provenance_html()
    panel.set_metadata("softpull.safetensors", META)  # older bundles: SoftPull
    assert "λ 0.7" in panel.metadata_label.text() and "personalized by" not in panel.provenance_html()


def test_the_bundle_text_names_the_routing_that_decides(qtbot):
    """gamma is shown where it routes; a style-routed bundle names style routing instead of a gamma it ignores."""
    panel = SegmentationPanel()
    qtbot.addWidget(panel)
    panel.set_metadata("fedsm.safetensors", {**META, "site_routing": "selector"})
    assert "γ 0.6 · routing gamma" in panel.metadata_label.text()
    panel.set_metadata("fedsm.safetensors", {**META, "site_routing": "style"})
    text = panel.metadata_label.text()
    assert "routing by site style" in text and "γ" not in text
    panel.set_metadata("fedavg.safetensors", {**META, "method": "fedavg", "routing": "none"})
    assert "one model" in panel.metadata_label.text()
    panel.set_models(["global", "site1", "site2"], None)  # the selector alone does not decide (gate, guard, style)
    assert panel.model_combo.itemText(0) == "routed by the super model"
