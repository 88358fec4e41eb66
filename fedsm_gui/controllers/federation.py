"""The federation panel: site setup, data check, Join/Leave of the site process, live status."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fedsm_gui.controllers.errors import user_message
from fedsm_gui.controllers.runners import ProcessRunner, TaskRunner
from fedsm_gui.models.federation import (
    LEDGER,
    LOG,
    METRICS,
    PROGRESS,
    STATUS,
    FederationState,
    SiteSetup,
)

log = logging.getLogger(__name__)

#: ``read_site_config`` keys for each form field (``SiteConfig.to_dict()``), first match wins.
_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "coordinator": ("coordinator",),
    "ca_cert": ("ca_cert",),
    "site_key": ("private_key", "site_key"),
    "site_name": ("name", "site_name"),
    "datalist": ("datalist",),
    "app_hash": ("approved_apps", "app_hash"),
}
#: Status words for the panel.
_STATUS_TEXT = {
    "idle": "Not joined", "starting": "Starting the site …", "connected": "Connected",
    "reconnecting": "Connection lost — reconnecting …", "disconnected": "Disconnected",
    "finished": "Federation finished", "failed": "Site stopped with an error", "stopped": "Left the federation",
}


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value)


def setup_from_config(config: dict[str, Any], path: str) -> SiteSetup:
    """Form fields from a site configuration as :func:`engine.api.read_site_config` returns it."""
    values = {f: next((_text(config[k]) for k in keys if k in config), "") for f, keys in _CONFIG_KEYS.items()}
    return SiteSetup(config_path=path, **values)


def check_rows(report: dict[str, Any]) -> tuple[list[dict[str, str]], str]:
    """Per-file rows and a summary line from a ``validate_data`` report."""
    rows: list[dict[str, str]] = []
    items = next((report[k] for k in ("files", "results", "entries", "items") if isinstance(report.get(k), list)), [])
    for item in items:
        if not isinstance(item, dict):
            continue
        problems = item.get("problems") or item.get("errors") or item.get("issues") or []
        message = item.get("message") or "; ".join(map(str, problems if isinstance(problems, list) else [problems]))
        ok = item.get("ok")
        status = item.get("status") or ("ok" if ok or (ok is None and not message) else "problem")
        name = item.get("file") or item.get("image") or item.get("path") or "?"
        if item.get("label"):
            name = f"{name} + {Path(str(item['label'])).name}"
        rows.append({"file": str(name), "status": str(status), "message": str(message)})
    summary = report.get("summary")
    if not isinstance(summary, str):
        bad = sum(1 for r in rows if r["status"] not in ("ok", "OK", "pass"))
        verdict = report.get("ok")
        state = "ready to join" if (verdict is True or (verdict is None and bad == 0)) else "fix the files marked"
        summary = f"{len(rows)} file(s) checked, {bad} with problems: {state}"
    return rows, summary


class FederationController:
    """Drives one site process and shows its events.

    Join starts ``engine.api.site_command(config)`` when a site configuration is set, else the
    simulated demo site (``engine.api.demo_site_command``) in ``demo_workdir``.
    """

    def __init__(self, state: FederationState, view: Any, tasks: TaskRunner, process: ProcessRunner,
                 api: ModuleType | Any, demo_workdir: Path | None = None, demo_rounds: int = 3) -> None:
        self.state = state
        self.view = view
        self.tasks = tasks
        self.process = process
        self.api = api
        self.demo_workdir = demo_workdir
        self.demo_rounds = demo_rounds
        self._log_pushed = 0
        state.changed.connect(self._on_changed)
        view.setup_edited.connect(self.edit_setup)
        view.load_config_requested.connect(self.load_config)
        view.check_data_requested.connect(self.check_data)
        view.join_requested.connect(self.join)
        view.leave_requested.connect(self.leave)
        self._push_setup()
        self._on_changed({STATUS, PROGRESS, METRICS, LEDGER, LOG})

    @property
    def demo(self) -> bool:
        """Whether Join starts the simulated demo site (no site configuration set)."""
        return not self.state.setup.config_path

    # --- setup ---------------------------------------------------------------------------
    def _push_setup(self) -> None:
        self.view.set_setup(self.state.setup, self.demo)

    def edit_setup(self, field: str, value: str) -> None:
        """One form field changed."""
        if not hasattr(self.state.setup, field):
            raise ValueError(f"unknown site setup field {field!r}")
        setattr(self.state.setup, field, value)
        if field == "config_path":
            self._push_setup()

    def load_config(self, path: str) -> None:
        """Fill the form from a ``site.toml``."""
        def done(config: dict[str, Any]) -> None:
            self.state.setup = setup_from_config(config, str(path))
            self._push_setup()
            self.state.changed.emit({STATUS})

        self.tasks.submit(lambda progress, cancel: self.api.read_site_config(Path(path)), on_done=done,
                          on_error=lambda exc: self.view.set_check_results(
                              [], f"Cannot read {path}: {user_message(exc)}"))

    def check_data(self) -> None:
        """Run the data check on the datalist (``fedsm validate-data``) and show the result per file."""
        datalist = self.state.setup.datalist.strip()
        if not datalist:
            self.view.set_check_results([], "Choose the site's datalist (JSON) first.")
            return
        self.view.set_check_results([], f"Checking {datalist} …")

        def done(report: dict[str, Any]) -> None:
            rows, summary = check_rows(report)
            self.view.set_check_results(rows, summary)

        self.tasks.submit(lambda progress, cancel: self.api.validate_data([Path(datalist)]), on_done=done,
                          on_error=lambda exc: self.view.set_check_results([], f"Check failed: {user_message(exc)}"))

    # --- join / leave --------------------------------------------------------------------
    def command(self) -> list[str]:
        """The site process's command line."""
        if not self.demo:
            return list(self.api.site_command(Path(self.state.setup.config_path), json_events=True))
        workdir = self.demo_workdir or Path.home() / ".cache" / "fedsm" / "demo-site"
        site = self.state.setup.site_name or "site1"
        return list(self.api.demo_site_command(workdir, site=site, rounds=self.demo_rounds))

    def join(self, on_exit: Callable[[int], None] | None = None) -> None:
        """Start the site process (no-op while one runs)."""
        if self.process.running:
            return
        try:
            argv = self.command()
        except Exception as exc:  # any failure to build the command is shown, not raised
            self.state.error = user_message(exc)
            self.state.changed.emit({STATUS})
            return
        self._log_pushed = 0
        self.state.starting(argv)

        def exited(code: int, stopped: bool) -> None:
            self.state.process_ended(code, stopped)
            if on_exit is not None:
                on_exit(code)

        self.process.start(argv, on_line=self.state.apply_line, on_exit=exited)

    def leave(self) -> None:
        """Stop the site process: terminate, then kill when it does not exit in time."""
        if self.process.running:
            self.process.stop()

    # --- state -> view -------------------------------------------------------------------
    def _on_changed(self, parts: set[str]) -> None:
        s = self.state
        if STATUS in parts:
            text = _STATUS_TEXT.get(s.status, s.status)
            if s.coordinator and s.status == "connected":
                text += f" to {s.coordinator}"
            if s.reconnects:
                text += f" (reconnected {s.reconnects}×)"
            if s.error:
                text += f" — {s.error}"
            self.view.set_status(s.status, text, s.running)
        if PROGRESS in parts or STATUS in parts:
            self.view.set_progress(s.round, s.rounds, s.batch, s.batches)
        if METRICS in parts:
            self.view.set_metrics([s.metrics[r] for r in sorted(s.metrics)])
        if LEDGER in parts:
            self.view.set_ledger(list(s.ledger), s.sent_total())
        if LOG in parts:
            new = s.log_total - self._log_pushed
            if self._log_pushed == 0 or new > len(s.log):
                self.view.set_log(list(s.log))
            elif new > 0:
                self.view.append_log(list(s.log)[-new:])
            self._log_pushed = s.log_total
