"""The signed run spec: signed by the coordinator's certified key, checked by each site against its [bounds].

A run whose settings break a site's bounds, whose spec was changed after signing, or that was
signed by a key the site's CA did not certify is refused by the site's SuperNode before any of
its payload is pulled (the same guard as app approval, exercised with a fake SuperNode module).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fed_fixtures import pki  # noqa: F401
from test_hardening import APPROVED_FAB, _fake_supernode_module, _header_message

from engine.errors import ConfigError
from engine.federation.spec import MethodSpec
from engine.security.approval import app_hash
from engine.security.run_spec import (
    RUN_CONFIG_KEY,
    RunSpecRefused,
    SiteBounds,
    describe,
    make_envelope,
    verify_envelope,
)

SPEC = MethodSpec(method="fedsm", task="fundus", site_names=("site1", "site2"), rounds=3, image_size=64, lr=1e-3)
APP = app_hash(APPROVED_FAB)


def _signed(pki_dir, spec_json=None):
    return make_envelope(spec_json or SPEC.to_json(), APP, "session1", pki_dir / "server.key", pki_dir / "server.pem")


def test_a_signed_spec_within_bounds_is_accepted_and_described(pki):  # noqa: F811
    settings = verify_envelope(_signed(pki), ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    assert settings["spec"]["method"] == "fedsm" and settings["signed"] and settings["session"] == "session1"
    shown = describe(settings)
    assert shown["lr"] == 1e-3 and shown["rounds"] == 3 and shown["image_size"] == 64 and shown["app_hash"] == APP


def test_tampered_unsigned_foreign_or_out_of_bounds_specs_are_refused(pki, tmp_path):  # noqa: F811
    from engine.security import certs

    envelope = json.loads(_signed(pki))
    tampered = dict(envelope, spec=SPEC.to_json().replace('"lr":0.001', '"lr":0.5'))
    assert tampered["spec"] != envelope["spec"]
    with pytest.raises(RunSpecRefused, match="signature does not verify"):
        verify_envelope(json.dumps(tampered), ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    unsigned = make_envelope(SPEC.to_json(), APP, "session1")
    with pytest.raises(RunSpecRefused, match="not signed"):
        verify_envelope(unsigned, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    # signed by a certificate of another CA
    other = tmp_path / "other"
    certs.create_ca(other)
    certs.create_server_certificate(other, other, ["127.0.0.1"])
    foreign = make_envelope(SPEC.to_json(), APP, "s", other / "server.key", other / "server.pem")
    with pytest.raises(RunSpecRefused, match="does not verify"):
        verify_envelope(foreign, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    with pytest.raises(RunSpecRefused, match="signed for app"):
        verify_envelope(_signed(pki), ca_cert=pki / "ca.pem", app_hash="sha256:" + "1" * 64, bounds=SiteBounds())
    strict = SiteBounds.from_dict({"allowed_methods": ["fedavg"], "max_epochs": 1, "max_lr": 1e-4,
                                   "max_image_size": 32})
    with pytest.raises(RunSpecRefused, match=r"method 'fedsm' is not in allowed_methods .*lr = 0.001 is above "
                                             r"max_lr = 0.0001.*image_size = 64 is above max_image_size = 32"):
        verify_envelope(_signed(pki), ca_cert=pki / "ca.pem", app_hash=APP, bounds=strict)
    with pytest.raises(RunSpecRefused, match="no readable run spec"):
        verify_envelope(None, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    # insecure demonstrations: no signature, bounds still apply
    assert verify_envelope(unsigned, ca_cert=None, app_hash=APP, bounds=SiteBounds())["signed"] is False
    with pytest.raises(RunSpecRefused, match="max_image_size"):
        verify_envelope(unsigned, ca_cert=None, app_hash=APP, bounds=strict)


def test_bounds_are_checked_when_site_toml_is_read():
    with pytest.raises(ConfigError, match="max_epochs"):
        SiteBounds.from_dict({"max_epochs": 0})
    with pytest.raises(ConfigError, match="unknown key"):
        SiteBounds.from_dict({"max_epoch": 3})
    with pytest.raises(ConfigError, match="allowed_methods"):
        SiteBounds.from_dict({"allowed_methods": "fedsm"})


def _guarded(envelope, policy):
    from flwr.supercore.fab import Fab

    from engine.federation.flower.launch import guard_apps

    calls: list[str] = []
    said: list[str] = []
    module = _fake_supernode_module(calls)
    guard_apps(module, [APP], "site1", report=said.append, policy=policy)
    message = _header_message()
    module._pull_and_store_message(
        state=SimpleNamespace(get_run=lambda run_id: None), object_store=None,
        receive=lambda: (message, "tree"),
        get_run=lambda run_id: calls.append("get_run") or SimpleNamespace(
            fab_hash="h", override_config={RUN_CONFIG_KEY: envelope}),
        get_fab=lambda fab_hash, run_id: calls.append("get_fab") or Fab("h", APPROVED_FAB, {}),
        pull_object=lambda run_id, object_id: calls.append("pull_object"), node_config={},
        confirm_message_received=None, trusted_entities=None)
    return calls, said


def test_supernode_refuses_a_run_beyond_its_bounds_before_pulling_its_payload(pki):  # noqa: F811
    from engine.security.run_spec import bounds_dict

    strict = {"ca_cert": str(pki / "ca.pem"), "bounds": bounds_dict(SiteBounds(max_epochs=1, max_lr=1e-4))}
    calls, said = _guarded(_signed(pki), strict)
    assert "pull_object" not in calls  # not one byte of the weights was fetched
    assert said and said[0].startswith("FEDSM-REFUSED-SPEC") and "max_lr" in said[0]
    assert calls[-1].startswith("reply:") and "max_lr" in calls[-1]
    # a tampered envelope is refused the same way
    tampered = json.loads(_signed(pki))
    tampered["spec"] = tampered["spec"].replace('"rounds":3', '"rounds":30')
    calls, said = _guarded(json.dumps(tampered), {"ca_cert": str(pki / "ca.pem"), "bounds": {}})
    assert "pull_object" not in calls and "does not verify" in said[0]
    # within bounds and correctly signed: Flower goes on to pull the payload
    calls, said = _guarded(_signed(pki), {"ca_cert": str(pki / "ca.pem"), "bounds": {}})
    assert calls == ["get_run", "get_fab", "pull_object"] and said == []


def test_the_operator_sees_the_signed_settings(pki):  # noqa: F811
    from engine import api
    from fedsm_gui.models.federation import FederationState

    settings = describe(verify_envelope(_signed(pki), ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds()))
    line = api.format_run_settings(settings)
    assert line.startswith("run settings (signed by the coordinator, within this site's bounds): fedsm")
    assert "3 rounds" in line and "lr 0.001" in line and "64 px" in line and "sites site1, site2" in line
    state = FederationState()
    state.apply_event({"event": "run_settings", "time": 0.0, "source": "site", "site": "site1", "settings": settings})
    assert state.run_settings["method"] == "fedsm" and state.method == "fedsm"
    assert any("run settings (signed by the coordinator" in entry for entry in state.log)


def test_every_method_is_allowed_by_default():
    from engine.catalogue import federation_methods
    from engine.fl.registry import EXCHANGE_METHODS

    for method in (*federation_methods(), *EXCHANGE_METHODS):
        spec = {"method": method, "rounds": 3, "epochs": 1, "lr": 1e-3, "selector_lr": None, "image_size": 256,
                "batch_size": 8}
        assert SiteBounds().violations(spec) == [], method
    assert SiteBounds.from_dict({"allowed_methods": ["fedsm"]}).violations(dict(spec, method="fedavg"))


def test_checking_a_spec_against_bounds_does_not_import_torch():
    # the SuperNode checks every run's signed settings before pulling anything; importing torch there
    # (1.6 CPU-s and ~300 MB per site) for one default learning rate is what this guards against
    import subprocess
    import sys

    code = ("import sys\n"
            "from engine.security.run_spec import SiteBounds\n"
            "print(SiteBounds(max_selector_lr=1e-4).violations({'method': 'fedsm', 'rounds': 2, 'epochs': 1, "
            "'lr': 1e-3, 'image_size': 32, 'batch_size': 8}))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    violations, torch_loaded = out.stdout.strip().splitlines()
    assert "selector_lr = 0.001 is above max_selector_lr" in violations  # the scheme's default was checked
    assert torch_loaded == "False"
