"""Recently opened studies, kept in a small JSON file (Qt-free)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


class RecentFiles:
    """Most recent first, no duplicates, at most ``limit`` entries, saved after every change.

    Parameters
    ----------
    store
        JSON file to keep the list in (``None``: in memory only). A missing or unreadable file
        starts an empty list; it is never an error to lose this list.
    """

    def __init__(self, store: Path | None, limit: int = 10) -> None:
        self.store = store
        self.limit = limit
        self.paths: list[str] = []
        if store is not None:
            try:
                items = json.loads(store.read_text(encoding="utf-8"))
                self.paths = [str(p) for p in items if isinstance(p, str)][:limit]
            except (OSError, ValueError, TypeError):
                self.paths = []

    def add(self, path: str | os.PathLike[str]) -> None:
        """Put ``path`` first."""
        text = str(Path(path).absolute())
        self.paths = [text, *[p for p in self.paths if p != text]][: self.limit]
        self._save()

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Drop ``path`` (e.g. it no longer exists)."""
        text = str(Path(path).absolute())
        if text in self.paths:
            self.paths.remove(text)
            self._save()

    def _save(self) -> None:
        if self.store is None:
            return
        try:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".recent.", dir=self.store.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(self.paths, fh, indent=1)
            os.replace(tmp, self.store)
        except OSError as exc:
            log.warning("cannot save the recent files list to %s: %s", self.store, exc)
