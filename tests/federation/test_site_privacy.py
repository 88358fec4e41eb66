"""site.toml [privacy]: the site operator's FedIOD privacy knob, read and checked at the site."""

import pytest

from engine.errors import ConfigError
from engine.federation.config import load_site_config
from engine.fl.fediod_privacy import PrivacySetting

SITE = """
[site]
name = "site1"
coordinator = "127.0.0.1:9092"
datalist = "datalist.json"
task = "fundus"
"""


def site_toml(tmp_path, privacy=""):
    (tmp_path / "datalist.json").write_text('{"training": []}', encoding="utf-8")
    path = tmp_path / "site.toml"
    path.write_text(SITE + privacy, encoding="utf-8")
    return path


def test_no_privacy_table_means_no_setting(tmp_path):
    cfg = load_site_config(site_toml(tmp_path), check_files=False)
    assert cfg.privacy is None and cfg.to_dict()["privacy"] is None


def test_noise_multiplier_or_epsilon_target_is_read(tmp_path):
    cfg = load_site_config(site_toml(tmp_path, "[privacy]\nnoise_multiplier = 1.5\nclip_norm = 0.5\n"),
                           check_files=False)
    assert cfg.privacy == PrivacySetting(noise_multiplier=1.5, clip_norm=0.5)
    cfg = load_site_config(site_toml(tmp_path, "[privacy]\nepsilon = 8\ndelta = 1e-6\n"), check_files=False)
    assert cfg.privacy.epsilon == 8.0 and cfg.privacy.delta == 1e-6 and cfg.privacy.enabled
    assert cfg.to_dict()["privacy"]["epsilon"] == 8.0


@pytest.mark.parametrize(("table", "message"), [
    ("noise_multiplier = -1", "noise_multiplier must be >= 0"),
    ("noise_multiplier = 1\nepsilon = 3", "not both"),
    ('epsilon = "small"', "epsilon = 'small' must be a int or float"),
    ("sigma = 1", "unknown key(s) ['sigma'] in [privacy]"),
    ("delta = 2", "delta must lie in (0, 1)"),
])
def test_bad_privacy_settings_name_the_file_and_key(tmp_path, table, message):
    with pytest.raises(ConfigError) as err:
        load_site_config(site_toml(tmp_path, "[privacy]\n" + table + "\n"), check_files=False)
    assert message in str(err.value) and "site.toml" in str(err.value)
