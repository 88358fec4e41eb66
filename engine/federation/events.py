"""Federation progress events as JSON lines: the one format the GUI, logs and tests read.

Every event is a JSON object on one line with at least ``event`` (its kind), ``time`` (Unix
seconds), ``source`` (``"site"`` or ``"server"``) and ``site`` (the site it is about, or
``null`` for server events about no site). Kinds and their keys:

=============== =====================================================================
``status``      ``message``
``connected``   ``coordinator``
``disconnected`` ``reason``, ``reconnecting`` (bool)
``received``    ``round``, ``rounds``, ``method``, ``bytes``, ``contents`` (part -> tensors)
``round_start`` ``round``, ``rounds``, ``method``
``batch``       ``round``, ``batch``, ``batches``, ``loss`` (name -> float), ``method``
``metrics``     ``round``, ``loss`` (name -> float), ``dice`` (global/personalized/local)
``sent``        ``round``, ``bytes``, ``contents`` (tensors per part, num_examples, metric names)
``round_end``   ``round``, ``rounds``, ``wall_s`` (server: ``answered``, ``left_out``, ``direction``,
                ``direction_size``, ``direction_judged``)
``error``       ``message``, optional ``round``
``checkpoint``  ``round``, ``path`` (server)
``finished``    ``rounds``
=============== =====================================================================

:class:`EventWriter` appends each event to ``events.jsonl`` (flushed per line, so a reader
tailing the file sees it at once) and, for ``fedsm site --json``, also writes it to stdout.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

EVENT_KINDS = ("status", "connected", "disconnected", "received", "round_start", "batch", "metrics", "sent",
               "round_end", "error", "checkpoint", "finished", "run_settings")
SOURCES = ("site", "server")


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN/Inf become ``None``, tuples become lists, paths become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, str | int | bool) or value is None:
        return value
    return str(value)


@dataclass
class PendingReport:
    """Events a site emits once its reply has left (``sent``, ``metrics``, ``round_end``)."""

    emit: Callable[[], None]


class EventWriter:
    """Write federation events as JSON lines to a file and optionally a stream.

    Parameters
    ----------
    source
        ``"site"`` or ``"server"``.
    site
        Default ``site`` of this writer's events (the site's own name; ``None`` on the server).
    path
        JSON-lines file the events are appended to (``None``: no file).
    stream
        Also write every event there (e.g. ``sys.stdout`` for ``--json``).
    listener
        Also call this with every event (for terminal output).
    """

    def __init__(self, source: str, site: str | None = None, path: Path | None = None,
                 stream: IO[str] | None = None, listener: Callable[[dict[str, Any]], None] | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        self.source = source
        self.site = site
        self.stream = stream
        self.listener = listener
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = Path(path).open("a", encoding="utf-8")

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event of ``kind``; ``site=`` overrides the writer's site. Returns the event."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        event: dict[str, Any] = {"event": kind, "time": round(time.time(), 3), "source": self.source,
                                 "site": fields.pop("site", self.site)}
        event.update(_clean(fields))
        line = json.dumps(event, allow_nan=False)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
            if self.stream is not None:
                self.stream.write(line + "\n")
                self.stream.flush()
        if self.listener is not None:
            self.listener(event)
        return event

    def status(self, message: str, **fields: Any) -> None:
        self.emit("status", message=message, **fields)

    def error(self, message: str, **fields: Any) -> None:
        self.emit("error", message=message, **fields)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events in a JSON-lines file (a torn last line, from a killed writer, is skipped)."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
