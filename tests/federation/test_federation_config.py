"""federation.toml and site.toml: what is accepted, and the message for what is not."""

import pytest

from engine import api
from engine.errors import ConfigError
from engine.federation.config import is_loopback, load_federation_config, load_site_config, parse_address

HASH = "sha256:" + "ab" * 32


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


FEDERATION = """
[federation]
sites = ["site1", "site2", "site3"]
address = "127.0.0.1:9092"
work_dir = "coord"
min_sites = 2
round_timeout = 30

[training]
task = "fundus"
method = "fedsm"
rounds = 2
image_size = 32
"""


def test_federation_config_defaults_and_paths(tmp_path):
    cfg = load_federation_config(write(tmp_path / "federation.toml", FEDERATION))
    assert cfg.sites == ("site1", "site2", "site3")
    assert (cfg.host, cfg.port, cfg.address) == ("127.0.0.1", 9092, "127.0.0.1:9092")
    assert cfg.work_dir == tmp_path / "coord"
    assert cfg.tls.ca_cert == tmp_path / "coord" / "certs" / "ca.pem"
    assert cfg.enrolled_dir == tmp_path / "coord" / "enrolled"
    assert (cfg.min_sites, cfg.round_timeout, cfg.round_attempts) == (2, 30.0, 3)
    # the same defaults as `fedsm simulate`: lam = max(0.7, 1/K), extra_rounds = ceil(rounds / 2)
    assert cfg.spec.lam == pytest.approx(0.7)
    assert cfg.spec.total_rounds == 3


@pytest.mark.parametrize(("change", "message"), [
    (("min_sites = 2", "min_sites = 4"), "min_sites = 4 must lie between 1 and the number of sites (3)"),
    (('address = "127.0.0.1:9092"', 'address = "nohost"'), "must be host:port"),
    (("round_timeout = 30", "round_timeout = -1"), "round_timeout = -1.0 must be > 0"),
    (("round_timeout = 30", 'round_timeout = "30"'), "round_timeout = '30' must be a int or float"),
    (('method = "fedsm"', 'method = "centralized"'), "cannot run over the network"),
    (('sites = ["site1", "site2", "site3"]', 'sites = ["site1", "site 2"]'), "is not allowed"),
    (("rounds = 2", "rounds = 2\nlearning_rate = 3"), "unknown training setting(s) ['learning_rate']"),
    (("min_sites = 2", "min_sites = 2\nport = 1"), "unknown key(s) ['port'] in [federation]"),
    (("min_sites = 2", "min_sites = 2\nsuperlink_port = 9092"), "superlink_port = 9092 is the port of address"),
])
def test_federation_config_errors_name_the_problem(tmp_path, change, message):
    path = write(tmp_path / "federation.toml", FEDERATION.replace(*change))
    with pytest.raises(ConfigError) as err:
        load_federation_config(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_federation_config_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_federation_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_federation_config(write(tmp_path / "bad.toml", "[federation\nsites="))
    with pytest.raises(ConfigError, match=r"missing \[training\]"):
        load_federation_config(write(tmp_path / "f.toml", '[federation]\nsites = ["a"]\n'))


def site_toml(tmp_path, extra="", approved=f'["{HASH}"]'):
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "datalist.json").write_text('{"training": []}')
    (tmp_path / "ca.pem").write_text("x")
    (tmp_path / "site1.key").write_text("x")
    return write(tmp_path / "site.toml", f"""
[site]
name = "site1"
coordinator = "127.0.0.1:9092"
datalist = "data/datalist.json"
task = "fundus"
{extra}

[security]
ca_cert = "ca.pem"
private_key = "site1.key"
approved_apps = {approved}
""")


def test_site_config_reads_and_normalises(tmp_path):
    cfg = load_site_config(site_toml(tmp_path, approved=f'["{HASH[7:].upper()}"]'))
    assert cfg.name == "site1"
    assert cfg.datalist == tmp_path / "data" / "datalist.json"
    assert cfg.work_dir == tmp_path / "site1-work"
    assert cfg.approved_apps == (HASH,)
    assert (cfg.device, cfg.threads, cfg.runtime_port) == ("auto", 0, 0)


@pytest.mark.parametrize(("extra", "approved", "message"), [
    ('device = "tpu"', f'["{HASH}"]', "device = 'tpu' must be 'auto', 'cpu' or 'cuda'"),
    ("threads = -1", f'["{HASH}"]', "threads = -1 must be >= 0"),
    ("", '["md5:123"]', "is not a SHA-256 app hash"),
    ('runtime_port = 70000', f'["{HASH}"]', "is not a TCP port"),
])
def test_site_config_errors(tmp_path, extra, approved, message):
    with pytest.raises(ConfigError) as err:
        load_site_config(site_toml(tmp_path, extra, approved))
    assert message in str(err.value)


def test_site_config_checks_files(tmp_path):
    path = site_toml(tmp_path)
    (tmp_path / "site1.key").unlink()
    with pytest.raises(ConfigError, match=r"private_key .*site1\.key does not exist"):
        load_site_config(path)
    assert load_site_config(path, check_files=False).name == "site1"


def test_api_reads_site_config_and_builds_the_command(tmp_path):
    path = site_toml(tmp_path)
    info = api.read_site_config(path)
    assert info["name"] == "site1" and info["approved_apps"] == [HASH]
    assert info["datalist"] == str(tmp_path / "data" / "datalist.json")
    argv = api.site_command(path)
    assert argv[1:] == ["-m", "engine.cli.main", "site", "--config", str(path), "--json"]
    assert "--json" not in api.site_command(path, json_events=False)


def test_addresses():
    assert parse_address("[::1]:9092", "x") == ("::1", 9092)
    assert parse_address("example.org:1", "x") == ("example.org", 1)
    with pytest.raises(ConfigError, match="port 0"):
        parse_address("a:0", "x")
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.org")
