"""Every fedsm subcommand given wrong paths ends with one ``error:`` line and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest
from testsupport import fedavg_network_bundle

from engine.cli.main import build_parser, main


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set()
    for name, sub in action.choices.items():
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        names |= {f"{name} {n}" for n in nested[0].choices} if nested else {name}
    return names


def wrong_inputs(tmp: Path, bundle: Path) -> dict[str, list[list[str]]]:
    """Per subcommand, argument lists with a missing file, a file where a folder belongs, or the wrong task."""
    file = tmp / "file.txt"  # a file, used where a folder must be created
    nope = tmp / "nope"
    volume = tmp / "volume.nii.gz"
    return {
        "synth": [["--task", "fundus", "--out", str(file / "x")]],
        "simulate": [["--task", "fundus", "--data", str(nope), "--out", str(tmp / "o")],
                     ["--task", "fundus", "--data", str(tmp / "empty"), "--out", str(tmp / "o")]],
        "infer": [["--model", str(nope / "m.safetensors"), "--input", str(tmp / "photo.png"), "--out", str(tmp / "o")],
                  ["--model", str(file), "--input", str(tmp / "photo.png"), "--out", str(tmp / "o")],
                  ["--model", str(bundle), "--input", str(nope), "--out", str(tmp / "o")],
                  ["--model", str(bundle), "--input", str(tmp / "photo.png"), "--out", str(file / "o")],
                  ["--model", str(bundle), "--input", str(volume), "--out", str(tmp / "o")]],
        "validate-data": [[str(nope / "datalist.json")]],
        "datalist": [["--images", str(nope), "--masks", str(nope), "--out", str(tmp / "d.json")],
                     ["--images", str(tmp), "--masks", str(tmp), "--out", str(file / "d.json")]],
        "evaluate": [["--model", str(nope), "--datalist", str(tmp / "d.json")],
                     ["--model", str(bundle), "--datalist", str(nope / "d.json")]],
        "server": [["--config", str(nope / "federation.toml")]],
        "site": [["--config", str(nope / "site.toml")]],
        "enroll": [["--config", str(nope / "federation.toml"), "--list"]],
        "certs ca": [["--out", str(file / "ca")]],
        "certs server": [["--ca", str(nope), "--out", str(tmp / "s")]],
        "certs site": [["--name", "a", "--out", str(file / "s")]],
        "certs app-hash": [],  # takes no path
        "bench": [["--preset", "tiny", "--out", str(file / "b")]],
    }


def test_every_subcommand_gives_one_error_line_for_wrong_paths(tmp_path, capsys, monkeypatch):
    import nibabel as nib
    import numpy as np
    from PIL import Image

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # server/site install handlers
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    Image.new("RGB", (20, 20)).save(tmp_path / "photo.png")
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 4), np.float32), np.eye(4)), tmp_path / "volume.nii.gz")
    bundle = fedavg_network_bundle(tmp_path / "coord")
    cases = wrong_inputs(tmp_path, bundle)
    assert set(cases) == subcommands(), "add the new subcommand to this walk"
    for command, argvs in cases.items():
        for argv in argvs:
            code = main([*command.split(), *argv])
            out, err = capsys.readouterr()
            lines = [line for line in err.splitlines() if line.strip()]
            if command == "validate-data":  # the report goes to stdout, exit 1 = problems found
                assert code == 1 and "datalist not found" in out and not lines, (command, argv, out, err)
                continue
            assert code == 2, (command, argv, code, err)
            assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (command, argv, err)
    assert "is a volume, but" in main_error(capsys, ["infer", "--model", str(bundle), "--input",
                                                     str(tmp_path / "volume.nii.gz"), "--out", str(tmp_path / "o")])


def main_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [["infer", "--model"], ["evaluate", "--datalist", "x"]])
def test_missing_arguments_are_argparse_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err
