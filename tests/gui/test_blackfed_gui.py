"""The desktop app and BlackFed: choosing a site's client net, and confirming the threat model before joining."""

from __future__ import annotations

from fedsm_gui.controllers.federation import setup_from_config, site_toml
from fedsm_gui.models.federation import SiteSetup
from fedsm_gui.models.segmentation import SegmentationState
from fedsm_gui.views.federation_panel import FederationPanel
from fedsm_gui.views.segmentation_panel import SegmentationPanel

SPLIT_META = {"task": "fundus", "method": "blackfed-v2", "routing": "site", "site_names": ["site1", "site2"],
              "label_names": ["disc", "cup"], "server": "per-site"}


def test_a_blackfed_bundle_offers_each_sites_client_net_and_no_routing(qtbot):
    state = SegmentationState()
    state.set_bundle("bf.safetensors", SPLIT_META)
    assert state.chooses_site and state.model_names == ["site1", "site2"] and state.forced_model == "site1"
    assert not state.uses_gamma
    state.set_forced_model("site2")
    panel = SegmentationPanel()
    qtbot.addWidget(panel)
    panel.set_models(state.model_names, state.forced_model, choose_site=True)
    items = [(panel.model_combo.itemText(i), panel.model_combo.itemData(i)) for i in range(panel.model_combo.count())]
    assert items == [("client net of site1 (BlackFed)", "site1"), ("client net of site2 (BlackFed)", "site2")]
    assert panel.model_combo.currentData() == "site2"
    # a super model keeps its routed entry
    panel.set_models(["global", "site1"], None)
    assert panel.model_combo.itemData(0) == "" and panel.model_combo.count() == 3


def test_allowing_blackfed_needs_the_operators_confirmation(qtbot):
    panel = FederationPanel()
    qtbot.addWidget(panel)
    edits = []
    panel.setup_edited.connect(lambda field, value: edits.append((field, value)))
    panel.confirm_share_activations = lambda: False  # the operator declines
    panel.share_activations.click()
    assert not panel.share_activations.isChecked() and edits == []
    panel.confirm_share_activations = lambda: True
    panel.share_activations.click()
    assert panel.share_activations.isChecked() and edits == [("share_activations", "true")]
    panel.share_activations.click()
    assert edits[-1] == ("share_activations", "false")


def test_the_consent_is_written_to_site_toml_and_read_back(tmp_path):
    from engine.federation.config import load_site_config

    setup = SiteSetup(coordinator="127.0.0.1:9092", site_name="site1", datalist="d.json", share_activations=True)
    (tmp_path / "site.toml").write_text(site_toml(setup))
    cfg = load_site_config(tmp_path / "site.toml", check_files=False)
    assert cfg.share_activations
    assert setup_from_config(cfg.to_dict(), str(tmp_path / "site.toml")).share_activations
    assert "share_activations" not in site_toml(SiteSetup(site_name="site1"))


def test_the_app_segments_a_photo_with_the_chosen_sites_client_net(fedsm_app, qtbot, tmp_path):
    import numpy as np
    from PIL import Image
    from testsupport import random_split

    from engine.bundle.split import save_split_bundle
    from engine.federation.inprocess import run_exchange_rounds
    from engine.fl.blackfed import BlackFed, BlackFedConfig
    from engine.fl.methods import SiteRuntime
    from engine.tasks import FUNDUS
    from fedsm_gui.models.overlay import MODEL_LAYER

    sites = [SiteRuntime(f"site{k + 1}", k, random_split(4, seed=k, size=32)) for k in range(2)]
    method = BlackFed(FUNDUS, ["site1", "site2"], variant="v2",
                      config=BlackFedConfig(client_epochs=1, server_epochs=1, batch_size=4, perturbations=1,
                                            image_size=32))
    state, _ = run_exchange_rounds(method, sites, 1)
    bundle = tmp_path / "blackfed-v2.safetensors"
    save_split_bundle(bundle, method.report_extra(state, sites)["bundle"])
    photo = tmp_path / "eye.png"
    Image.fromarray((np.random.default_rng(1).random((32, 32, 3)) * 255).astype(np.uint8)).save(photo)

    app = fedsm_app
    app.segmentation.load_bundle(bundle)
    qtbot.waitUntil(lambda: app.segmentation_state.metadata is not None, timeout=60_000)
    app.studies.open_path(photo)
    qtbot.waitUntil(lambda: app.viewer_state.study is not None, timeout=60_000)
    panel = app.window.segmentation_panel
    index = panel.model_combo.findData("site2")
    assert panel.model_combo.itemText(index) == "client net of site2 (BlackFed)"
    panel.model_combo.setCurrentIndex(index)
    panel.model_combo.activated.emit(index)
    panel.run_button.click()
    qtbot.waitUntil(lambda: app.segmentation_state.status == "done", timeout=60_000)
    assert app.segmentation_state.routing_at(0).model == "site2"
    assert app.overlays.layers[MODEL_LAYER].title == "model (client net of site2)"


def test_the_ledger_says_what_a_blackfed_exchange_sent_and_received():
    from fedsm_gui.models.federation import describe_contents

    sent = {"tensors": {"activations": "client-net activations f_k(x) of one training batch",
                        "masks": "the batch's expert masks (uint8)"}, "num_examples": 6, "metrics": []}
    text = describe_contents("sent", sent)
    assert "activations (client-net activations" in text and "masks (the batch's expert masks" in text
    assert describe_contents("received", {"tensors": {"losses": "loss values"}}) == "losses (loss values)"
    assert describe_contents("received", {"tensors": {}}) == "nothing"
    assert describe_contents("received", {"global": 63}) == "global: 63 tensors"
