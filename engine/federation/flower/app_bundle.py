"""The FedSM Flower app bundle (FAB) and its hash: the identity a site approves.

Flower runs an app in a federation by shipping a FAB (a zip with ``pyproject.toml`` and the
app's code) from the coordinator to every site. FedSM ships no code: its ServerApp and
ClientApp are the installed engine. The FAB it sends holds ``pyproject.toml`` (app name,
engine version, the ServerApp and ClientApp it names) and ``fedsm_app/manifest.json``, the
SHA-256 of every engine source file that decides what a site computes and sends (federated
methods, models, data loading, the federation code). Its hash therefore changes whenever
any of that code does, and two installations with the same engine build the same bytes
(Flower writes FABs with fixed timestamps and sorted entries).

A site pins the hashes it accepts in ``site.toml`` (:mod:`engine.security.approval`);
``fedsm certs app-hash`` prints the hash of the app this installation builds.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import engine
from engine.security.approval import app_hash

APP_NAME = "fedsm-federation"
PUBLISHER = "fedsm"
#: Engine folders and files whose code the manifest covers (relative to the engine package).
COVERED = ("__init__.py", "tasks.py", "fl", "models", "data", "federation", "security")


@dataclass(frozen=True)
class AppBundle:
    """A built FAB: its bytes and its hash (``sha256:<hex>``)."""

    content: bytes
    hash: str
    manifest: dict[str, object]


def engine_code_digest() -> dict[str, str]:
    """SHA-256 of every covered engine source file, by path relative to the engine package."""
    root = Path(engine.__file__).resolve().parent
    files: list[Path] = []
    for entry in COVERED:
        path = root / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files if "__pycache__" not in p.parts}


def _pyproject() -> bytes:
    return f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "{engine.__version__}"
description = "FedSM federated super-model training; code runs from the installed engine"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "{PUBLISHER}"

[tool.flwr.app.components]
serverapp = "engine.federation.flower.server_app:app"
clientapp = "engine.federation.flower.client_app:app"

[tool.flwr.app.config]
fedsm_run_spec = ""
""".encode()


@functools.lru_cache(maxsize=1)
def build_app_bundle() -> AppBundle:
    """Build the FAB of this installation (cached for the process)."""
    from flwr.cli.build import build_fab_from_files

    manifest: dict[str, object] = {"app": APP_NAME, "engine_version": engine.__version__, "protocol": 1,
                                   "code": engine_code_digest()}
    files = {"pyproject.toml": _pyproject(),
             "fedsm_app/manifest.json": json.dumps(manifest, indent=1, sort_keys=True).encode()}
    content, _ = build_fab_from_files(files)
    return AppBundle(content, app_hash(content), manifest)
