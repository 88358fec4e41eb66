"""The warm starter (tests/federation/warm_start.py) starts a process as a fresh interpreter would.

In a ``test_loopback_*`` file so that it runs on the federations' worker, whose starter is already up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, Processes, fedsm
from warm_start import WarmProcess, cold_start_forced

SCRIPT = """
import os, sys
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("env", os.environ.get("WARM_START_PROBE"))
print("path0", sys.path[0])
print("stdin", sys.stdin.read().strip())
print("main", __name__)
sys.stdout.flush()
if sys.argv[1] == "wait":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def procs():
    if cold_start_forced():
        pytest.skip("FEDSM_TESTS_COLD_START is set: no warm starter")
    started = Processes()
    yield started
    started.stop_all()


def test_a_warm_script_gets_the_tests_argv_folder_environment_stdin_and_exit_status(procs, tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("WARM_START_PROBE", "seen")
    proc = procs.start([sys.executable, str(script), "run", "3"], tmp_path / "probe.out", stdin=b"decline\n")
    assert isinstance(proc, WarmProcess)  # not silently started cold
    assert proc.wait(timeout=60) == 3
    out = (tmp_path / "probe.out").read_text().splitlines()
    assert out == ["argv ['run', '3']", f"cwd {ROOT}", "env seen", f"path0 {tmp_path}", "stdin decline",
                   "main __main__"]


def test_a_warm_module_runs_as_main_and_a_killed_one_reports_the_signal(procs, tmp_path):
    proc = procs.start(fedsm("--help"), tmp_path / "help.out")
    assert isinstance(proc, WarmProcess) and proc.wait(timeout=60) == 0
    assert "usage: fedsm" in (tmp_path / "help.out").read_text()

    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    waiting = procs.start([sys.executable, str(script), "wait", "0"], tmp_path / "wait.out")
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.5)
    assert waiting.poll() is None
    os.kill(waiting.pid, signal.SIGKILL)
    assert waiting.wait(timeout=30) == -signal.SIGKILL  # as Popen.returncode says it
    terminated = procs.start([sys.executable, str(script), "wait", "0"], tmp_path / "terminated.out")
    terminated.terminate()  # Popen's methods too (test_loopback_faults.py stops its impostor so)
    assert terminated.wait(timeout=30) == -signal.SIGTERM


def test_an_error_in_a_warm_process_is_its_traceback_and_status_1(procs, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('broken on purpose')\n")
    proc = procs.start([sys.executable, str(script)], tmp_path / "broken.out")
    assert proc.wait(timeout=60) == 1
    text = Path(tmp_path / "broken.out").read_text()
    assert "Traceback" in text and "RuntimeError: broken on purpose" in text
