"""The operator's answer to a new run, asked by the SuperNode before it pulls any of the run's payload.

A ``fedsm site --confirm-runs`` site asks its operator to accept each new run's signed settings.
The question must come before the SuperNode downloads the run's first message, or declining would
only stop the training, not the download. The SuperNode (a child process, whose loop pulls
messages) and the site process (which talks to the operator) share one folder of the site's work
folder:

- the SuperNode's guard (:func:`engine.federation.flower.launch.guard_apps`), once a new run's
  settings passed the signature and bounds checks, writes ``<flower run>.settings.json`` (the
  verified settings) and waits for ``<flower run>.answer``; ``accept`` lets Flower pull the
  message, anything else is answered to the coordinator with an error that carries
  :data:`DECLINED`, from the message's header alone;
- the site process (:meth:`engine.federation.flower.site.TaskExecutor.answer_pending_runs`)
  finds the question, asks the operator once per run, and writes the answer.

Both files are written atomically. An answer stays for the run: every later message of a declined
run is refused at once, so the coordinator's evaluation never waits for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.io.atomic import write_bytes_atomic

#: Folder of the site's work folder holding the questions and answers.
FOLDER = "run-confirmations"
#: In a declined message's error reason: the coordinator treats the site as absent for the run.
DECLINED = "FEDSM-DECLINED"
ACCEPTED = "accept"


def _question(folder: Path, flower_run: int) -> Path:
    return folder / f"{int(flower_run)}.settings.json"


def _answer(folder: Path, flower_run: int) -> Path:
    return folder / f"{int(flower_run)}.answer"


def answer_of(folder: Path, flower_run: int) -> bool | None:
    """The operator's recorded answer for ``flower_run`` (``None``: not answered yet)."""
    try:
        return _answer(folder, flower_run).read_text().strip() == ACCEPTED
    except FileNotFoundError:
        return None


def ask(folder: Path, flower_run: int, settings: dict[str, Any], timeout: float,
        poll: float = 0.2, stopped: Callable[[], bool] = lambda: False) -> bool | None:
    """Ask for ``flower_run`` (the SuperNode's side) and wait up to ``timeout`` s for the answer.

    Returns the answer, or ``None`` when none came in time (the question stays; the next message of
    the run waits again).
    """
    known = answer_of(folder, flower_run)
    if known is not None:
        return known
    folder.mkdir(parents=True, exist_ok=True)
    question = _question(folder, flower_run)
    if not question.exists():
        write_bytes_atomic(question, json.dumps(settings, sort_keys=True).encode())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopped():
        known = answer_of(folder, flower_run)
        if known is not None:
            return known
        time.sleep(poll)
    return None


def pending(folder: Path) -> list[tuple[int, dict[str, Any]]]:
    """Questions without an answer yet (the site process's side), oldest run first."""
    out = []
    for question in sorted(folder.glob("*.settings.json")) if folder.is_dir() else []:
        run_text = question.name.removesuffix(".settings.json")
        if not run_text.isdigit():
            # not a question: e.g. a question being written (engine.io.atomic's temporary file keeps the
            # target's suffixes, ".7.settings.x1y2.tmp.settings.json"), which once crashed the site here
            continue
        run = int(run_text)
        if answer_of(folder, run) is None:
            try:
                out.append((run, json.loads(question.read_text())))
            except (OSError, ValueError):
                continue  # being written (atomic rename: not for long) or damaged: asked again next time
    return sorted(out)


def record(folder: Path, flower_run: int, accepted: bool) -> None:
    """Write the operator's answer for ``flower_run``."""
    folder.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(_answer(folder, flower_run), (ACCEPTED if accepted else "decline").encode())
