"""A coordinator whose own SuperLink stops answering ends with one line and a resume hint, not a traceback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx

from engine.errors import FedSMError
from engine.federation.flower.coordinator_grid import GIVE_UP_AFTER_S, PromptHttpGrid
from engine.federation.flower.server import lost_superlink


def test_the_grid_stops_retrying_once_the_superlink_process_died():
    grid = PromptHttpGrid("127.0.0.1:1", True, None, token="t")
    assert grid.give_up_after == GIVE_UP_AFTER_S
    alive = {"value": True}
    grid.superlink_alive = lambda: alive["value"]
    giveup = grid._retry_invoker.should_giveup
    timeout = httpx.WriteTimeout("timed out")
    assert giveup(timeout) is False  # alive but slow: keep trying (Flower's own rule: timeouts are retried)
    alive["value"] = False
    assert giveup(timeout) is True
    grid.give_up_after = 12
    assert grid._retry_invoker.max_time == 12.0


def test_lost_superlink_names_the_cause_and_how_to_resume(tmp_path):
    cfg = SimpleNamespace(work_dir=Path(tmp_path))
    slow = lost_superlink(httpx.WriteTimeout("timed out"), SimpleNamespace(running=lambda: True), cfg, 300)
    assert isinstance(slow, FedSMError)
    text = str(slow)
    assert "did not answer for 300 s (WriteTimeout)" in text and "overloaded" in text
    assert "--resume" in text and "checkpoint.safetensors" in text and "\n" not in text
    dead = str(lost_superlink(httpx.ConnectError("refused"), SimpleNamespace(running=lambda: False), cfg, 300))
    assert "SuperLink process ended" in dead and "superlink.log" in dead
