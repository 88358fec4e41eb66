"""State of the federation panel, driven by the site's JSON-line progress events (Qt-free).

A site process (``fedsm site --json`` or the demo site) prints one JSON object per line; every
object has ``event``, ``time``, ``source`` and ``site``. :meth:`FederationState.apply_event`
folds one event into the state and says which parts changed, so the panel only redraws those.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine import api
from fedsm_gui.models.signal import Signal

#: Connection states shown in the panel.
IDLE, STARTING, CONNECTED, RECONNECTING, DISCONNECTED, FINISHED, FAILED, STOPPED = (
    "idle", "starting", "connected", "reconnecting", "disconnected", "finished", "failed", "stopped")
#: Parts of the state an event can change.
STATUS, PROGRESS, METRICS, LEDGER, LOG = "status", "progress", "metrics", "ledger", "log"
#: A run's settings wait for the operator's Accept or Decline (``run_settings`` with ``confirm``).
CONFIRM = "confirm"
MAX_LOG_LINES = 5000


@dataclass
class SiteSetup:
    """The site operator's settings (what a ``site.toml`` holds)."""

    coordinator: str = ""
    ca_cert: str = ""
    site_key: str = ""
    site_name: str = ""
    task: str = "fundus"
    datalist: str = ""
    app_hash: str = ""
    #: FedIOD: the epsilon this site allows for a run's released gradients (``[privacy] epsilon``; empty: none)
    dp_epsilon: str = ""
    config_path: str = ""
    #: The operator confirmed BlackFed's threat model: split-learning runs may send activations of
    #: this site's images and their masks to the coordinator (``[site] share_activations``).
    share_activations: bool = False


@dataclass
class RoundMetrics:
    """What the site measured in one round: mean losses and validation Dice per model."""

    round: int
    loss: dict[str, float] = field(default_factory=dict)
    dice: dict[str, float] = field(default_factory=dict)


@dataclass
class LedgerEntry:
    """One payload that crossed the site's boundary."""

    round: int
    direction: str  # "sent" or "received"
    bytes: int
    contents: dict[str, Any]


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def describe_contents(direction: str, contents: dict[str, Any]) -> str:
    """Human summary of a ledger entry's contents, e.g. ``"global 84 tensors; 10 samples; metrics: loss"``."""
    def item(group: str, value: Any) -> str:
        # weight parts carry a tensor count; a dialogue method's tensors (BlackFed) say what they are
        return f"{group}: {value} tensors" if isinstance(value, int | float) else f"{group} ({value})"

    if direction == "received":
        groups = contents.get("tensors", contents) if isinstance(contents.get("tensors"), dict) else contents
        return "; ".join(item(group, n) for group, n in groups.items()) or "nothing"
    parts = [item(group, n) for group, n in dict(contents.get("tensors", {})).items()]
    if "num_examples" in contents:
        parts.append(f"sample count {contents['num_examples']}")
    metrics = list(contents.get("metrics", []))
    if metrics:
        parts.append("metrics: " + ", ".join(map(str, metrics)))
    return "; ".join(parts) or "nothing"


def describe_event(event: dict[str, Any]) -> str | None:
    """One log line for ``event`` (``None`` for events too frequent to log, like batches)."""
    kind = event.get("event")
    rnd = event.get("round")
    where = f"round {rnd}: " if rnd is not None else ""
    if kind == "batch":
        return None
    if kind == "status":
        return str(event.get("message", ""))
    if kind == "connected":
        return f"connected to {event.get('coordinator', 'the coordinator')}"
    if kind == "disconnected":
        tail = ", reconnecting" if event.get("reconnecting") else ""
        return f"disconnected ({event.get('reason', 'no reason given')}){tail}"
    if kind == "round_start":
        return f"round {rnd} of {event.get('rounds', '?')} started ({event.get('method', '')})"
    if kind in ("received", "sent"):
        verb = "received" if kind == "received" else "sent"
        what = describe_contents(kind, event.get("contents", {}))
        return f"{where}{verb} {format_bytes(event.get('bytes', 0))}: {what}"
    if kind == "metrics":
        dice = ", ".join(f"{k} {v:.3f}" for k, v in dict(event.get("dice", {})).items() if v is not None)
        loss = ", ".join(f"{k} {v:.3f}" for k, v in dict(event.get("loss", {})).items())
        return f"{where}loss {loss or '-'}; validation Dice {dice or '-'}"
    if kind == "round_end":
        return f"round {rnd} of {event.get('rounds', '?')} finished in {float(event.get('wall_s', 0)):.1f} s"
    if kind == "error":
        return f"{where}error: {event.get('message', '')}"
    if kind == "finished":
        return f"federation finished after {event.get('rounds', '?')} rounds"
    if kind == "run_settings":
        return api.format_run_settings(dict(event.get("settings", {})))
    return f"{kind}: {json.dumps({k: v for k, v in event.items() if k not in ('event', 'time')})}"


