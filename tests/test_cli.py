"""End to end through the command line: simulate, then infer with the written super model."""

import json
import subprocess
import sys

import pytest

from engine.cli.main import main


@pytest.mark.slow
def test_simulate_then_infer(tmp_path):
    out = tmp_path / "run"
    code = main(["simulate", "--task", "fundus", "--sites", "2", "--rounds", "1", "--image-size", "32",
                 "--methods", "fedavg,fedsm", "--device", "cpu", "--selector-calibration", "lda", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "fedsm-simulation-report/1"
    assert set(report["methods"]) == {"fedavg", "fedsm"}
    assert set(report["methods"]["fedsm"]["dice"]) == {"site1", "site2"}
    assert 0.0 <= report["methods"]["fedsm"]["client_average"]["disc"] <= 1.0
    assert report["traffic"]["fedsm"]["sent_per_site_round"] > report["traffic"]["fedavg"]["sent_per_site_round"]
    assert (out / "report.md").read_text().count("| FedSM |") >= 1
    # the LDA-calibrated selector routes after one round: held-out images of participating sites told apart
    # (the default reference selector takes one Adam step per round and needs tens of rounds)
    assert report["methods"]["fedsm"]["extra"]["selector_accuracy"]["overall"] >= 0.95
    assert (out / "supermodel.safetensors").stat().st_size > 0
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert {"batch", "round_end", "method_end"} <= {e["event"] for e in events}

    test_image = sorted((out / "data" / "site1" / "images").glob("*.png"))[0]
    masks = tmp_path / "masks"
    assert main(["infer", "--model", str(out / "supermodel.safetensors"), "--input", str(test_image),
                 "--out", str(masks), "--device", "cpu"]) == 0
    routing = json.loads((masks / "routing.json").read_text())
    assert routing["inputs"] and (masks / routing["inputs"][0]["mask"]).exists()
    assert routing["inputs"][0]["mask"] == f"{routing['inputs'][0]['case']}_mask.png"
    assert all(image["reason"] for item in routing["inputs"] for image in item["images"])


def test_infer_with_foreign_file_is_one_clear_line(tmp_path):
    bogus = tmp_path / "model.safetensors"
    bogus.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
    image = tmp_path / "x.png"
    image.write_bytes(b"not really")
    # -X importtime: every module the command imports is listed on stderr
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "engine.cli.main", "infer", "--model", str(bogus),
                           "--input", str(image), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert "Traceback" not in proc.stderr
    assert len(said) == 1 and str(bogus) in said[0], said
    # refused from the file's header, before the compute stack loads (seconds sooner)
    assert "engine.bundle.supermodel" in imported and "torch" not in imported and "monai" not in imported


def test_unknown_method_is_a_clear_error(tmp_path, capsys):
    code = main(["simulate", "--task", "fundus", "--methods", "fedmagic", "--out", str(tmp_path)])
    assert code == 2
    assert "fedmagic" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_simulate_threads_must_be_a_positive_whole_number(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--task", "fundus", "--threads", value, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--threads must be a whole number >= 1" in capsys.readouterr().err


def test_simulate_threads_sets_torch_threads(monkeypatch):
    import torch

    from engine.cli.common import set_threads

    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # without --threads an explicit OMP_NUM_THREADS wins
        assert set_threads(None) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
