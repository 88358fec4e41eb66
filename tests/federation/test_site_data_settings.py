"""``site.toml``'s data settings: ``allow_outside`` and ``tolerate_orientation`` reach the site's data loading."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fakegrid import site_config
from testsupport import write_photo_site

from engine.data.datalist_builder import build_datalist
from engine.errors import ConfigError, DataError
from engine.federation.config import load_site_config
from engine.federation.events import EventWriter
from engine.federation.flower.client_app import SiteWorker
from engine.federation.preflight import check_site_datalist
from engine.io.masks import orientation_tolerance, set_orientation_tolerance


def _site_toml(root: Path, extra: str = "") -> Path:
    (root / "ca.pem").write_text("x")
    (root / "s.key").write_text("x")
    path = root / "site.toml"
    path.write_text(f"""
[site]
name = "north"
coordinator = "127.0.0.1:9092"
datalist = "datalist.json"
task = "fundus"
{extra}

[security]
ca_cert = "ca.pem"
private_key = "s.key"
""")
    return path


def test_data_settings_default_off_and_are_read(tmp_path):
    (tmp_path / "datalist.json").write_text('{"training": []}')
    cfg = load_site_config(_site_toml(tmp_path))
    assert (cfg.allow_outside, cfg.tolerate_orientation) == (False, 0.0)
    cfg = load_site_config(_site_toml(tmp_path, "allow_outside = true\ntolerate_orientation = 1.5"))
    assert (cfg.allow_outside, cfg.tolerate_orientation) == (True, 1.5)
    assert cfg.to_dict()["tolerate_orientation"] == 1.5


@pytest.mark.parametrize("value", ["45", "-1", "true", '"2"'])
def test_tolerate_orientation_out_of_range_is_a_clear_error(tmp_path, value):
    (tmp_path / "datalist.json").write_text('{"training": []}')
    with pytest.raises(ConfigError, match="tolerate_orientation"):
        load_site_config(_site_toml(tmp_path, f"tolerate_orientation = {value}"))


def test_a_site_reads_photos_outside_its_folder_only_when_allowed(tmp_path):
    photos = write_photo_site(tmp_path / "shared", [f"c{i}" for i in range(4)])
    site = tmp_path / "site"
    site.mkdir()
    build_datalist(photos / "images", photos / "masks", site / "datalist.json", split=(0.5, 0.25, 0.25),
                   allow_outside=True)
    base = replace(site_config("north", site / "datalist.json", site / "work"), allow_outside=False)

    with pytest.raises(DataError, match=r"outside|leaves the datalist's folder"):
        SiteWorker(base, EventWriter("site", "north"), validate=False).data("fundus", 16)
    worker = SiteWorker(replace(base, allow_outside=True), EventWriter("site", "north"), validate=False)
    data = worker.data("fundus", 16)
    assert data.train.images.shape[0] == 2
    # the preflight check follows the same setting (run_site wraps it the same way)
    with pytest.raises(DataError):
        check_site_datalist(site / "datalist.json", "fundus", "site.toml")


def test_run_site_applies_the_orientation_tolerance(tmp_path, monkeypatch):
    from engine.federation.flower import site as site_module

    (tmp_path / "datalist.json").write_text('{"training": []}')
    cfg = load_site_config(_site_toml(tmp_path, "tolerate_orientation = 2"), check_files=False)

    def stop_at_preflight(cfg, insecure):
        raise RuntimeError("preflight reached")

    monkeypatch.setattr(site_module, "_preflight", stop_at_preflight)
    try:
        with pytest.raises(RuntimeError, match="preflight reached"):
            site_module.run_site(cfg, events=EventWriter("site", "north"), insecure=True)
        assert orientation_tolerance() == 2.0
    finally:
        set_orientation_tolerance(0.0)