class FederationState:
    """Qt-free state of the federation panel.

    Signals
    -------
    changed(parts)
        ``parts`` is a set of :data:`STATUS`, :data:`PROGRESS`, :data:`METRICS`, :data:`LEDGER`,
        :data:`LOG`.
    """

    def __init__(self) -> None:
        self.setup = SiteSetup()
        self.changed = Signal()
        self.reset()

    def reset(self) -> None:
        """Forget everything about the previous run (a new Join)."""
        self.status = IDLE
        self.run_settings: dict[str, Any] = {}
        #: ``{"settings", "bounds"}`` of a run the site waits to have confirmed, else ``None``
        self.awaiting_confirmation: dict[str, Any] | None = None
        self.coordinator = ""
        self.site = ""
        self.method = ""
        self.round = 0
        self.rounds = 0
        self.batch = 0
        self.batches = 0
        self.error = ""
        self.metrics: dict[int, RoundMetrics] = {}
        self.ledger: list[LedgerEntry] = []
        self.log: deque[str] = deque(maxlen=MAX_LOG_LINES)
        self.log_total = 0  # lines ever logged, so a view can append only the new ones
        self.reconnects = 0
        self.run_complete = False  # the site has sent its answer of the last round
        #: the bundle the site wrote at the end of a BlackFed or FedIOD run (its path), else ""
        self.bundle = ""

    @property
    def running(self) -> bool:
        """Whether a site process is (or should be) alive."""
        return self.status in (STARTING, CONNECTED, RECONNECTING, DISCONNECTED)

    @property
    def progress_fraction(self) -> float:
        """Local progress in the current round, 0..1 (1 once the run has finished)."""
        if self.status == FINISHED:
            return 1.0
        return self.batch / self.batches if self.batches else 0.0

    @property
    def progress_line(self) -> str:
        """What the local progress bar says: the round's local batch while training, a final line once over.

        A round without local training (FedSM's last round only validates) or one whose first batch
        has not come yet says so instead of showing "batch 0 of 1".
        """
        rounds = f"{self.rounds} round{'' if self.rounds == 1 else 's'}"
        if self.status == FINISHED:
            return f"run finished: {rounds}"
        if self.status in (STOPPED, FAILED):
            return f"stopped in round {self.round} of {self.rounds}" if self.round else "stopped"
        if self.batches:
            return f"local batch {self.batch} of {self.batches}"
        if self.round:
            return f"round {self.round}: no local training batch yet"
        return ""

    def sent_total(self) -> int:
        """Bytes this site sent in this run."""
        return sum(e.bytes for e in self.ledger if e.direction == "sent")

    # --- lifecycle -----------------------------------------------------------------------
    def starting(self, command: list[str]) -> None:
        """Join pressed: the site process is being started with ``command``."""
        self.reset()
        self.status = STARTING
        self._log(f"starting: {' '.join(command)}")
        self.changed.emit({STATUS, PROGRESS, METRICS, LEDGER, LOG})

    def note(self, text: str) -> None:
        """Add an operator action to the log (e.g. Leave pressed)."""
        self._log(text)
        self.changed.emit({LOG})

    def process_ended(self, exit_code: int, stopped_by_user: bool) -> None:
        """The site process exited (on its own or because Leave was pressed)."""
        if stopped_by_user:
            self.status = STOPPED
            self._log("left the federation (site process stopped)")
        elif self.status == FINISHED:
            self._log(f"site process exited ({exit_code})")
        elif exit_code == 0:
            self.status = FINISHED if self.run_complete or (self.round and self.round >= self.rounds) else STOPPED
            self._log("site process exited")
        else:
            self.status = FAILED
            self.error = self.error or f"the site process exited with code {exit_code}; see the log"
            self._log(f"site process exited with code {exit_code}")
        self.changed.emit({STATUS, LOG})

    def apply_line(self, line: str) -> set[str]:
        """Fold one line of the process's output into the state (non-JSON lines are logged)."""
        text = line.strip()
        if not text:
            return set()
        try:
            event = json.loads(text)
        except ValueError:
            event = None
        if not isinstance(event, dict) or "event" not in event:
            self._log(text)
            parts = {LOG}
            self.changed.emit(parts)
            return parts
        return self.apply_event(event)

    def apply_event(self, event: dict[str, Any]) -> set[str]:
        """Fold one progress event into the state; return the parts that changed."""
        kind = event.get("event")
        parts: set[str] = set()
        self.site = str(event.get("site", self.site) or self.site)
        if kind == "connected":
            if self.status in (RECONNECTING, DISCONNECTED):
                self.reconnects += 1
            self.status, self.coordinator = CONNECTED, str(event.get("coordinator", ""))
            parts.add(STATUS)
        elif kind == "disconnected":
            if self.status != FINISHED and not self.run_complete:
                self.status = RECONNECTING if event.get("reconnecting") else DISCONNECTED
            else:  # the coordinator closes the connection once the last round is in: the run is over
                self.status = FINISHED
            parts.add(STATUS)
        elif kind in ("round_start", "received", "round_end") and "round" in event:
            self.round = int(event["round"])
            self.rounds = int(event.get("rounds", self.rounds) or self.rounds)
            self.method = str(event.get("method", self.method) or self.method)
            if kind == "round_start":
                self.batch, self.batches = 0, 0
            if kind == "round_end" and self.batches:
                self.batch = self.batches
            if kind == "round_end" and self.rounds and self.round >= self.rounds:
                self.run_complete = True
            parts |= {STATUS, PROGRESS}
            if kind == "received":
                self.ledger.append(LedgerEntry(self.round, "received", int(event.get("bytes", 0)),
                                               dict(event.get("contents", {}))))
                parts.add(LEDGER)
        elif kind == "batch":
            self.round = int(event.get("round", self.round))
            self.batch, self.batches = int(event.get("batch", 0)), int(event.get("batches", 0))
            parts.add(PROGRESS)
        elif kind == "metrics":
            rnd = int(event.get("round", self.round))
            self.metrics[rnd] = RoundMetrics(
                rnd, {str(k): float(v) for k, v in dict(event.get("loss", {})).items() if v is not None},
                {str(k): float(v) for k, v in dict(event.get("dice", {})).items() if v is not None})
            parts.add(METRICS)
        elif kind == "sent":
            self.ledger.append(LedgerEntry(int(event.get("round", self.round)), "sent", int(event.get("bytes", 0)),
                                           dict(event.get("contents", {}))))
            parts.add(LEDGER)
        elif kind == "error":
            self.error = str(event.get("message", "unknown error"))
            parts.add(STATUS)
        elif kind == "run_settings":  # what the coordinator signed and this site accepted: shown in the log
            self.run_settings = dict(event.get("settings", {}))
            self.method = str(self.run_settings.get("method", self.method) or self.method)
            parts.add(STATUS)
            if event.get("confirm"):  # the site trains for this run only once the operator accepts
                self.awaiting_confirmation = {"settings": self.run_settings,
                                              "bounds": dict(event.get("bounds", {}) or {})}
                parts.add(CONFIRM)
        elif kind == "status" and event.get("bundle"):  # a dialogue run's end: the site wrote its bundle
            self.bundle = str(event["bundle"])
            parts.add(STATUS)
        elif kind == "finished":
            self.status = FINISHED
            self.rounds = int(event.get("rounds", self.rounds) or self.rounds)
            self.round = self.rounds
            parts |= {STATUS, PROGRESS}
        line = describe_event(event)
        if line is not None:
            self._log(line, event.get("time"))
            parts.add(LOG)
        if parts:
            self.changed.emit(parts)
        return parts

    def _log(self, text: str, stamp: Any = None) -> None:
        if isinstance(stamp, int | float):
            clock = time.strftime("%H:%M:%S", time.localtime(float(stamp)))
        elif isinstance(stamp, str) and "T" in stamp:
            clock = stamp.split("T", 1)[1][:8]
        else:
            clock = time.strftime("%H:%M:%S")
        self.log.append(f"[{clock}] {text}")
        self.log_total += 1
