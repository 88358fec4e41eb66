"""``--threads N`` on every ``fedsm`` command that runs torch: parsed, and the count the command's work sees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testsupport import fedavg_network_bundle, write_photo_site

import engine.threads
from engine import api
from engine.cli.main import main

#: A count none of the defaults gives here (tests run with 1 thread; the machine has 1-2 free cores).
N = 3


@pytest.fixture(autouse=True)
def own_threads(monkeypatch):
    """No earlier --threads choice, no OMP_NUM_THREADS; torch's count restored afterwards."""
    monkeypatch.setattr(engine.threads, "_chosen", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _watch(monkeypatch, owner, name, fake=None):
    """Replace ``owner.name`` by a call that records torch's thread count after the real (or fake) work."""
    seen: list[dict] = []
    real = getattr(owner, name)

    def watched(*args, **kwargs):
        out = (fake or real)(*args, **kwargs)
        seen.append({"threads": torch.get_num_threads(), "args": args, "kwargs": kwargs})
        return out

    monkeypatch.setattr(owner, name, watched)
    return seen


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return fedavg_network_bundle(tmp_path_factory.mktemp("bundle") / "coord")


@pytest.fixture(scope="module")
def datalist(tmp_path_factory) -> Path:
    site = write_photo_site(tmp_path_factory.mktemp("site") / "north", ["n0", "n1"], size=32)
    api.build_datalist(site / "images", site / "masks", site / "datalist.json", split=(0.5, 0, 0.5), seed=0)
    return site / "datalist.json"


def test_infer_runs_with_the_threads_asked_for_even_after_loading_the_model(tmp_path, monkeypatch, bundle, datalist):
    seen = _watch(monkeypatch, api, "infer")
    photo = sorted((datalist.parent / "images").glob("*.png"))[0]
    argv = ["infer", "--model", str(bundle), "--input", str(photo), "--out", str(tmp_path / "masks"), "--device", "cpu"]
    assert main([*argv, "--threads", str(N)]) == 0
    # the real inference ran (it loads the model, which once reset torch to the free cores) and kept N
    assert seen[-1]["threads"] == N and (tmp_path / "masks" / "routing.json").is_file()
    # without --threads an explicit OMP_NUM_THREADS wins, as for simulate
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(argv) == 0
    assert seen[-1]["threads"] == 2


def test_evaluate_runs_with_the_threads_asked_for(tmp_path, monkeypatch, bundle, datalist, capsys):
    seen = _watch(monkeypatch, api, "evaluate")
    assert main(["evaluate", "--model", str(bundle), "--datalist", str(datalist), "--device", "cpu",
                 "--threads", str(N)]) == 0
    assert seen[-1]["threads"] == N and "north" in capsys.readouterr().out


def test_bench_applies_and_records_the_threads_asked_for(tmp_path, monkeypatch):
    summary = {"ran": [], "cached": [], "failed": {}, "wall_s": 0.0, "report": str(tmp_path / "results.md")}
    seen = _watch(monkeypatch, api, "benchmark", fake=lambda *a, **k: summary)
    assert main(["bench", "--preset", "tiny", "--out", str(tmp_path), "--threads", str(N)]) == 0
    assert seen[-1]["threads"] == N and seen[-1]["kwargs"]["threads"] == N  # recorded in the report's machine
    # default: the free cores (or OMP_NUM_THREADS), no longer a fixed 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["bench", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    assert seen[-1]["threads"] == 2 and seen[-1]["kwargs"]["threads"] == 2


def _site_toml(root: Path, extra: str = "") -> Path:
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "datalist.json").write_text('{"training": []}')
    path = root / "site.toml"
    path.write_text(f"""
[site]
name = "site1"
coordinator = "127.0.0.1:9092"
datalist = "data/datalist.json"
task = "fundus"
{extra}

[security]
ca_cert = "ca.pem"
private_key = "site1.key"
approved_apps = ["sha256:{'ab' * 32}"]
""", encoding="utf-8")
    return path


def test_site_trains_with_the_threads_asked_for_else_site_toml(tmp_path, monkeypatch):
    import engine.federation.flower.memory as memory
    import engine.federation.flower.site as site

    monkeypatch.setattr(memory, "keep_freed_memory", lambda: None)
    seen = _watch(monkeypatch, site, "run_site", fake=lambda cfg, **kwargs: 0)
    config = _site_toml(tmp_path, "threads = 2")
    assert main(["site", "--config", str(config), "--insecure", "--threads", str(N)]) == 0
    assert seen[-1]["threads"] == N and seen[-1]["args"][0].threads == N  # --threads wins over site.toml
    assert main(["site", "--config", str(config), "--insecure"]) == 0
    assert seen[-1]["threads"] == 2 and seen[-1]["args"][0].threads == 2


def test_server_runs_with_the_threads_asked_for(tmp_path, monkeypatch):
    import engine.federation.flower.memory as memory
    import engine.federation.flower.server as server

    monkeypatch.setattr(memory, "keep_freed_memory", lambda: None)
    seen = _watch(monkeypatch, server, "run_server", fake=lambda cfg, **kwargs: {"files": {}})
    config = tmp_path / "federation.toml"
    config.write_text('[federation]\nsites = ["site1", "site2"]\naddress = "127.0.0.1:9092"\nwork_dir = "coord"\n\n'
                      '[training]\ntask = "fundus"\nmethod = "fedavg"\nrounds = 1\nimage_size = 32\n', encoding="utf-8")
    assert main(["server", "--config", str(config), "--insecure", "--threads", str(N)]) == 0
    assert seen[-1]["threads"] == N


@pytest.mark.parametrize("command", [["infer", "--model", "m", "--input", "i", "--out", "o"],
                                     ["evaluate", "--model", "m", "--datalist", "d"], ["bench"],
                                     ["site", "--config", "s"], ["server", "--config", "f"]])
def test_threads_must_be_a_positive_whole_number_everywhere(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--threads", "0"])
    assert exc.value.code == 2
    assert "--threads must be a whole number >= 1" in capsys.readouterr().err
