"""One JSON file per finished benchmark job, so an interrupted run resumes where it stopped.

A job is named by ``(task, analysis, method, seed)``; its result lives in
``OUT/results/<task>/<analysis>/<method>-seed<seed>.json`` together with the settings that
produced it. A cached result counts only if those settings match the current ones, so changing a
preset never mixes old and new numbers silently. Files are written atomically: a job killed
half-way leaves no file and runs again next time.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.io.atomic import write_text_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobKey:
    """Identity of one benchmark job."""

    task: str
    analysis: str
    method: str
    seed: int

    @property
    def label(self) -> str:
        """Short human-readable name, e.g. ``fundus main fedsm seed 1``."""
        return f"{self.task} {self.analysis} {self.method} seed {self.seed}"

    def relpath(self) -> Path:
        """Path of the job's result file relative to the results folder."""
        return Path(self.task) / self.analysis / f"{self.method}-seed{self.seed}.json"


def _clean(obj: Any) -> Any:
    """JSON-ready copy: NaN/Inf -> None, tuples -> lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


class ResultCache:
    """Cached job results under ``root`` (normally ``OUT/results``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: JobKey) -> Path:
        """File that holds (or will hold) ``key``'s result."""
        return self.root / key.relpath()

    def load(self, key: JobKey, settings: dict[str, Any]) -> dict[str, Any] | None:
        """The cached result of ``key`` if it exists and was produced with ``settings``."""
        path = self.path(key)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable cached result %s (%s); the job runs again", path, exc)
            return None
        if doc.get("settings") != _clean(settings):
            log.info("cached result %s was made with other settings; the job runs again", path)
            return None
        return doc

    def save(self, key: JobKey, settings: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """Write ``result`` atomically and return the stored document."""
        doc = {"key": {"task": key.task, "analysis": key.analysis, "method": key.method, "seed": key.seed},
               "settings": _clean(settings), "result": _clean(result)}
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(doc, indent=1) + "\n")
        return doc

    def all(self) -> list[dict[str, Any]]:
        """Every readable cached document (any settings)."""
        docs = []
        for path in sorted(self.root.rglob("*.json")):
            try:
                docs.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
        return docs
