"""The federation panel's FedIOD privacy field: written to site.toml [privacy], read back by the engine."""

import pytest

from engine.errors import ConfigError
from engine.federation.config import load_site_config
from fedsm_gui.controllers.federation import setup_from_config, site_toml
from fedsm_gui.models.federation import SiteSetup


def test_epsilon_from_the_form_reaches_the_site_config_and_back(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text(site_toml(SiteSetup(site_name="a", coordinator="127.0.0.1:9092", datalist="d.json",
                                        dp_epsilon=" 8 ")))
    cfg = load_site_config(path, check_files=False)
    assert cfg.privacy is not None and cfg.privacy.epsilon == 8.0
    assert setup_from_config(cfg.to_dict(), str(path)).dp_epsilon == "8.0"
    assert "[privacy]" not in site_toml(SiteSetup(site_name="a", coordinator="127.0.0.1:9092"))


def test_a_non_number_is_refused_by_the_site_with_the_key_named(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text(site_toml(SiteSetup(site_name="a", coordinator="127.0.0.1:9092", datalist="d.json",
                                        dp_epsilon="eight")))
    with pytest.raises(ConfigError, match="epsilon = 'eight' must be"):
        load_site_config(path, check_files=False)


def test_the_panel_shows_the_field(qtbot):
    from fedsm_gui.views.federation_panel import FederationPanel

    panel = FederationPanel()
    qtbot.addWidget(panel)
    panel.set_setup(SiteSetup(dp_epsilon="4.0"), demo=True)
    assert panel.fields["dp_epsilon"].text() == "4.0"


def test_the_segmentation_panel_says_a_bundle_was_distilled_and_with_which_epsilon(qtbot):
    from fedsm_gui.views.segmentation_panel import SegmentationPanel

    panel = SegmentationPanel()
    qtbot.addWidget(panel)
    metadata = {"task": "fundus", "method": "fediod", "routing": "none", "site_names": ["a", "b"],
                "label_names": ["disc", "cup"], "val_dice": {"a": 0.5, "b": None},
                "extra": {"distilled": True, "epsilon": {"a": 7.98, "b": None}}}
    panel.set_metadata("/x/fediod.safetensors", metadata)
    text = panel.metadata_label.text()
    assert "distilled" in text and "ε 7.98" in text and "no DP" in text and "0.500" in text
