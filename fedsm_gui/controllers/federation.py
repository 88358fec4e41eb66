"""The federation panel: site setup, data check, Join/Leave of the site process, live status."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fedsm_gui.controllers.errors import user_message
from fedsm_gui.controllers.runners import ProcessRunner, TaskRunner
from fedsm_gui.models.federation import (
    CONFIRM,
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
    "task": ("task",),
    "datalist": ("datalist",),
    "app_hash": ("approved_apps", "app_hash"),
}
#: Status words for the panel.
_STATUS_TEXT = {
    "idle": "Not joined", "starting": "Starting the site …", "connected": "Connected",
    "reconnecting": "Connection lost — reconnecting …", "disconnected": "Disconnected",
    "finished": "Run finished", "failed": "Site stopped with an error", "stopped": "Left the federation",
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
    privacy = config.get("privacy") or {}
    values["dp_epsilon"] = _text(privacy.get("epsilon")) if isinstance(privacy, dict) else ""
    return SiteSetup(config_path=path, share_activations=bool(config.get("share_activations", False)), **values)


def site_toml(setup: SiteSetup) -> str:
    """A ``site.toml`` holding the form's fields (``fedsm site --config`` reads it).

    Empty optional fields are left out; several approved app hashes may be separated by commas.
    """
    def quoted(text: str) -> str:
        return json.dumps(text)  # a JSON string is a valid TOML basic string

    lines = ["# FedSM site configuration written by fedsm-gui", "[site]"]
    for key, value in (("name", setup.site_name), ("coordinator", setup.coordinator), ("task", setup.task),
                       ("datalist", setup.datalist)):
        lines.append(f"{key} = {quoted(value.strip())}")
    if setup.share_activations:  # confirmed in the app: BlackFed's activations and masks may leave the site
        lines.append("share_activations = true")
    security = [(key, value.strip()) for key, value in (("ca_cert", setup.ca_cert), ("private_key", setup.site_key))
                if value.strip()]
    hashes = [h.strip() for h in setup.app_hash.split(",") if h.strip()]
    if security or hashes:
        lines += ["", "[security]"]
        lines += [f"{key} = {quoted(value)}" for key, value in security]
        if hashes:
            lines.append(f"approved_apps = [{', '.join(quoted(h) for h in hashes)}]")
    epsilon = setup.dp_epsilon.strip()
    if epsilon:
        # a number is written as one; anything else as a string, which the site refuses with a clear message
        try:
            value = repr(float(epsilon))
        except ValueError:
            value = quoted(epsilon)
        lines += ["", "[privacy]", f"epsilon = {value}"]
    return "\n".join(lines) + "\n"


#: Form fields that decide what a run may take from this site: where ``site.toml`` keeps each one.
_CONSENT_KEYS = {"share_activations": ("site", "share_activations"), "dp_epsilon": ("privacy", "epsilon")}


def _toml_value(literal: str) -> Any:
    return tomllib.loads(f"v = {literal}")["v"]


def consent_literals(setup: SiteSetup) -> dict[tuple[str, str], str | None]:
    """The form's consent settings as TOML literals by ``(table, key)`` (``None``: the key is absent).

    ``share_activations``: BlackFed may send activations and masks; ``[privacy] epsilon``: the
    budget FedIOD's released gradients get at this site (a non-number is written as a string,
    which the site refuses with a clear message).
    """
    epsilon = setup.dp_epsilon.strip()
    if epsilon:
        try:
            eps_literal: str | None = repr(float(epsilon))
        except ValueError:
            eps_literal = json.dumps(epsilon)
    else:
        eps_literal = None
    return {_CONSENT_KEYS["share_activations"]: "true" if setup.share_activations else "false",
            _CONSENT_KEYS["dp_epsilon"]: eps_literal}


def update_toml_keys(text: str, values: dict[tuple[str, str], str | None]) -> str:
    """``text`` with ``key = literal`` set in ``[table]`` for each ``(table, key)`` (removed for ``None``).

    Every other line (comments, ``[bounds]``, keys the form does not show) stays as it was. A
    table that does not exist yet is appended. The result is parsed again and must hold exactly
    the requested values, else :class:`ValueError` (edit the file by hand then).
    """
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\s*([A-Za-z0-9_-]+)\s*\]\s*(#.*)?$")
    pending = dict(values)
    table = ""
    out: list[str] = []
    starts: dict[str, int] = {}  # table -> index in ``out`` just after its header
    for line in lines:
        match = header.match(line)
        if match:
            table = match.group(1)
            out.append(line)
            starts.setdefault(table, len(out))
            continue
        key_match = re.match(r"^\s*([A-Za-z0-9_-]+)\s*=", line)
        if key_match and (table, key_match.group(1)) in pending:
            literal = pending.pop((table, key_match.group(1)))
            if literal is not None:
                out.append(f"{key_match.group(1)} = {literal}")
            continue
        out.append(line)
    for (tbl, key), literal in list(pending.items()):
        if literal is None:
            continue
        if tbl in starts:
            at = starts[tbl]
            out.insert(at, f"{key} = {literal}")
            starts = {t: i + (1 if i >= at and t != tbl else 0) for t, i in starts.items()}
        else:
            out += ["", f"[{tbl}]", f"{key} = {literal}"]
            starts[tbl] = len(out) - 1
    new = "\n".join(out) + "\n"
    try:
        doc = tomllib.loads(new)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the file would not stay valid TOML ({exc}); edit it by hand") from None
    for (tbl, key), literal in values.items():
        got = doc.get(tbl, {}).get(key) if isinstance(doc.get(tbl), dict) else None
        if got != (None if literal is None else _toml_value(literal)):
            raise ValueError(f"could not set [{tbl}] {key} (it may be written in another form); edit the file by hand")
    return new


def write_text_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_rows(report: dict[str, Any]) -> tuple[list[dict[str, str]], str]:
    """Per-file rows and a summary line from a ``validate_data`` report.

    Datalist-level problems come first (file = the datalist), then one row per image and mask:
    status ``problem`` (it cannot be used), ``warning`` (usable, but look at it) or ``ok``.
    """
    rows: list[dict[str, str]] = []
    for site in report.get("sites", []) or []:
        if isinstance(site, dict) and site.get("problems"):
            rows.append({"file": str(site.get("datalist", "datalist")), "status": "problem",
                         "message": "; ".join(map(str, site["problems"]))})
    for item in report.get("files", []) or []:
        if not isinstance(item, dict):
            continue
        problems = [str(p) for p in item.get("problems", []) or []]
        warnings = [str(w) for w in item.get("warnings", []) or []]
        ok = bool(item.get("ok", not problems))
        status = "problem" if not ok or problems else ("warning" if warnings else "ok")
        name = Path(str(item.get("file") or item.get("image") or "?")).name
        if item.get("label"):
            name = f"{name} + {Path(str(item['label'])).name}"
        rows.append({"file": name, "status": status, "message": "; ".join(problems + warnings)})
    summary = report.get("summary")
    if not isinstance(summary, str):
        bad = sum(1 for r in rows if r["status"] == "problem")
        summary = f"{len(rows)} file(s) checked, {bad} with problems"
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
        view.save_config_requested.connect(self.save_config)
        view.check_data_requested.connect(self.check_data)
        view.join_requested.connect(self.join)
        view.leave_requested.connect(self.leave)
        view.app_hash_requested.connect(self.show_app_hash)
        view.run_confirmation_answered.connect(self.answer_run_confirmation)
        self._push_setup()
        self._on_changed({STATUS, PROGRESS, METRICS, LEDGER, LOG})

    def show_app_hash(self) -> None:
        """Compute the hash of the app this installation runs (packs the app; imports Flower) in a worker."""
        self.tasks.submit(lambda progress, cancel: self.api.app_hash(), on_done=self.view.set_local_app_hash,
                          on_error=lambda exc: self.view.set_local_app_hash(f"unknown ({user_message(exc)})"))

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
        if field == "share_activations":
            self.state.setup.share_activations = value == "true"
            if not self.demo:  # the consent dialog promises it is saved in site.toml: it is, at once
                written = self.sync_consent()
                if written:
                    self.state.note(written)
            return
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

    def save_config(self, path: str) -> None:
        """Write the form as ``site.toml`` and read it back through the engine, which checks it."""
        target = Path(path)
        text = site_toml(self.state.setup)

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> dict[str, Any]:
            write_text_file(target, text)
            return self.api.read_site_config(target)

        def done(config: dict[str, Any]) -> None:
            self.state.setup = setup_from_config(config, str(target))
            self._push_setup()
            self.view.set_check_results([], f"Saved {target}; Join now runs this site.")

        self.tasks.submit(job, on_done=done, on_error=lambda exc: self.view.set_check_results(
            [], f"Saved {target}, but it is not a usable site configuration: {user_message(exc)}"))

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

        task = self.state.setup.task or None
        self.tasks.submit(lambda progress, cancel: self.api.validate_data([Path(datalist)], task=task), on_done=done,
                          on_error=lambda exc: self.view.set_check_results([], f"Check failed: {user_message(exc)}"))

    def sync_consent(self) -> str | None:
        """Write the form's consent settings into the loaded ``site.toml`` where it differs.

        Returns what was written (a log line; ``""`` when the file already held them), or ``None``
        when the file could not be updated (``state.error`` says why).

        The site process reads its settings from that file, not from the form: a BlackFed consent
        or a FedIOD epsilon given in the app and not saved would otherwise be ignored at Join
        (the site refusing every split-learning exchange, or releasing gradients without the
        asked-for noise). Only those keys change; the rest of the file stays as written.
        """
        path = Path(self.state.setup.config_path)
        if not path.is_file():
            return ""  # nothing to update: the site process names the missing file itself
        try:
            text = path.read_text(encoding="utf-8")
            doc = tomllib.loads(text)
            wanted = consent_literals(self.state.setup)
            changes = {}
            for (table, key), literal in wanted.items():
                section = doc.get(table, {}) if isinstance(doc.get(table), dict) else {}
                current = section.get(key, False if key == "share_activations" else None)
                if current != (None if literal is None else _toml_value(literal)):
                    changes[(table, key)] = literal
            if not changes:
                return ""
            write_text_file(path, update_toml_keys(text, changes))
        except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
            self.state.error = f"cannot save the consent settings to {path}: {exc}"
            self.state.changed.emit({STATUS})
            return None
        said = ", ".join(f"[{t}] {k} = {v if v is not None else '(removed)'}" for (t, k), v in changes.items())
        return f"{path.name}: wrote {said} (as set in the app)"

    # --- join / leave --------------------------------------------------------------------
    def command(self) -> list[str]:
        """The site process's command line."""
        if not self.demo:
            # the site waits for the operator to accept each new run's signed settings (ask_run_confirmation)
            return list(self.api.site_command(Path(self.state.setup.config_path), json_events=True,
                                              confirm_runs=True))
        workdir = self.demo_workdir or Path.home() / ".cache" / "fedsm" / "demo-site"
        site = self.state.setup.site_name or "site1"
        return list(self.api.demo_site_command(workdir, site=site, rounds=self.demo_rounds))

    def join(self, on_exit: Callable[[int], None] | None = None) -> None:
        """Start the site process (no-op while one runs)."""
        if self.process.running:
            return
        written = "" if self.demo else self.sync_consent()
        if written is None:
            return  # the site would not run with what the operator agreed to; the error says why
        try:
            argv = self.command()
        except Exception as exc:  # any failure to build the command is shown, not raised
            self.state.error = user_message(exc)
            self.state.changed.emit({STATUS})
            return
        self._log_pushed = 0
        self.state.starting(argv)
        if written:
            self.state.note(written)

        def exited(code: int, stopped: bool) -> None:
            self.state.process_ended(code, stopped)
            if on_exit is not None:
                on_exit(code)

        self.process.start(argv, on_line=self.state.apply_line, on_exit=exited)

    def leave(self) -> None:
        """Stop the site process: terminate, then kill when it does not exit in time."""
        if self.process.running:
            self.state.note("Leave pressed: asking the site process to stop (killed if it has not exited in 5 s)")
            self.process.stop()

    def answer_run_confirmation(self, accepted: bool) -> None:
        """The operator accepted or declined the run's settings: tell the waiting site process."""
        pending = self.state.awaiting_confirmation
        if pending is None:
            return
        self.state.awaiting_confirmation = None
        self.process.write_line(self.api.RUN_ACCEPT if accepted else self.api.RUN_DECLINE)
        method = pending["settings"].get("method", "?")
        self.state.note(f"run settings ({method}) {'accepted' if accepted else 'declined'} by the operator")

    # --- state -> view -------------------------------------------------------------------
    def _on_changed(self, parts: set[str]) -> None:
        s = self.state
        if CONFIRM in parts and s.awaiting_confirmation is not None:
            pending = s.awaiting_confirmation
            self.view.ask_run_confirmation(self.api.format_run_settings(pending["settings"]),
                                           self.api.review_run_settings(pending["settings"], pending["bounds"]))
        if STATUS in parts:
            text = _STATUS_TEXT.get(s.status, s.status)
            if s.coordinator and s.status == "connected":
                text += f" to {s.coordinator}"
            if s.reconnects:
                text += f" (reconnected {s.reconnects}×)"
            if s.error:
                text += f" — {s.error}"
            if s.bundle:  # a BlackFed or FedIOD run ended with this site's own bundle
                text += f" — bundle: {s.bundle}"
            self.view.set_status(s.status, text, s.running or self.process.running)
        if PROGRESS in parts or STATUS in parts:
            self.view.set_progress(s.round, s.rounds, s.progress_fraction, s.progress_line)
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
