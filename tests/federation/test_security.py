"""Certificates, site keys, enrolment and app approval."""

import stat

import pytest
from cryptography import x509

from engine.cli.main import main
from engine.errors import ConfigError
from engine.security import certs, enrollment
from engine.security.approval import AppNotApproved, app_hash, check_app_approved, normalise_app_hash


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    certs.create_ca(root)
    certs.create_server_certificate(root, root, ["coordinator.example.org", "10.1.2.3"])
    return root


def test_ca_and_server_certificate(pki):
    cert = x509.load_pem_x509_certificate((pki / "server.pem").read_bytes())
    names = certs.certificate_names(cert)
    assert {"coordinator.example.org", "10.1.2.3", "127.0.0.1", "localhost"} <= set(names)
    certs.check_server_certificate(pki / "ca.pem", pki / "server.pem", pki / "server.key", "coordinator.example.org")
    certs.check_server_certificate(pki / "ca.pem", pki / "server.pem", pki / "server.key", "127.0.0.1")
    # private keys are readable by their owner only, certificates by everyone
    assert stat.S_IMODE((pki / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((pki / "server.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((pki / "ca.pem").stat().st_mode) == 0o644


def test_server_certificate_checks(pki, tmp_path):
    with pytest.raises(ConfigError, match=r"not valid for 'other\.org'"):
        certs.check_server_certificate(pki / "ca.pem", pki / "server.pem", pki / "server.key", "other.org")
    other = tmp_path / "other"
    certs.create_ca(other)
    with pytest.raises(ConfigError, match="is not signed by the CA"):
        certs.check_server_certificate(other / "ca.pem", pki / "server.pem", pki / "server.key", "127.0.0.1")
    certs.create_server_certificate(other, other, ["127.0.0.1"])
    with pytest.raises(ConfigError, match="does not belong to"):
        certs.check_server_certificate(pki / "ca.pem", pki / "server.pem", other / "server.key", "127.0.0.1")
    with pytest.raises(ConfigError, match="does not exist"):
        certs.check_server_certificate(pki / "nope.pem", pki / "server.pem", pki / "server.key", "127.0.0.1")


def test_files_are_not_overwritten_without_force(pki):
    with pytest.raises(ConfigError, match="already exist"):
        certs.create_ca(pki)
    with pytest.raises(ConfigError, match="neither an IP address nor a host name"):
        certs.create_server_certificate(pki, pki / "x", ["bad host"])


def test_site_keys_and_enrolment(tmp_path):
    a = certs.create_site_keys("site1", tmp_path)
    b = certs.create_site_keys("site2", tmp_path)
    assert certs.load_site_private_key(a.key).public_key().public_numbers() == \
        certs.load_public_key(a.cert).public_numbers()
    enrolled = tmp_path / "enrolled"
    fingerprint = enrollment.enroll_site(enrolled, "site1", a.cert)
    assert fingerprint == certs.key_fingerprint(certs.load_public_key(a.cert))
    assert fingerprint.startswith("SHA256:") and len(fingerprint) == 7 + 64
    assert enrollment.enroll_site(enrolled, "site1", a.cert) == fingerprint  # idempotent
    with pytest.raises(ConfigError, match="already enrolled for site 'site1'"):
        enrollment.enroll_site(enrolled, "site3", a.cert)
    with pytest.raises(ConfigError, match="already enrolled with another key"):
        enrollment.enroll_site(enrolled, "site1", b.cert)
    enrollment.enroll_site(enrolled, "site1", b.cert, force=True)
    enrollment.enroll_site(enrolled, "site2", a.cert)
    assert set(enrollment.enrolled_keys(enrolled)) == {"site1", "site2"}
    enrollment.remove_site(enrolled, "site2")
    assert set(enrollment.enrolled_keys(enrolled)) == {"site1"}
    with pytest.raises(ConfigError, match="not enrolled"):
        enrollment.remove_site(enrolled, "site2")
    # a key being enrolled beside them (engine.io.atomic's temporary file keeps the ".pub.pem" suffixes) is
    # not a site, and its half-written bytes are not read
    from engine.io.atomic import atomic_path

    with atomic_path(enrollment.enrolled_key_path(enrolled, "site3")) as half_written:
        half_written.write_bytes(b"-----BEGIN PUB")
        assert half_written.name.endswith(".pub.pem")
        assert set(enrollment.enrolled_keys(enrolled)) == {"site1"}


def test_keys_that_cannot_authenticate_are_refused(tmp_path, pki):
    site = certs.create_site_keys("site1", tmp_path)
    with pytest.raises(ConfigError, match="is not a PEM public key"):
        certs.load_public_key(site.key)  # the private key sent by mistake
    with pytest.raises(ConfigError, match="not an unencrypted OpenSSH private key"):
        certs.load_site_private_key(pki / "ca.pem")
    with pytest.raises(ConfigError, match="is not allowed"):
        certs.create_site_keys("site 1", tmp_path)


def test_app_approval():
    fab = b"a flower app bundle"
    digest = app_hash(fab)
    assert check_app_approved(fab, [digest], "site1") == digest
    assert check_app_approved(fab, [digest[7:].upper()], "site1") == digest
    with pytest.raises(AppNotApproved) as err:
        check_app_approved(fab + b"!", [digest], "site1")
    assert app_hash(fab + b"!") in str(err.value) and "site1 refused app" in str(err.value)
    with pytest.raises(AppNotApproved):
        check_app_approved(fab, [], "site1")
    with pytest.raises(ConfigError, match="not a SHA-256 app hash"):
        normalise_app_hash("sha256:12")


def test_certs_and_enroll_commands(tmp_path, capsys):
    coord = tmp_path / "coord"
    assert main(["certs", "ca", "--out", str(coord / "certs")]) == 0
    assert main(["certs", "server", "--ca", str(coord / "certs"), "--out", str(coord / "certs"),
                 "--host", "coordinator.example.org"]) == 0
    assert main(["certs", "site", "--name", "site1", "--out", str(tmp_path / "site1")]) == 0
    (tmp_path / "federation.toml").write_text(
        '[federation]\nsites = ["site1", "site2"]\nwork_dir = "coord"\n'
        '[training]\ntask = "fundus"\nmethod = "fedavg"\n')
    cfg = str(tmp_path / "federation.toml")
    assert main(["enroll", "--config", cfg, "--site", "site1", "--public-key",
                 str(tmp_path / "site1" / "site1.pub.pem")]) == 0
    capsys.readouterr()
    assert main(["enroll", "--config", cfg, "--list"]) == 0
    listed = capsys.readouterr().out
    assert "site1: SHA256:" in listed and "site2: NOT ENROLLED" in listed
    assert main(["enroll", "--config", cfg, "--site", "site2", "--public-key", str(tmp_path / "nope.pem")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["certs", "app-hash"]) == 0
    assert capsys.readouterr().out.strip().startswith("sha256:")
