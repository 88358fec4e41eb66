"""Coordinator checkpoints (after every completed round) and a site's private state.

A checkpoint is one ``.safetensors`` file: every tensor of the server state, named
``<part>::<key>`` (e.g. ``personal/site2::model.0.conv.weight``), and JSON metadata under the
key ``fedsm_checkpoint`` (format, completed round, the method spec, the run's session id, the
app hash, per-round history). It is written to a temporary file and renamed, so a crash
leaves either the previous checkpoint or the new one, never half of one. Reading never
unpickles anything.

Every file carries the SHA-256 of its tensors (names, dtypes, shapes and bytes) in its
metadata (``content_sha256``), checked when it is read: a flipped byte anywhere in a tensor
is found, even when the file's header is intact. The coordinator keeps its newest
``keep`` (default 3) checkpoints: ``checkpoint.safetensors`` is the newest, and
``checkpoint.round-<r>.safetensors`` each round's (the newest shares its disk blocks with
``checkpoint.safetensors``, a hard link). :func:`load_latest_valid` returns the newest one
that reads and verifies, and says what was wrong with any newer one.

``fedsm server --resume`` continues from the round after the checkpoint's, with the same
session id. Sites keep their own private state (Scaffold's control variate, a local model)
under that session, one file per round (:func:`save_site_state`), and start every round from
the state before it (:func:`load_site_state_before`), so a round repeated after a resume
computes exactly what it computed the first time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from engine.bundle import check_site_name
from engine.errors import ConfigError
from engine.io.atomic import atomic_path

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "fedsm-federation-checkpoint"
CHECKPOINT_VERSION = 1
SITE_STATE_FORMAT = "fedsm-site-state"
_META_KEY = "fedsm_checkpoint"
_HASH_KEY = "content_sha256"
_SEP = "::"
#: How many checkpoints the coordinator keeps by default (the newest and the ones before it).
KEEP_CHECKPOINTS = 3

WeightSet = dict[str, dict[str, "torch.Tensor"]]


def _flatten(parts: WeightSet) -> dict[str, torch.Tensor]:
    flat = {}
    for part, weights in parts.items():
        if _SEP in part:
            raise ValueError(f"part name {part!r} contains {_SEP!r}")
        for key, tensor in weights.items():
            # parts may share tensors (every personalized model starts as the same initial
            # one); safetensors refuses shared storage, so each entry gets its own copy
            flat[f"{part}{_SEP}{key}"] = tensor.detach().to("cpu").contiguous().clone()
    return flat


def _unflatten(flat: dict[str, torch.Tensor], path: Path) -> WeightSet:
    parts: WeightSet = {}
    for name, tensor in flat.items():
        part, sep, key = name.partition(_SEP)
        if not sep:
            raise ConfigError(f"{path}: tensor {name!r} has no part prefix; the file is not a FedSM checkpoint")
        parts.setdefault(part, {})[key] = tensor
    return parts


def content_hash(flat: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of named tensors: every name, dtype, shape and byte, in name order."""
    digest = hashlib.sha256()
    for name in sorted(flat):
        tensor = flat[name].detach().to("cpu").contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        if tensor.numel():
            digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def save_weightset(path: Path, parts: WeightSet, metadata: dict[str, Any]) -> Path:
    """Write ``parts`` and JSON ``metadata`` to ``path`` atomically (safetensors).

    The metadata also gets the tensors' :func:`content_hash`, which :func:`load_weightset`
    checks.
    """
    flat = _flatten(parts)
    meta = {**metadata, _HASH_KEY: content_hash(flat)}
    with atomic_path(path) as tmp:
        safetensors.torch.save_file(flat, str(tmp), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
    return Path(path)


def load_weightset(path: Path, expected_format: str) -> tuple[WeightSet, dict[str, Any]]:
    """Read a file written by :func:`save_weightset`; check its ``format``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist")
    try:
        with safetensors.torch.safe_open(str(path), framework="pt") as fh:
            raw_meta = (fh.metadata() or {}).get(_META_KEY)
        flat = safetensors.torch.load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable checkpoint ({exc}); delete it to start over") from None
    try:
        metadata = json.loads(raw_meta) if raw_meta else None
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict) or metadata.get("format") != expected_format:
        raise ConfigError(f"{path} is not a {expected_format} file")
    expected = metadata.get(_HASH_KEY)
    if expected is not None and content_hash(flat) != expected:
        raise ConfigError(f"{path} is corrupt: its tensors do not match the content hash written with them "
                          "(a changed or damaged byte); use an earlier checkpoint")
    return _unflatten(flat, path), metadata


@dataclass
class Checkpoint:
    """Server state after a completed round, and what is needed to continue from it."""

    round: int
    state: WeightSet
    spec_json: str
    session: str
    app_hash: str
    history: list[dict[str, Any]] = field(default_factory=list)

    def save(self, path: Path, keep: int | None = None) -> Path:
        """Write the checkpoint to ``path``.

        With ``keep``, it is written as ``<stem>.round-<r>.safetensors`` beside ``path``,
        ``path`` then names the same file (a hard link; a copy where links are impossible),
        and only the newest ``keep`` round files are kept.
        """
        meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "round": self.round,
                "spec": self.spec_json, "session": self.session, "app_hash": self.app_hash,
                "history": self.history}
        if keep is None:
            return save_weightset(path, self.state, meta)
        path = Path(path)
        numbered = save_weightset(round_path(path, self.round), self.state, meta)
        with atomic_path(path) as tmp:
            tmp.unlink()
            try:
                os.link(numbered, tmp)
            except OSError:
                shutil.copyfile(numbered, tmp)
        for _rnd, old in sorted(round_files(path).items())[:-max(keep, 1)]:
            old.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        state, meta = load_weightset(path, CHECKPOINT_FORMAT)
        if int(meta.get("version", 0)) > CHECKPOINT_VERSION:
            raise ConfigError(f"{path} was written by a newer FedSM (checkpoint version {meta['version']}); "
                              "update this installation to resume it")
        try:
            return cls(int(meta["round"]), state, str(meta["spec"]), str(meta["session"]), str(meta["app_hash"]),
                       list(meta.get("history", [])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: incomplete checkpoint metadata ({exc})") from None


def round_path(path: Path, rnd: int) -> Path:
    """Where :meth:`Checkpoint.save` keeps round ``rnd``'s checkpoint beside ``path``."""
    path = Path(path)
    return path.with_name(f"{path.name.removesuffix('.safetensors')}.round-{rnd}.safetensors")


def round_files(path: Path) -> dict[int, Path]:
    """The kept round checkpoints beside ``path``, by round."""
    path = Path(path)
    prefix = f"{path.name.removesuffix('.safetensors')}.round-"
    out = {}
    for found in path.parent.glob(f"{prefix}*.safetensors"):
        number = found.name[len(prefix):-len(".safetensors")]
        if number.isdigit():
            out[int(number)] = found
    return out


def load_latest_valid(path: Path) -> tuple[Checkpoint, list[str]]:
    """The newest checkpoint that reads and verifies: ``path`` first, then the kept rounds, newest first.

    Returns the checkpoint and one message per newer file that was skipped (what is wrong with
    it). :class:`ConfigError` if none is usable.
    """
    path = Path(path)
    candidates = ([path] if path.exists() else []) + [p for _r, p in sorted(round_files(path).items(), reverse=True)]
    problems: list[str] = []
    tried: list[Path] = []
    for candidate in candidates:
        if any(_same_file(candidate, seen) for seen in tried):
            continue  # the newest round file is the same file as ``path``
        tried.append(candidate)
        try:
            return Checkpoint.load(candidate), problems
        except ConfigError as exc:
            log.warning("skipping checkpoint %s: %s", candidate, exc)
            problems.append(str(exc))
    if not candidates:
        raise ConfigError(f"no checkpoint at {path}")
    raise ConfigError("no usable checkpoint: " + "; ".join(problems))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _site_state_files(folder: Path, session: str) -> dict[int, Path]:
    out = {}
    for path in (Path(folder) / session).glob("after-round-*.safetensors"):
        number = path.name[len("after-round-"):-len(".safetensors")]
        if number.isdigit():
            out[int(number)] = path
    return out


def save_site_state(folder: Path, session: str, rnd: int, state: dict[str, Any], keep: int = 3) -> Path | None:
    """Persist a site's private tensors (Scaffold's ``c_k``, a local model) after round ``rnd``.

    Kept per round (the newest ``keep``), because a coordinator that resumes from an older
    checkpoint repeats rounds, and a repeated round must start from the state before it. Only
    entries that are weight dicts are kept; returns ``None`` if there is nothing to keep.
    """
    check_site_name(session)
    parts = {k: v for k, v in state.items()
             if isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values())}
    if not parts:
        return None
    path = Path(folder) / session / f"after-round-{rnd}.safetensors"
    save_weightset(path, parts, {"format": SITE_STATE_FORMAT, "session": session, "round": rnd})
    for _old_round, old in sorted(_site_state_files(folder, session).items())[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_site_state_before(folder: Path, session: str, rnd: int) -> dict[str, Any]:
    """A site's private state as it was before round ``rnd`` of ``session`` (empty if none)."""
    check_site_name(session)
    earlier = {r: p for r, p in _site_state_files(folder, session).items() if r < rnd}
    if not earlier:
        return {}
    parts, meta = load_weightset(earlier[max(earlier)], SITE_STATE_FORMAT)
    if meta.get("session") != session:
        return {}
    return dict(parts)
