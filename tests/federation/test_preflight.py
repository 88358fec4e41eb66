"""Start-up checks: busy port, missing or broken datalist, bad certificate -> one clear line; --once watch; banner."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from testsupport import write_photo_site

from engine.cli.main import main
from engine.errors import ConfigError
from engine.federation.preflight import CoordinatorWatch, check_port_free, check_site_certificates, round_banner


@pytest.fixture(autouse=True)
def keep_signal_handlers(monkeypatch):
    """fedsm server/site install SIGINT/SIGTERM handlers; keep pytest's."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock
    sock.close()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def site_toml(tmp_path: Path, coordinator: str, datalist: str = "site/datalist.json", security: str = "") -> Path:
    path = tmp_path / "site.toml"
    path.write_text(f'[site]\nname = "site1"\ncoordinator = "{coordinator}"\ndatalist = "{datalist}"\n'
                    f'task = "fundus"\nwork_dir = "work"\n[security]\napproved_apps = []\n{security}')
    return path


def test_busy_coordinator_port_is_one_line_and_starts_nothing(tmp_path, listener, capsys):
    port = listener.getsockname()[1]
    path = tmp_path / "federation.toml"
    path.write_text(f'[federation]\nsites = ["site1"]\naddress = "127.0.0.1:{port}"\nwork_dir = "coord"\n'
                    '[training]\ntask = "fundus"\nmethod = "fedavg"\nrounds = 1\nimage_size = 32\n')
    assert main(["server", "--config", str(path), "--insecure"]) == 2
    line = one_error_line(capsys)
    assert f"127.0.0.1:{port} is in use by another program" in line and "[federation] address" in line
    assert not (tmp_path / "coord" / "superlink.log").exists()


def test_missing_and_broken_datalists_are_one_line_before_joining(tmp_path, listener, capsys):
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    path = site_toml(tmp_path, address)
    assert main(["site", "--config", str(path), "--insecure"]) == 2
    line = one_error_line(capsys)
    assert "datalist" in line and "does not exist" in line
    # a datalist naming files that are not there
    site = write_photo_site(tmp_path / "site", ["a", "b"])
    assert main(["datalist", "--images", str(site / "images"), "--masks", str(site / "masks"),
                 "--out", str(site / "datalist.json")]) == 0
    capsys.readouterr()
    (site / "masks" / "a.png").unlink()
    assert main(["site", "--config", str(path), "--insecure"]) == 2
    line = one_error_line(capsys)
    assert "names 1 missing file(s)" in line and "a.png" in line and "validate-data" in line
    assert not (tmp_path / "work" / "supernode.log").exists()


def test_bad_certificate_is_one_line(tmp_path, listener, capsys):
    from engine.security import certs

    site = write_photo_site(tmp_path / "site", ["a"])
    main(["datalist", "--images", str(site / "images"), "--masks", str(site / "masks"),
          "--out", str(site / "datalist.json"), "--split", "1,0,0"])
    capsys.readouterr()
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n")
    certs.create_site_keys("site1", tmp_path / "keys")
    security = 'ca_cert = "ca.pem"\nprivate_key = "keys/site1.key"\n'
    path = site_toml(tmp_path, f"127.0.0.1:{listener.getsockname()[1]}", security=security)
    assert main(["site", "--config", str(path)]) == 2
    line = one_error_line(capsys)
    assert "ca_cert" in line and "is not a PEM certificate" in line and "ca.pem from the coordinator" in line
    # a leaf certificate given as the CA
    ca = certs.create_ca(tmp_path / "ca")
    server = certs.create_server_certificate(tmp_path / "ca", tmp_path / "server", ["127.0.0.1"])
    with pytest.raises(ConfigError, match="is not a certificate authority"):
        check_site_certificates(server.cert, None, "site.toml")
    check_site_certificates(ca.cert, tmp_path / "keys" / "site1.key", "site.toml")
    with pytest.raises(ConfigError, match=r"private_key: .* is not an unencrypted OpenSSH private key"):
        check_site_certificates(None, ca.cert, "site.toml")


def test_port_check_passes_a_free_port_and_names_the_setting(listener):
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    check_port_free("127.0.0.1", port, "x", "y")
    with pytest.raises(ConfigError, match=r"the thing 127\.0\.0\.1:\d+ is in use .* in site\.toml \[site\] port"):
        check_port_free("127.0.0.1", listener.getsockname()[1], "the thing", "site.toml [site] port")


def test_once_watch_counts_a_coordinator_gone_only_after_it_was_seen():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    watch = CoordinatorWatch(f"127.0.0.1:{port}", "site.toml", grace=10, interval=1)
    # not yet listening: a site started before its coordinator keeps waiting
    assert not watch.gone(now=0) and not watch.gone(now=100)
    sock.listen(1)
    assert not watch.gone(now=200) and watch.seen
    sock.close()
    assert not watch.gone(now=205)  # down since 205
    assert not watch.gone(now=210)
    assert watch.gone(now=216)


def test_round_banner_excludes_the_calibration_round():
    plain = SimpleNamespace(rounds=40, total_rounds=41)
    assert round_banner(plain) == "40 rounds (+1 validation and calibration round)"
    assert round_banner(SimpleNamespace(rounds=3, total_rounds=3)) == "3 rounds"
    warm = SimpleNamespace(rounds=4, total_rounds=35, selector_warmup=30)
    assert round_banner(warm) == "4 rounds (+30 selector warm-up rounds, +1 validation and calibration round)"
    extra = SimpleNamespace(rounds=3, extra_rounds=2, total_rounds=6)
    assert round_banner(extra) == "3 rounds (+2 selector rounds, +1 validation and calibration round)"
