"""One JSON file per finished benchmark job, so an interrupted run resumes where it stopped.

A job is named by ``(task, analysis, method, seed)``; its result lives in
``OUT/results/<task>/<analysis>/<method>-seed<seed>.json`` together with the settings that
produced it. A cached result counts only if those settings match the current ones, so changing a
preset never mixes old and new numbers silently. Files are written atomically: a job killed
half-way leaves no file and runs again next time.

The settings include a **code version** (:func:`code_version`): a fingerprint of the source of
the engine modules that determine a job's numbers (:data:`RESULT_SOURCES`) and the versions of
torch, MONAI and numpy. Editing any of those modules, or upgrading those packages, makes every
cached result stale, so a rerun recomputes it instead of reusing numbers the current code would
not produce. The fingerprint hashes each module's syntax tree without docstrings, so comment,
docstring and formatting edits keep the cache. Modules that only read the cache and write the
report (``report``, ``tables``, ``plots``, ``runner``, ``cache``, ``presets`` whose values are
already in the settings) and the CLI, GUI and network transport are deliberately left out.

Every entry also records where and when it was made (``provenance``: machine description and
finish time), so the report can state which machines produced the numbers of each table.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.io.atomic import write_text_atomic

log = logging.getLogger(__name__)

#: Root of the ``engine`` package.
ENGINE_DIR = Path(__file__).resolve().parents[1]

#: Engine sources (package folders or files, relative to ``engine/``) whose code determines a
#: benchmark job's numbers: training and aggregation (``fl``), the networks (``models``),
#: synthetic data generation, loading and preprocessing (``data``, and the ``io`` modules that
#: write and read its PNG/NIfTI files), super-model assembly and routed inference (``bundle``,
#: ``inference``), the task definitions, the simulation and its in-process transport, and the
#: benchmark's own job, routing-sweep and performance code.
RESULT_SOURCES: tuple[str, ...] = (
    "fl", "models", "data", "bundle", "inference", "device.py", "tasks.py", "simulate.py", "federation/inprocess.py",
    "io/files.py", "io/readers.py", "io/masks.py", "io/photos.py", "io/volumes.py", "io/study.py",
    "io/label_conventions.py", "bench/jobs.py", "bench/bench_simulation.py", "bench/routing_analysis.py",
    "bench/perf.py",
)

#: Packages whose versions are part of the code version.
RESULT_PACKAGES: tuple[str, ...] = ("torch", "monai", "numpy")


def _normalised_source(text: str) -> str:
    """The module's syntax tree without docstrings (comments and layout never reach the tree)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def source_fingerprint(root: Path = ENGINE_DIR, sources: tuple[str, ...] = RESULT_SOURCES) -> str:
    """SHA-256 (hex, first 16 digits) over the normalised ``*.py`` sources under ``root``.

    ``sources`` are files or folders relative to ``root``; folders count recursively. A missing
    source counts as absent (and changes the fingerprint when it appears).
    """
    digest = hashlib.sha256()
    for entry in sources:
        path = root / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            rel = file.relative_to(root).as_posix()
            try:
                text = file.read_text(encoding="utf-8")
            except OSError:
                digest.update(f"{rel}\0<absent>\0".encode())
                continue
            digest.update(f"{rel}\0{_normalised_source(text)}\0".encode())
    return digest.hexdigest()[:16]


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """The code version recorded in every job's settings: source fingerprint and package versions.

    Computed once per process (the sources of a running benchmark do not change under it).
    """
    out: dict[str, Any] = {"fingerprint": source_fingerprint()}
    out |= {name: _package_version(name) for name in RESULT_PACKAGES}
    return out


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
        wanted = _clean(settings)
        stored = doc.get("settings")
        if stored != wanted:
            if isinstance(stored, dict) and stored.get("code") != wanted.get("code") \
                    and {k: v for k, v in stored.items() if k != "code"} == {k: v for k, v in wanted.items()
                                                                             if k != "code"}:
                log.info("cached result %s was made by other code or packages (%s, now %s); the job runs again",
                         path, stored.get("code"), wanted.get("code"))
            else:
                log.info("cached result %s was made with other settings; the job runs again", path)
            return None
        return doc

    def save(self, key: JobKey, settings: dict[str, Any], result: dict[str, Any],
             provenance: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``result`` atomically and return the stored document.

        ``provenance`` says where and when the job ran, normally ``{"machine": {...} (see
        :func:`engine.bench.runner.machine_info`), "finished": ISO time}``; it is stored beside
        the result and not compared when loading.
        """
        doc = {"key": {"task": key.task, "analysis": key.analysis, "method": key.method, "seed": key.seed},
               "settings": _clean(settings), "result": _clean(result)}
        if provenance is not None:
            doc["provenance"] = _clean(provenance)
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
