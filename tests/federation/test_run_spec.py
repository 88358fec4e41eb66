"""The signed run spec: signed by the coordinator's certified key, checked by each site against its [bounds].

A run whose settings break a site's bounds, whose spec was changed after signing, that was
signed by a key the site's CA did not certify, whose envelope expired before the site first saw
the run, that replays an envelope accepted for another run, or that comes in the old format is
refused by the site's SuperNode before any of its payload is pulled (the same guard as app
approval, exercised with a fake SuperNode module). The declared bounds of every setting are
tests/federation/test_setting_bounds.py's.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from fed_fixtures import pki  # noqa: F401
from test_hardening import APPROVED_FAB, _fake_supernode_module, _header_message

from engine.errors import ConfigError
from engine.federation.spec import MethodSpec
from engine.security.approval import app_hash
from engine.security.run_spec import (
    ENVELOPE_FORMAT,
    MAX_LIFETIME_S,
    RUN_CONFIG_KEY,
    RunLedger,
    RunSpecRefused,
    SiteBounds,
    describe,
    make_envelope,
    verify_envelope,
)

SPEC = MethodSpec(method="fedsm", task="fundus", site_names=("site1", "site2"), rounds=3, image_size=64, lr=1e-3)
APP = app_hash(APPROVED_FAB)


RUN_ID = "0123456789abcdef" * 2


def _signed(pki_dir, spec_json=None, **kw):
    return make_envelope(spec_json or SPEC.to_json(), APP, "session1", pki_dir / "server.key", pki_dir / "server.pem",
                         **{"run_id": RUN_ID, **kw})


def test_a_signed_spec_within_bounds_is_accepted_and_described(pki):  # noqa: F811
    settings = verify_envelope(_signed(pki), ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    assert settings["spec"]["method"] == "fedsm" and settings["signed"] and settings["session"] == "session1"
    assert settings["run_id"] == RUN_ID and settings["expires_at"] > time.time() and settings["first"]
    shown = describe(settings)
    assert shown["lr"] == 1e-3 and shown["rounds"] == 3 and shown["image_size"] == 64 and shown["app_hash"] == APP
    assert shown["run_id"] == RUN_ID and json.loads(_signed(pki))["format"] == ENVELOPE_FORMAT


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
    # the run id, the issue and expiry times are signed too
    for key, value in (("run_id", "f" * 32), ("expires_at", json.loads(_signed(pki))["expires_at"] + 3600)):
        with pytest.raises(RunSpecRefused, match="signature does not verify"):
            verify_envelope(json.dumps(dict(envelope, **{key: value})), ca_cert=pki / "ca.pem", app_hash=APP,
                            bounds=SiteBounds())
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
    with pytest.raises(RunSpecRefused) as refused:
        verify_envelope(_signed(pki), ca_cert=pki / "ca.pem", app_hash=APP, bounds=strict)
    for expected in ("method 'fedsm' is not in allowed_methods ['fedavg']", "lr = 0.001 is above max_lr = 0.0001",
                     "image_size = 64 is above max_image_size = 32"):
        assert expected in str(refused.value)
    with pytest.raises(RunSpecRefused, match="no readable run spec"):
        verify_envelope(None, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    # insecure demonstrations: no signature, bounds still apply
    assert verify_envelope(unsigned, ca_cert=None, app_hash=APP, bounds=SiteBounds())["signed"] is False
    with pytest.raises(RunSpecRefused, match="max_image_size"):
        verify_envelope(unsigned, ca_cert=None, app_hash=APP, bounds=strict)


def test_bounds_are_checked_when_site_toml_is_read():
    with pytest.raises(ConfigError, match="max_epochs"):
        SiteBounds.from_dict({"max_epochs": 0})
    with pytest.raises(ConfigError, match=r"unknown key.*max_epoch \(did you mean max_epochs"):
        SiteBounds.from_dict({"max_epoch": 3})
    with pytest.raises(ConfigError, match="allowed_methods"):
        SiteBounds.from_dict({"allowed_methods": "fedsm"})


# --- run id and expiry ---------------------------------------------------------------------------
def test_an_expired_or_future_envelope_is_refused_when_the_site_first_sees_the_run(pki):  # noqa: F811
    old = _signed(pki, lifetime_s=3600, now=time.time() - 7200)
    with pytest.raises(RunSpecRefused, match=r"expired at .* UTC.*Restart the run at the coordinator"):
        verify_envelope(old, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    ahead = _signed(pki, now=time.time() + 3600)
    with pytest.raises(RunSpecRefused, match="ahead of this site's clock"):
        verify_envelope(ahead, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    # a lifetime beyond what any site accepts: refused by the coordinator, and by the site if signed anyway
    with pytest.raises(ConfigError, match="lifetime"):
        _signed(pki, lifetime_s=MAX_LIFETIME_S + 1)
    forever = dict(json.loads(make_envelope(SPEC.to_json(), APP, "s", run_id=RUN_ID)), expires_at=2**40)
    with pytest.raises(RunSpecRefused, match="a site accepts at most 30 days"):
        verify_envelope(json.dumps(forever), ca_cert=None, app_hash=APP, bounds=SiteBounds())


def test_a_run_id_is_accepted_for_one_flower_run_and_past_its_expiry_only_there(pki, tmp_path):  # noqa: F811
    ledger = RunLedger(tmp_path / "accepted-runs.json")
    envelope = _signed(pki, lifetime_s=600)
    first = verify_envelope(envelope, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds(), flower_run=7,
                            ledger=ledger)
    assert first["first"] and ledger.flower_run(RUN_ID) == 7
    # the same run long after the expiry (a long run; a restarted SuperNode or site process): accepted
    later = time.time() + 86400
    again = verify_envelope(envelope, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds(), flower_run=7,
                            ledger=RunLedger(ledger.path), now=later)
    assert again["first"] is False
    # the same signed spec in another Flower run: a replay, refused even while it has not expired
    with pytest.raises(RunSpecRefused, match=r"already accepted by this site for Flower run 7, and now comes with "
                                             r"run 8: it is replayed"):
        verify_envelope(envelope, ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds(), flower_run=8,
                        ledger=ledger)
    # a run id the site has not accepted yet: its expiry is checked
    with pytest.raises(RunSpecRefused, match="expired"):
        verify_envelope(_signed(pki, run_id="e" * 32, lifetime_s=600), ca_cert=pki / "ca.pem", app_hash=APP,
                        bounds=SiteBounds(), flower_run=9, ledger=ledger, now=later)
    # a refused run is not recorded (its bounds broke): it stays refused, not "accepted earlier"
    strict = SiteBounds(max_lr=1e-4)
    other = _signed(pki, run_id="a" * 32)
    for _ in range(2):
        with pytest.raises(RunSpecRefused, match="max_lr"):
            verify_envelope(other, ca_cert=pki / "ca.pem", app_hash=APP, bounds=strict, flower_run=10, ledger=ledger)
    assert ledger.flower_run("a" * 32) is None


def test_the_old_envelope_format_and_a_malformed_run_id_are_refused(pki):  # noqa: F811
    old = json.loads(_signed(pki))
    old["format"] = "fedsm-signed-run-spec/1"
    for key in ("run_id", "issued_at", "expires_at"):
        del old[key]
    with pytest.raises(RunSpecRefused, match=r"old format fedsm-signed-run-spec/1, which carries no run id and no "
                                             r"expiry.*Update FedSM at the coordinator"):
        verify_envelope(json.dumps(old), ca_cert=pki / "ca.pem", app_hash=APP, bounds=SiteBounds())
    unsigned = json.loads(make_envelope(SPEC.to_json(), APP, "s", run_id=RUN_ID))
    with pytest.raises(RunSpecRefused, match="not 32 hex digits"):
        verify_envelope(json.dumps(dict(unsigned, run_id="../x")), ca_cert=None, app_hash=APP, bounds=SiteBounds())
    with pytest.raises(RunSpecRefused, match="incomplete"):
        verify_envelope(json.dumps(dict(unsigned, expires_at="never")), ca_cert=None, app_hash=APP,
                        bounds=SiteBounds())


def test_supernode_refuses_a_replayed_or_expired_run_before_pulling_its_payload(pki, tmp_path):  # noqa: F811
    policy = {"ca_cert": str(pki / "ca.pem"), "bounds": {}, "ledger": str(tmp_path / "accepted-runs.json")}
    calls, said = _guarded(_signed(pki), policy, flower_run=7)
    assert calls == ["get_run", "get_fab", "pull_object"] and said == []
    assert RunLedger(tmp_path / "accepted-runs.json").flower_run(RUN_ID) == 7
    calls, said = _guarded(_signed(pki), policy, flower_run=8)  # the same run id in another Flower run
    assert "pull_object" not in calls and said[0].startswith("FEDSM-REFUSED-SPEC") and "replayed" in said[0]
    calls, said = _guarded(_signed(pki, run_id="b" * 32, lifetime_s=60, now=time.time() - 120), policy, flower_run=9)
    assert "pull_object" not in calls and "expired" in said[0]


def test_every_message_must_carry_the_signed_session_and_run_id():
    from engine.federation.flower import records
    from engine.federation.flower.client_app import SiteWorker
    from engine.federation.flower.dialogue import answer_exchange, encode_request
    from engine.fl.exchange import Request
    from engine.fl.methods import SiteInstructions

    worker = SiteWorker(cfg=SimpleNamespace(name="site1"), events=None)
    worker.signed_spec, worker.signed_run = "{}", ("s1", RUN_ID)

    def train(**kw):
        return records.encode_instructions(SiteInstructions(1, {}, {}), rounds=1, method="fedavg", spec_json="{}",
                                           site="site1", **{"session": "s1", "run_id": RUN_ID, **kw})

    assert worker.addressed_instructions(train()).run_id == RUN_ID
    for changed in ({"run_id": "c" * 32}, {"run_id": ""}, {"session": "s2"}):
        with pytest.raises(ConfigError, match="not to the run the coordinator signed"):
            worker.addressed_instructions(train(**changed))
    exchange = encode_request(Request("server_batch"), rnd=1, rounds=1, method="blackfed-v1", spec_json="{}",
                              session="s1", site="site1", exchange_id=1, run_id="d" * 32)
    with pytest.raises(ConfigError, match="not to the run the coordinator signed"):
        answer_exchange(worker, exchange)


def _guarded(envelope, policy, flower_run=None):
    from flwr.supercore.fab import Fab

    from engine.federation.flower.launch import guard_apps

    calls: list[str] = []
    said: list[str] = []
    module = _fake_supernode_module(calls)
    guard_apps(module, [APP], "site1", report=said.append, policy=policy)
    message = _header_message()
    if flower_run is not None:  # the same header, of another Flower run
        from flwr.app import Message, Metadata

        m = message.metadata
        message = Message(metadata=Metadata(run_id=flower_run, message_id=m.message_id, src_node_id=m.src_node_id,
                                            dst_node_id=m.dst_node_id, reply_to_message_id="", group_id=m.group_id,
                                            created_at=m.created_at, ttl=m.ttl, message_type=m.message_type),
                          content=message.content)
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
        spec = MethodSpec(method=method, task="fundus", site_names=("site1", "site2"), rounds=3).as_dict()
        assert SiteBounds().violations(spec) == [], method
    assert SiteBounds.from_dict({"allowed_methods": ["fedsm"]}).violations(dict(spec, method="fedavg"))


def test_checking_a_spec_against_bounds_does_not_import_torch():
    # the SuperNode checks every run's signed settings before pulling anything; importing torch there
    # (1.6 CPU-s and ~300 MB per site) for one default learning rate is what this guards against
    import subprocess
    import sys

    code = ("import sys\n"
            "from engine.security.run_spec import SiteBounds\n"
            "print(SiteBounds(max_selector_lr=1e-4).violations({'method': 'fedsm', 'task': 'fundus', "
            "'site_names': ['a', 'b'], 'rounds': 2, 'epochs': 1, 'lr': 1e-3, 'image_size': 32, 'batch_size': 8, "
            "'options': {}}))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    violations, torch_loaded = out.stdout.strip().splitlines()
    # the default was checked: the reference scheme's 3e-3 at the default width 16
    assert "selector_lr = 0.003 is above max_selector_lr" in violations
    assert torch_loaded == "False"
