"""FedIOD end to end through the command line: simulate, the distilled bundle, infer with it."""

import json

import pytest

from engine.bundle import read_metadata
from engine.cli.main import main


@pytest.mark.slow
def test_simulate_fediod_then_infer_with_the_distilled_student(tmp_path):
    # Prepare / Execute: a tiny run with DP at one epsilon target
    out = tmp_path / "run"
    code = main(["simulate", "--task", "fundus", "--sites", "2", "--rounds", "1", "--image-size", "32",
                 "--methods", "fediod", "--fediod-steps", "2", "--fediod-batch", "2", "--teacher-epochs", "1",
                 "--dp-epsilon", "8", "--device", "cpu", "--out", str(out)])
    # Assert: report rows, epsilon per site, Standalone teachers, ledger, bundle
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    extra = report["methods"]["fediod"]["extra"]
    assert set(extra["epsilon"]) == {"site1", "site2"}
    assert all(0 < e <= 8.0 * 1.01 for e in extra["epsilon"].values())
    assert set(extra["standalone"]["models"]) == {"site1", "site2"}
    assert "| teacher of site1 |" in (out / "report.md").read_text()
    ledger = [json.loads(line) for line in (out / "fediod-ledger.jsonl").read_text().splitlines()]
    sent = {name for entry in ledger for name in entry["sent"]}
    assert sent == {"label_frequency", "logits", "scores", "input_grad"}
    meta = read_metadata(out / "fediod.safetensors")
    assert meta.method == "fediod" and meta.single_model and meta.extra["distilled"] is True
    assert meta.extra["epsilon"] == extra["epsilon"]

    test_image = sorted((out / "data" / "site1" / "images").glob("*.png"))[0]
    masks = tmp_path / "masks"
    assert main(["infer", "--model", str(out / "fediod.safetensors"), "--input", str(test_image),
                 "--out", str(masks), "--device", "cpu"]) == 0
    routing = json.loads((masks / "routing.json").read_text())
    assert routing["distilled"]["epsilon"] == extra["epsilon"]
    assert routing["inputs"][0]["models_used"] == {"global": 1}
