"""Terminal progress for long commands: one live status line on a TTY, round lines otherwise."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any


class TerminalProgress:
    """Consume progress events; show them on ``stream`` and append them to a JSON-lines file.

    Parameters
    ----------
    events_path
        File that receives every event as one JSON object per line (the format the GUI and
        tests read), or ``None``.
    """

    def __init__(self, events_path: Path | None = None, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.events: IO[str] | None = None
        if events_path is not None:
            events_path.parent.mkdir(parents=True, exist_ok=True)
            self.events = events_path.open("a", encoding="utf-8")
        self._last_draw = 0.0
        self._line_len = 0

    def __call__(self, event: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.write(json.dumps({"time": round(time.time(), 3), **event}, default=str) + "\n")
            if event.get("event") != "batch":
                self.events.flush()
        kind = event.get("event")
        if kind == "batch":
            if self.live and time.monotonic() - self._last_draw > 0.1:
                self._draw(f"{event['method']}  round {event['round']}  {event['site']}  "
                           f"batch {event['batch']}/{event['batches']}  "
                           + " ".join(f"{k} {v:.3f}" for k, v in event.get("loss", {}).items()))
        elif kind == "round_end":
            self._print(f"{event['method']}: round {event['round']}/{event['rounds']} done in "
                        f"{event['wall_s']:.1f} s ({len(event['answered'])} sites answered)")
        elif kind == "method_end":
            avg = event["client_average"].get("mean")
            self._print(f"{event['method']}: finished in {event['wall_s']:.1f} s, client-average Dice {avg:.4f}")
        elif kind in ("status", "method_start"):
            self._print(event.get("message") or f"{event['method']}: starting")
        elif kind == "error":
            # a clipped update stays in the round (scaled down); any other error leaves the site out
            outcome = "clipped" if event.get("clipped") else "left out"
            self._print(f"{event.get('method', '')}: round {event.get('round')}: site {event.get('site')} "
                        f"{outcome}: {event.get('message')}")

    def _draw(self, text: str) -> None:
        self._last_draw = time.monotonic()
        pad = max(self._line_len - len(text), 0)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._line_len = len(text)

    def _print(self, text: str) -> None:
        if self.live and self._line_len:
            self.stream.write("\r" + " " * self._line_len + "\r")
            self._line_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live and self._line_len:
            self.stream.write("\n")
        if self.events is not None:
            self.events.close()
