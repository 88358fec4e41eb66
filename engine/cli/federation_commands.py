"""``fedsm server``, ``fedsm site``, ``fedsm certs`` and ``fedsm enroll``: the network federation.

See ``docs/federation.md`` for a walk-through (certificates, enrolment, start, watch, resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from engine.cli.common import set_threads, setup_logging
from engine.cli.main import add_threads_option
from engine.errors import ConfigError
from engine.federation.events import EventWriter
from engine.federation.flower.app_bundle import build_app_bundle
from engine.federation.flower.memory import keep_freed_memory
from engine.security.run_review import stdin_confirmation
from engine.startup import collector_paused


class StopFlag:
    """Set by SIGTERM or a first Ctrl-C, so work stops between steps and children are stopped cleanly.

    A second Ctrl-C interrupts at once (``KeyboardInterrupt``).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._event.set()
        if signum == signal.SIGINT:
            print("stopping (press Ctrl-C again to interrupt at once)", file=sys.stderr)
        else:  # SIGTERM: the desktop app's Leave, a service manager; there is no Ctrl-C to press
            print("stopping: asked to leave; finishing the current step, then exiting", file=sys.stderr)

    def __call__(self) -> bool:
        return self._event.is_set()


def _terminal_listener(event: dict[str, Any]) -> None:
    """A short line on stderr for the events a person watching a terminal cares about."""
    kind = event["event"]
    site = f"{event['site']}: " if event.get("site") else ""
    if kind == "status":
        text = event["message"]
    elif kind in ("connected", "disconnected"):
        text = kind + (f" ({event['reason']})" if event.get("reason") else "")
    elif kind == "round_end" and event["source"] == "server":
        left = event.get("left_out") or {}
        text = (f"round {event['round']}/{event['rounds']} done in {event['wall_s']:.1f} s; answered: "
                f"{', '.join(event.get('answered', [])) or 'none'}"
                + (f"; left out: {'; '.join(f'{k} ({v})' for k, v in left.items())}" if left else ""))
    elif kind == "round_end":
        text = f"round {event['round']}/{event['rounds']} sent after {event['wall_s']:.1f} s"
    elif kind == "metrics" and event.get("dice"):
        text = f"round {event['round']} validation Dice " + ", ".join(f"{k} {v:.3f}" for k, v in event["dice"].items())
    elif kind == "error":
        text = "error: " + event["message"]
    elif kind == "finished":
        text = f"finished after {event['rounds']} rounds"
    else:
        return
    print(site + text, file=sys.stderr, flush=True)


def _events(args: argparse.Namespace, source: str, site: str | None, path: Path) -> Any:
    return EventWriter(source, site, path, stream=sys.stdout if args.json else None,
                       listener=None if args.json else _terminal_listener)


def _server(args: argparse.Namespace) -> int:
    with collector_paused():  # Flower's SuperLink side and the engine (engine.startup)
        from engine.federation.config import load_federation_config
        from engine.federation.flower.server import run_server

    keep_freed_memory()
    cfg = load_federation_config(args.config)
    setup_logging(args.verbose, cfg.work_dir / "server.log")
    set_threads(args.threads)  # the ServerApp (aggregation, FedIOD's distillation) runs in this process
    stop = StopFlag()
    with _events(args, "server", None, cfg.work_dir / "events.jsonl") as events:
        summary = run_server(cfg, events=events, insecure=args.insecure, resume=args.resume, stop=stop)
    if not args.json:
        files = ", ".join(str(cfg.work_dir / f) for f in summary["files"].values())
        print(f"finished; wrote {files or 'no model'} and {cfg.work_dir / 'summary.json'}", file=sys.stderr)
    return 0


def _site(args: argparse.Namespace) -> int:
    with collector_paused():  # Flower's runtime client and the engine (engine.startup)
        from engine.federation.config import load_site_config
        from engine.federation.flower.site import run_site

    keep_freed_memory()
    cfg = load_site_config(args.config, check_files=False)
    setup_logging(args.verbose, cfg.work_dir / "site.log")
    # the ClientApp trains in this process: --threads, else site.toml's threads, else OMP_NUM_THREADS or the
    # free cores; the count is kept for the whole run (also when the site loads a model to validate)
    threads = set_threads(args.threads if args.threads is not None else (cfg.threads or None), load_stack=False)
    cfg = dataclasses.replace(cfg, threads=threads)
    stop = StopFlag()
    with _events(args, "site", cfg.name, cfg.work_dir / "events.jsonl") as events:
        confirm = None
        if getattr(args, "confirm_runs", False):
            confirm = stdin_confirmation()
        return run_site(cfg, insecure=args.insecure, events=events, once=args.once, validate=not args.no_validate,
                        stop=stop, confirm=confirm)


