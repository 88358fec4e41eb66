"""Exports and reports carry no absolute paths, and a DICOM SEG no identifiers it does not need (issue 16.6)."""

from __future__ import annotations

import json
from pathlib import Path

import hostile_files as hf
import numpy as np
import pydicom
import pytest
from synthetic_dicom import write_series
from testsupport import SHARED_DATA

from engine.io.dicom_seg import build_dicom_seg
from engine.io.privacy import public_path, scrub_absolute_paths
from engine.io.readers import open_study
from engine.io.seg_privacy import COPIED_PATIENT_STUDY, REMOVED
from engine.io.study import LabelMap

PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"
PHI = {
    "PatientComments": "lives at 12 Elm Street",
    "InstitutionName": "Saint Example Hospital",
    "InstitutionAddress": "1 Hospital Road",
    "StationName": "MRI-SCANNER-3",
    "DeviceSerialNumber": "SN-998877",
    "OperatorsName": "Tech^Tina",
    "PatientAge": "063Y",
    "PatientWeight": "81.234",
    "OtherPatientIDs": "MRN-5566",
}


def _with_phi(source: list[Path], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for path in source:
        ds = pydicom.dcmread(path)
        for keyword, value in PHI.items():
            setattr(ds, keyword, value)
        ds.save_as(folder / path.name, enforce_file_format=True)
    return folder


def _all_values(ds: pydicom.Dataset) -> set[str]:
    """Every element value of a dataset, nested sequences included, as text."""
    values: set[str] = set()

    def visit(dataset: pydicom.Dataset, elem: pydicom.DataElement) -> None:
        if elem.VR not in ("SQ", "OB", "OW"):
            values.add(str(elem.value))

    ds.walk(visit)
    return values


def _check_seg(seg: pydicom.Dataset) -> None:
    values = _all_values(seg)
    for keyword, value in PHI.items():
        assert value not in values, keyword
    for keyword in REMOVED:
        if keyword == "DeviceSerialNumber":  # FedSM's own (required): "none"
            assert seg.DeviceSerialNumber == "none"
            continue
        assert keyword not in seg, keyword
        for item in seg.get("ContributingEquipmentSequence") or []:
            assert keyword not in item, keyword


def test_seg_copies_only_required_patient_and_study_attributes(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "plain", slices=3)
    folder = _with_phi(paths, tmp_path / "Doe_John")
    study = open_study(folder)
    labels = np.zeros(study.shape, np.uint8)
    labels[2:5, 2:5, 1] = 1
    seg = build_dicom_seg(study, LabelMap(labels, {1: "prostate"}))
    _check_seg(seg)
    source = pydicom.dcmread(sorted(folder.iterdir())[0], stop_before_pixels=True)
    for keyword in ("PatientName", "PatientID", "StudyInstanceUID", "FrameOfReferenceUID"):
        assert seg.get(keyword) == source.get(keyword), keyword  # what a SEG must carry is still there
    assert "PatientName" in COPIED_PATIENT_STUDY


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")
def test_fedsm_infer_on_a_patient_named_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The acceptance case: ProstateX in a folder named after a patient, exported as DICOM SEG."""
    from engine.cli.main import main

    folder = _with_phi(sorted(PROSTATEX.glob("*.dcm")), tmp_path / "Doe_John_1957")
    model = hf.write_small_bundle(tmp_path / "models" / "prostate.safetensors", "prostate")
    out = tmp_path / "results"
    assert main(["infer", "--model", str(model), "--input", str(folder), "--out", str(out), "--device", "cpu",
                 "--format", "dicom-seg"]) == 0
    stdout = capsys.readouterr().out
    routing_text = (out / "routing.json").read_text()
    routing = json.loads(routing_text)
    # The folder's name is nowhere: not in routing.json, the output files' names or stdout (which names
    # only the output folder the user chose)
    assert str(tmp_path) not in routing_text
    for text in (routing_text, stdout, *(p.name for p in out.iterdir())):
        assert "Doe" not in text and "1957" not in text, text
    assert routing["bundle"]["path"] == "prostate.safetensors"
    [entry] = routing["inputs"]
    assert entry["case"].startswith("case-") and "input" not in entry
    seg = pydicom.dcmread(out / entry["mask"])
    _check_seg(seg)
    for keyword in ("PatientComments", "InstitutionName", "InstitutionAddress", "StationName"):
        assert keyword not in seg


def test_public_paths(tmp_path: Path) -> None:
    (tmp_path / "Doe_John" / "T2").mkdir(parents=True)
    (tmp_path / "scan.nii.gz").write_bytes(b"")
    root = tmp_path / "Doe_John"
    assert public_path(root, root) == "."
    assert public_path(root / "T2", root) == "T2"
    assert public_path(tmp_path / "scan.nii.gz", tmp_path / "scan.nii.gz") == "scan.nii.gz"
    doc = {"data_dir": str(root), "out": str(tmp_path / "run" / "a.json"), "n": 3, "note": "not/a/path",
           "list": [str(root / "T2")]}
    assert scrub_absolute_paths(doc, tmp_path / "run") == {"data_dir": "Doe_John", "out": "a.json", "n": 3,
                                                           "note": "not/a/path", "list": ["T2"]}


# --- patient-named inputs: no output names them unless the user keeps names ------------------------

PATIENT = "DOE^JOHN_1970-01-01"


def _patient_named_photo_site(root: Path) -> Path:
    """A fundus site whose photo and mask are named after a patient, with a datalist testing on it."""
    from testsupport import write_photo_site

    write_photo_site(root, [PATIENT], size=32)
    (root / "datalist.json").write_text(json.dumps({"task": "fundus", "training": [], "testing": [
        {"image": f"images/{PATIENT}.png", "label": f"masks/{PATIENT}.png"}]}))
    return root


def _leaks(text: str) -> bool:
    return any(part in text for part in ("DOE", "JOHN", "1970-01-01"))


def test_fedsm_infer_names_no_patient_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main
    from engine.io.privacy import content_name

    # Prepare: a photo named after a patient, in a folder and alone
    site = _patient_named_photo_site(tmp_path / "site")
    photo = site / "images" / f"{PATIENT}.png"
    model = hf.write_small_bundle(tmp_path / "models" / "fundus.safetensors", "fundus")
    case = content_name([photo])
    for given, out in ((photo, tmp_path / "one"), (site / "images", tmp_path / "folder")):
        # Execute
        assert main(["infer", "--model", str(model), "--input", str(given), "--out", str(out), "--device", "cpu",
                     "--name-map", str(tmp_path / f"{out.name}-names.json")]) == 0
        stdout = capsys.readouterr().out
        # Assert: output files, routing.json and every stdout line name the case, never the patient
        names = sorted(p.name for p in out.iterdir())
        assert names == [f"{case}_mask.png", "routing.json"]
        routing_text = (out / "routing.json").read_text()
        assert not _leaks(routing_text) and json.loads(routing_text)["inputs"][0]["case"] == case
        assert all(not _leaks(line) for line in stdout.splitlines()), stdout
        assert f"{case}: {case}_mask.png" in stdout
        # The opt-in map, written where the user asked, is the only place linking case and file
        assert json.loads((tmp_path / f"{out.name}-names.json").read_text()) == {case: f"{PATIENT}.png"}
    # --keep-names: the names as before
    assert main(["infer", "--model", str(model), "--input", str(photo), "--out", str(tmp_path / "kept"),
                 "--device", "cpu", "--keep-names"]) == 0
    stdout = capsys.readouterr().out
    assert (tmp_path / "kept" / f"{PATIENT}_mask.png").is_file()
    routing = json.loads((tmp_path / "kept" / "routing.json").read_text())
    assert routing["inputs"][0]["input"] == f"{PATIENT}.png" and routing["names"] == "kept"
    assert f"{PATIENT}.png: {PATIENT}_mask.png" in stdout


def test_fedsm_evaluate_names_no_patient_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main
    from engine.io.privacy import content_name

    site = _patient_named_photo_site(tmp_path / "site")
    model = hf.write_small_bundle(tmp_path / "models" / "fundus.safetensors", "fundus")
    report = tmp_path / "evaluation.json"
    assert main(["evaluate", "--model", str(model), "--datalist", str(site / "datalist.json"), "--device", "cpu",
                 "--json", str(report)]) == 0
    stdout = capsys.readouterr().out
    assert not _leaks(stdout) and not _leaks(report.read_text())
    case = content_name([site / "images" / f"{PATIENT}.png"])
    assert {row["case"] for row in json.loads(report.read_text())["images"]} == {case} and case in stdout
    assert main(["evaluate", "--model", str(model), "--datalist", str(site / "datalist.json"), "--device", "cpu",
                 "--json", str(report), "--keep-names"]) == 0
    assert f"{PATIENT}.png" in capsys.readouterr().out and PATIENT in report.read_text()
