"""Transport overhead of a loopback federation: round wall time minus the slowest site's training.

Runs a real coordinator (``fedsm server``) and three sites (``fedsm site``) on 127.0.0.1 with
TLS and site authentication, FedSM payloads (global U-Net, personalized U-Net, selector: about
50 MB each way per site and round) and synthetic data, then reads ``summary.json``: for every
round, the coordinator's wall time (instructions out, answers in, checked, aggregated) minus
the longest local training time any site reported. What remains is moving, encoding and
checking the payloads, plus Flower's polling. Round 1 also includes each site loading its data
and warming up; the last FedSM round only sends the selector (calibration).

    python benchmarks/transport_overhead.py [--rounds 3] [--image-size 64] [--insecure] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's engine, also for the app hash the sites pin
SITES = ("site1", "site2", "site3")


def fedsm(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli.main", *args]


def prepare(root: Path, rounds: int, image_size: int, insecure: bool, poll: float) -> None:
    from engine.data.synth import generate_federation
    from engine.federation.flower.app_bundle import build_app_bundle
    from engine.federation.flower.processes import free_port
    from engine.security import certs
    from engine.security.enrollment import enroll_site

    datalists = generate_federation("fundus", len(SITES), root / "data", image_size=image_size, seed=0)
    pki = root / "pki"
    certs.create_ca(pki)
    certs.create_server_certificate(pki, pki, ["127.0.0.1"])
    port = free_port()
    (root / "federation.toml").write_text(f"""[federation]
sites = {json.dumps(list(SITES))}
address = "127.0.0.1:{port}"
work_dir = "coord"
round_timeout = 600
poll_interval = {poll}

[tls]
ca_cert = "pki/ca.pem"
server_cert = "pki/server.pem"
server_key = "pki/server.key"

[training]
task = "fundus"
method = "fedsm"
rounds = {rounds}
image_size = {image_size}
""")
    app = build_app_bundle().hash
    for site, datalist in zip(SITES, datalists, strict=True):
        keys = certs.create_site_keys(site, pki)
        if not insecure:
            enroll_site(root / "coord" / "enrolled", site, keys.cert)
        (root / f"{site}.toml").write_text(f"""[site]
name = "{site}"
coordinator = "127.0.0.1:{port}"
datalist = "{datalist}"
task = "fundus"
work_dir = "work-{site}"
poll_interval = {poll}
device = "cpu"
threads = 1