def _certs(args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    if args.certs_command == "app-hash":
        print(build_app_bundle().hash)
        return 0
    from engine.security import certs

    if args.certs_command == "ca":
        paths = certs.create_ca(args.out, name=args.name, days=args.days, force=args.force)
        print(f"wrote {paths.cert} (give it to every site) and {paths.key} (keep it on the coordinator)")
    elif args.certs_command == "server":
        paths = certs.create_server_certificate(args.ca, args.out, args.host or [], days=args.days, force=args.force)
        print(f"wrote {paths.cert} and {paths.key} (for [tls] in federation.toml)")
    else:
        paths = certs.create_site_keys(args.name, args.out, force=args.force)
        fingerprint = certs.key_fingerprint(certs.load_public_key(paths.cert))
        print(f"wrote {paths.key} (keep it at the site) and {paths.cert} (send it to the coordinator)\n"
              f"fingerprint {fingerprint} (read it to the coordinator to confirm the key)")
    return 0


def _enroll(args: argparse.Namespace) -> int:
    from engine.federation.config import load_federation_config
    from engine.security import enrollment
    from engine.security.certs import key_fingerprint, load_public_key

    setup_logging(args.verbose)
    cfg = load_federation_config(args.config)
    if args.list:
        keys = enrollment.enrolled_keys(cfg.enrolled_dir)
        for site in cfg.sites:
            path = enrollment.enrolled_key_path(cfg.enrolled_dir, site)
            print(f"{site}: " + (key_fingerprint(load_public_key(path)) if site in keys else "NOT ENROLLED"))
        for extra in sorted(set(keys) - set(cfg.sites)):
            print(f"{extra}: enrolled but not in [federation] sites")
        return 0
    if args.remove:
        enrollment.remove_site(cfg.enrolled_dir, args.remove)
        print(f"withdrew {args.remove}'s enrolment; it takes effect when the coordinator restarts")
        return 0
    if not args.site or not args.public_key:
        raise ConfigError("give --site NAME --public-key NAME.pub.pem (or --list, or --remove NAME)")
    if args.site not in cfg.sites:
        print(f"note: {args.site} is not in [federation] sites of {cfg.path} yet", file=sys.stderr)
    fingerprint = enrollment.enroll_site(cfg.enrolled_dir, args.site, args.public_key, force=args.force)
    print(f"enrolled {args.site}: {fingerprint} (check it with the site before the first run)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``server``, ``site``, ``certs`` and ``enroll`` to the ``fedsm`` parser."""
    p = sub.add_parser("server", help="run the coordinator of a federation (Flower SuperLink + FedSM ServerApp)")
    p.add_argument("--config", type=Path, required=True, help="federation.toml")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the work folder")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS and no site authentication; loopback demonstrations only")
    p.add_argument("--json", action="store_true", help="write progress events to stdout as JSON lines")
    add_threads_option(p, "; the coordinator's aggregation and distillation run in this process")
    p.set_defaults(handler=_server)

    p = sub.add_parser("site", help="join a federation as one site (Flower SuperNode + FedSM ClientApp)")
    p.add_argument("--config", type=Path, required=True, help="site.toml")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS and no site key; only for a coordinator started with --insecure on loopback")
    p.add_argument("--json", action="store_true", help="write progress events to stdout as JSON lines")
    p.add_argument("--once", action="store_true", help="exit when the coordinator's run has finished")
    p.add_argument("--no-validate", action="store_true", help="skip the validation Dice after each round")
    p.add_argument("--confirm-runs", action="store_true",
                   help="before training for a new run, wait for 'accept' on standard input (anything else "
                        "declines); the run's signed settings are shown in a run_settings event first")
    add_threads_option(p, "; site.toml's [site] threads when set and no --threads is given")
    p.set_defaults(handler=_site)

    p = sub.add_parser("certs", help="create the federation CA, the coordinator certificate or a site's key pair")
    certs_sub = p.add_subparsers(dest="certs_command", required=True)
    c = certs_sub.add_parser("ca", help="create the federation's certificate authority (coordinator)")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--name", default="FedSM federation CA")
    c.add_argument("--days", type=int, default=3650)
    c.add_argument("--force", action="store_true", help="replace existing files")
    c = certs_sub.add_parser("server", help="create the coordinator's TLS certificate, signed by the CA")
    c.add_argument("--ca", type=Path, required=True, help="folder with ca.pem and ca.key")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--host", action="append", help="name or address sites use (repeatable; loopback always added)")
    c.add_argument("--days", type=int, default=825)
    c.add_argument("--force", action="store_true", help="replace existing files")
    c = certs_sub.add_parser("site", help="create a site's key pair (at the site)")
    c.add_argument("--name", required=True, help="the site's name, as the coordinator lists it")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--force", action="store_true", help="replace existing files")
    certs_sub.add_parser("app-hash", help="print the hash of the FedSM app this installation runs")
    for c in certs_sub.choices.values():
        c.set_defaults(handler=_certs)
    p.set_defaults(handler=_certs)

    p = sub.add_parser("enroll", help="register a site's public key with the coordinator")
    p.add_argument("--config", type=Path, required=True, help="federation.toml")
    p.add_argument("--site", help="site name")
    p.add_argument("--public-key", type=Path, help="the site's NAME.pub.pem")
    p.add_argument("--force", action="store_true", help="replace the key of an enrolled site")
    p.add_argument("--list", action="store_true", help="list enrolled sites and key fingerprints")
    p.add_argument("--remove", metavar="SITE", help="withdraw a site's enrolment")
    p.set_defaults(handler=_enroll)
