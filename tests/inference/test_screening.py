"""fedsm infer skips masks (named by a datalist, or label maps by content) and warns about inputs off the task."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image
from testsupport import fedavg_network_bundle, write_photo_site

from engine.cli.main import main
from engine.inference.screening import label_map_reason, task_warnings
from engine.io.privacy import content_name
from engine.tasks import get_task


def test_a_folder_with_masks_beside_photos_segments_only_the_photos(tmp_path, capsys):
    # Prepare: photos and ORIGA masks in one folder; a Drishti-style RGB soft map named by a datalist
    site = write_photo_site(tmp_path / "site", ["a", "b"], size=40)
    mixed = tmp_path / "site" / "mixed"
    mixed.mkdir()
    for stem in ("a", "b"):
        Image.open(site / "images" / f"{stem}.png").save(mixed / f"{stem}.png")
        Image.open(site / "masks" / f"{stem}.png").save(mixed / f"{stem}_label.png")
    Image.new("RGB", (40, 40), (128, 128, 128)).save(mixed / "c_ODsegSoftmap.png")  # RGB: only the datalist says
    (tmp_path / "site" / "dl.json").write_text(json.dumps(
        {"training": [{"image": "mixed/a.png", "label": "mixed/c_ODsegSoftmap.png"}]}))
    model = fedavg_network_bundle(tmp_path / "coord")
    # Execute
    code = main(["infer", "--model", str(model), "--input", str(mixed), "--out", str(tmp_path / "out"),
                 "--device", "cpu", "--keep-names"])
    # Assert
    out = capsys.readouterr().out
    assert code == 0
    routing = json.loads((tmp_path / "out" / "routing.json").read_text())
    assert sorted(Path(r["input"]).name for r in routing["inputs"]) == ["a.png", "b.png"]
    skipped = {s["input"]: s["reason"] for s in routing["skipped"]}
    assert set(skipped) == {"a_label.png", "b_label.png", "c_ODsegSoftmap.png"}
    assert "named by a datalist" in skipped["c_ODsegSoftmap.png"] and "label map" in skipped["a_label.png"]
    assert "skipped a_label.png:" in out
    # Without --keep-names a skipped file is a case too: named by its content
    assert main(["infer", "--model", str(model), "--input", str(mixed), "--out", str(tmp_path / "neutral"),
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    routing = json.loads((tmp_path / "neutral" / "routing.json").read_text())
    skipped = {s["case"]: s["reason"] for s in routing["skipped"]}
    assert set(skipped) == {content_name([mixed / n]) for n in ("a_label.png", "b_label.png", "c_ODsegSoftmap.png")}
    assert f"skipped {content_name([mixed / 'a_label.png'])}:" in out and "a_label" not in out


def test_a_named_mask_is_segmented_with_a_warning_and_a_folder_of_masks_is_refused(tmp_path, capsys):
    site = write_photo_site(tmp_path / "site", ["a"], size=40)
    model = fedavg_network_bundle(tmp_path / "coord")
    assert main(["infer", "--model", str(model), "--input", str(site / "masks" / "a.png"), "--out",
                 str(tmp_path / "o1"), "--device", "cpu"]) == 0
    routing = json.loads((tmp_path / "o1" / "routing.json").read_text())
    assert any("looks like a single-channel image" in w for w in routing["inputs"][0]["warnings"])
    assert main(["infer", "--model", str(model), "--input", str(site / "masks"), "--out", str(tmp_path / "o2")]) == 2
    assert "every file there is a mask or label map" in capsys.readouterr().err


def test_photos_and_real_fundus_images_are_not_label_maps(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (30, 30), dtype=np.uint8)).save(tmp_path / "grey.png")
    assert label_map_reason(tmp_path / "grey.png", False) is None
    Image.fromarray(np.zeros((30, 30, 3), np.uint8)).save(tmp_path / "rgb.png")
    assert label_map_reason(tmp_path / "rgb.png", False) is None


def test_task_warnings_for_grey_photos_blue_photos_and_ct_volumes():
    fundus, prostate = get_task("fundus"), get_task("prostate")
    grey = np.repeat(np.arange(100, dtype=np.uint8).reshape(10, 10, 1), 3, axis=2)
    photo = SimpleNamespace(source="p.png", modality="OP", array=grey)
    assert "a grey image" in task_warnings(photo, fundus)[0]
    blue = np.zeros((10, 10, 3), np.uint8)
    blue[..., 2] = 200
    blue[..., 0] = 20
    assert "more blue than red" in task_warnings(SimpleNamespace(source="b.png", modality="OP", array=blue), fundus)[0]
    red = np.zeros((10, 10, 3), np.uint8)
    red[..., 0], red[..., 1], red[..., 2] = 180, 90, 30
    assert task_warnings(SimpleNamespace(source="f.png", modality="OP", array=red), fundus) == []
    ct = SimpleNamespace(source="ct", modality="CT", array=np.zeros((4, 4, 4), np.float32))
    assert "modality CT" in task_warnings(ct, prostate)[0]
    assert task_warnings(SimpleNamespace(source="v", modality="", array=ct.array), prostate) == []