[security]
ca_cert = "pki/ca.pem"
private_key = "pki/{site}.key"
approved_apps = ["{app}"]
""")


class CpuMeter:
    """Cumulative CPU seconds of this process's descendants by component, snapshotted at every round end."""

    ROLES = ("coordinator", "SuperLink", "sites", "SuperNodes")

    def __init__(self, events: Path) -> None:
        self.events = events
        self.snapshots: list[dict[str, float]] = []
        self._cpu: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def start(self) -> CpuMeter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _role(self, pid: int) -> str | None:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return None
        if "flower.launch superlink" in cmd:
            return "SuperLink"
        if "flower.launch supernode" in cmd:
            return "SuperNodes"
        if "engine.cli.main server" in cmd:
            return "coordinator"
        if "engine.cli.main site" in cmd:
            return "sites"
        return None

    def _sample(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # read every time: a child forked by a site has the site's command line until it execs
            role = self._role(pid)
            if role is not None:
                self._cpu[pid] = (role, (int(fields[11]) + int(fields[12])) / self._tick)

    def _totals(self) -> dict[str, float]:
        out = dict.fromkeys(self.ROLES, 0.0)
        for role, cpu in self._cpu.values():
            out[role] += cpu
        return out

    def _run(self) -> None:
        ends = 0
        while not self._stop.wait(0.1):
            self._sample()
            try:
                now = self.events.read_text().count('"event": "round_end"')
            except OSError:
                continue
            if now != ends:
                ends = now
                self.snapshots.append(self._totals())

    def per_round(self) -> list[dict[str, float]]:
        """CPU seconds of each round after the first, by component."""
        return [{r: b[r] - a[r] for r in self.ROLES} for a, b in
                zip(self.snapshots, self.snapshots[1:], strict=False)]


def _wait_for_coordinator(server: subprocess.Popen, sites: dict[str, subprocess.Popen], root: Path,
                          timeout: float) -> int:
    """The coordinator's exit status; stops the benchmark at once if a site exits before it with an error."""
    deadline = time.monotonic() + timeout
    while (code := server.poll()) is None:
        for name, proc in sites.items():
            if proc.poll() not in (None, 0):
                err = (root / f"{name}.err").read_text(errors="replace").strip().splitlines()[-3:]
                raise SystemExit(f"{name} failed ({proc.returncode}): " + " / ".join(err))
        if time.monotonic() > deadline:
            raise SystemExit(f"the coordinator did not finish within {timeout:.0f} s; see {root / 'server.err'}")
        time.sleep(0.2)
    return code


def run(root: Path, insecure: bool, timeout: float, meter: CpuMeter | None = None) -> dict:
    flag = ["--insecure"] if insecure else []
    procs = []
    if meter is not None:
        meter.start()
    try:
        server = subprocess.Popen(fedsm("server", "--config", str(root / "federation.toml"), *flag), cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=(root / "server.err").open("wb"))
        procs.append(server)
        for site in SITES:
            procs.append(subprocess.Popen(fedsm("site", "--config", str(root / f"{site}.toml"), "--once",
                                                "--no-validate", *flag), cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=(root / f"{site}.err").open("wb")))
        code = _wait_for_coordinator(server, dict(zip(SITES, procs[1:], strict=True)), root, timeout)
        if code != 0:
            raise SystemExit(f"the coordinator failed ({code}); see {root / 'server.err'}")
        return json.loads((root / "coord" / "summary.json").read_text())
    finally:
        if meter is not None:
            meter.stop()
        for proc in procs:  # by PID
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="FedSM training rounds (plus one calibration round)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--poll-interval", type=float, default=0.1, help="server and site poll interval (s)")
    parser.add_argument("--insecure", action="store_true", help="no TLS, no site authentication")
    parser.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fedsm-transport-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        prepare(root, args.rounds, args.image_size, args.insecure, args.poll_interval)
        started = time.perf_counter()
        meter = CpuMeter(root / "coord" / "events.jsonl") if Path("/proc/self/stat").exists() else None
        summary = run(root, args.insecure, args.timeout, meter)
        total = time.perf_counter() - started
        phases = breakdown(root)

    print(f"3 sites, FedSM, {args.image_size} px, {'insecure' if args.insecure else 'TLS + site authentication'}, "
          f"loopback; {os.cpu_count()} CPUs; one torch thread per site; whole run {total:.1f} s")
    print(f"{'round':>5} {'wall s':>7} {'train s':>8} {'overhead s':>11} {'MB to':>7} {'MB from':>8} | "
          f"{'encode':>6} {'down':>5} {'site':>5} {'up':>5} {'agg':>5}")
    overheads, calibration = [], []
    last = len(summary["rounds"])
    for r in summary["rounds"]:
        slowest = max(r["train_s"].values())
        overhead = r["wall_s"] - slowest
        note = {1: "  (includes loading data, warm-up)", last: "  (calibration: selector only)"}.get(r["round"], "")
        if r["round"] == last and last > 1:
            calibration.append(overhead)
        elif r["round"] > 1:
            overheads.append(overhead)
        p = phases.get(r["round"], {})
        parts = " ".join(f"{p.get(k, float('nan')):>{w}.2f}" for k, w in
                         (("encode", 6), ("down", 5), ("site", 5), ("up", 5), ("agg", 5)))
        print(f"{r['round']:>5} {r['wall_s']:>7.2f} {slowest:>8.2f} {overhead:>11.2f} "
              f"{r['bytes_to_sites'] / 1e6:>7.1f} {r['bytes_from_sites'] / 1e6:>8.1f} | {parts}{note}")
    if overheads:
        print(f"transport overhead of the FedSM training rounds after round 1: median "
              f"{statistics.median(overheads):.2f} s, max {max(overheads):.2f} s per round (target <= 3 s)"
              + (f"; calibration round {calibration[0]:.2f} s" if calibration else ""))
    if meter is not None and meter.per_round():
        print("CPU seconds per round (rounds 2..): " + "; ".join(
            f"round {k + 2}: " + ", ".join(f"{role} {cpu[role]:.1f}" for role in CpuMeter.ROLES)
            for k, cpu in enumerate(meter.per_round())))


def breakdown(root: Path) -> dict[int, dict[str, float]]:
    """Phases of every round (see the module's docstring) from the coordinator's and the sites' events."""
    from engine.federation.events import read_events

    server = read_events(root / "coord" / "events.jsonl")
    sites = {s: read_events(root / f"work-{s}" / "events.jsonl") for s in SITES
             if (root / f"work-{s}" / "events.jsonl").exists()}

    def when(events: list[dict], kind: str, rnd: int, site: str | None = None) -> float | None:
        for e in events:
            if e["event"] == kind and e.get("round") == rnd and (site is None or e.get("site") == site):
                return float(e["time"])
        return None

    out: dict[int, dict[str, float]] = {}
    for end in (e for e in server if e["event"] == "round_end"):
        rnd = end["round"]
        start = when(server, "round_start", rnd)
        sent = {s: when(server, "sent", rnd, s) for s in sites}
        back = {s: when(server, "received", rnd, s) for s in sites}
        if start is None or any(v is None for v in (*sent.values(), *back.values())):
            continue
        last = max(back, key=lambda s: back[s])  # type: ignore[arg-type,return-value]
        got = when(sites[last], "received", rnd)
        answered = when(sites[last], "sent", rnd)
        train = next((e.get("train_s") for e in sites[last] if e["event"] == "metrics" and e.get("round") == rnd),
                     None)
        if got is None or answered is None or train is None:
            continue
        out[rnd] = {"encode": max(sent.values()) - start, "down": got - sent[last],  # type: ignore[operator]
                    "site": answered - got - float(train), "up": back[last] - answered,  # type: ignore[operator]
                    "agg": float(end["time"]) - back[last]}  # type: ignore[operator]
    return out


if __name__ == "__main__":
    main()
