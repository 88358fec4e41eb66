"""Coordinator checkpoints (after every completed round) and a site's private state.

A checkpoint is one ``.safetensors`` file: every tensor of the server state, named
``<part>::<key>`` (e.g. ``personal/site2::model.0.conv.weight``), and JSON metadata under the
key ``fedsm_checkpoint`` (format, completed round, the method spec, the run's session id, the
app hash, per-round history). It is written to a temporary file and renamed, so a crash
leaves either the previous checkpoint or the new one, never half of one. Reading never
unpickles anything.

``fedsm server --resume`` continues from the round after the checkpoint's, with the same
session id. Sites keep their own private state (Scaffold's control variate, a local model)
under that session, one file per round (:func:`save_site_state`), and start every round from
the state before it (:func:`load_site_state_before`), so a round repeated after a resume
computes exactly what it computed the first time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.io.atomic import atomic_path

if TYPE_CHECKING:
    import torch

CHECKPOINT_FORMAT = "fedsm-federation-checkpoint"
CHECKPOINT_VERSION = 1
SITE_STATE_FORMAT = "fedsm-site-state"
_META_KEY = "fedsm_checkpoint"
_SEP = "::"

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


def save_weightset(path: Path, parts: WeightSet, metadata: dict[str, Any]) -> Path:
    """Write ``parts`` and JSON ``metadata`` to ``path`` atomically (safetensors)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(_flatten(parts), str(tmp), metadata={_META_KEY: json.dumps(metadata, sort_keys=True)})
    return Path(path)


def load_weightset(path: Path, expected_format: str) -> tuple[WeightSet, dict[str, Any]]:
    """Read a file written by :func:`save_weightset`; check its ``format``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            raw_meta = (fh.metadata() or {}).get(_META_KEY)
        flat = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable checkpoint ({exc}); delete it to start over") from None
    try:
        metadata = json.loads(raw_meta) if raw_meta else None
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict) or metadata.get("format") != expected_format:
        raise ConfigError(f"{path} is not a {expected_format} file")
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

    def save(self, path: Path) -> Path:
        meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "round": self.round,
                "spec": self.spec_json, "session": self.session, "app_hash": self.app_hash,
                "history": self.history}
        return save_weightset(path, self.state, meta)

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
    import torch

    from engine.bundle import check_site_name

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
    from engine.bundle import check_site_name

    check_site_name(session)
    earlier = {r: p for r, p in _site_state_files(folder, session).items() if r < rnd}
    if not earlier:
        return {}
    parts, meta = load_weightset(earlier[max(earlier)], SITE_STATE_FORMAT)
    if meta.get("session") != session:
        return {}
    return dict(parts)
