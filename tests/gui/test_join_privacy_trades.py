"""Joining BlackFed and FedIOD runs from the app: the consent reaches the site process, the site's bundle is shown.

The site process reads ``site.toml``, not the form: a split-learning consent ticked (and
confirmed) in the app, or a FedIOD epsilon typed there, must be in the file before Join starts
the site, and nothing else of the file may change. At the end of a dialogue run the site
reports the bundle it wrote; the panel shows its path.
"""

from __future__ import annotations

import json
import tomllib
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from gui_helpers import FakeProcess, SyncTaskRunner

from engine import api
from engine.federation.config import load_site_config
from fedsm_gui.controllers.federation import FederationController, update_toml_keys
from fedsm_gui.models.federation import FederationState, SiteSetup
from fedsm_gui.views.bases import FederationView

SITE_TOML = """# written by the site's IT
[site]
name = "site1"  # as enrolled
coordinator = "127.0.0.1:9092"
task = "fundus"
datalist = "data/datalist.json"
threads = 2

[bounds]
allowed_methods = ["blackfed-v2", "fediod"]
max_rounds = 5
"""


def _controller(tmp_path, text=SITE_TOML):
    path = tmp_path / "site.toml"
    path.write_text(text)
    state, view, process = FederationState(), MagicMock(spec=FederationView), FakeProcess()
    ctrl = FederationController(state, view, SyncTaskRunner(), process, api, demo_workdir=tmp_path)
    state.setup = SiteSetup(config_path=str(path), site_name="site1", coordinator="127.0.0.1:9092",
                            datalist="data/datalist.json")
    return SimpleNamespace(ctrl=ctrl, state=state, view=view, process=process, path=path)


def test_the_confirmed_consent_is_saved_in_site_toml_at_once_and_join_runs_with_it(tmp_path):
    t = _controller(tmp_path)
    t.ctrl.edit_setup("share_activations", "true")  # the panel emits this after the operator confirmed
    cfg = load_site_config(t.path, check_files=False)
    assert cfg.share_activations
    assert cfg.threads == 2 and cfg.bounds == {"allowed_methods": ["blackfed-v2", "fediod"], "max_rounds": 5}
    assert "# written by the site's IT" in t.path.read_text() and "# as enrolled" in t.path.read_text()
    t.ctrl.join()
    assert t.process.argv[t.process.argv.index("--config") + 1] == str(t.path) and "--confirm-runs" in t.process.argv
    t.ctrl.leave()
    t.ctrl.edit_setup("share_activations", "false")  # consent withdrawn: the file says so too
    assert not load_site_config(t.path, check_files=False).share_activations


def test_join_writes_the_fediod_epsilon_typed_in_the_form(tmp_path):
    t = _controller(tmp_path)
    t.ctrl.edit_setup("dp_epsilon", "8")
    t.ctrl.join()
    privacy = load_site_config(t.path, check_files=False).privacy
    assert privacy is not None and privacy.epsilon == 8.0
    assert any("[privacy] epsilon = 8.0" in line for line in t.state.log)
    t.ctrl.leave()
    t.ctrl.edit_setup("dp_epsilon", "")
    t.ctrl.join()
    assert "epsilon" not in tomllib.loads(t.path.read_text()).get("privacy", {})


def test_join_refuses_when_the_consent_cannot_be_written(tmp_path):
    # a dotted key the form's update cannot rewrite in place: Join must not start a site that ignores the consent
    t = _controller(tmp_path, 'site.name = "site1"\nsite.share_activations = false\n')
    t.state.setup.share_activations = True
    t.ctrl.join()
    assert t.process.argv is None
    assert "cannot save the consent settings" in t.state.error
    assert not tomllib.loads(t.path.read_text())["site"]["share_activations"]  # the file is unchanged


def test_update_toml_keys_keeps_every_other_line():
    text = "[site]\nname = 'a'\nshare_activations = false # no\n\n[privacy]\nclip_norm = 2.0\n"
    new = update_toml_keys(text, {("site", "share_activations"): "true", ("privacy", "epsilon"): "4.0",
                                  ("bounds", "max_rounds"): "3"})
    doc = tomllib.loads(new)
    assert doc == {"site": {"name": "a", "share_activations": True}, "privacy": {"clip_norm": 2.0, "epsilon": 4.0},
                   "bounds": {"max_rounds": 3}}
    with pytest.raises(ValueError, match="by hand"):
        update_toml_keys('site = { share_activations = false }\n', {("site", "share_activations"): "true"})


def test_the_panel_shows_the_bundle_the_site_wrote(tmp_path):
    t = _controller(tmp_path)
    t.ctrl.join()
    head = {"time": 1, "source": "site", "site": "site1"}
    t.process.on_line(json.dumps({**head, "event": "received", "round": 1, "rounds": 1, "method": "blackfed-v2",
                                  "bytes": 6_500_000, "final": True,
                                  "contents": {"tensors": {"server": "the coordinator's server net g"}}}))
    entries, _ = t.view.set_ledger.call_args.args
    assert entries[-1].direction == "received" and entries[-1].bytes == 6_500_000
    t.process.on_line(json.dumps({**head, "event": "status", "message": "blackfed-v2 bundle written to /w/b.st",
                                  "bundle": "/w/b.st", "method": "blackfed-v2"}))
    t.process.on_line(json.dumps({**head, "event": "finished", "rounds": 1}))
    status, text, _ = t.view.set_status.call_args.args
    assert status == "finished" and text.endswith("bundle: /w/b.st") and t.state.bundle == "/w/b.st"
    t.ctrl.leave()
    t.ctrl.join()  # a new run forgets the previous one's bundle
    assert t.state.bundle == ""
