"""Transport overhead of Flower used through its public API alone, at FedSM's message sizes.

What issue 33 asks to know before the federation drops its Flower internals: how long a round
takes when Flower runs as it ships. Everything here is Flower's documented surface: the
``flower-superlink`` and ``flower-supernode`` commands with their documented flags (TLS,
SuperNode authentication, the default ``subprocess`` isolation, in which Flower itself starts a
``flwr-serverapp`` for the run and a ``flwr-clientapp`` process for every message a site
receives), ``flwr supernode register`` and ``flwr run`` (the CLI, with a SuperLink connection in
``$FLWR_HOME/config.toml``), and an app written against ``flwr.app`` / ``flwr.clientapp`` /
``flwr.serverapp`` only. No FedSM launcher, no replacement of any Flower name.

The app moves FedSM's default payload (``--down-mib`` to each site, ``--up-mib`` back; the
defaults are what ``fedsm simulate --task fundus --image-size 64 --methods fedsm`` reports per
site and round) as 16-bit arrays, and does no training: a round's wall time, measured in the
ServerApp around ``Grid.send_and_receive``, is all transport, process start and polling. With
``--import-engine`` each ClientApp process also imports what FedSM's site half imports (torch,
MONAI, the engine), the price a per-message process would pay in the product.

    python benchmarks/public_flower_overhead.py [--rounds 21] [--sites 3] [--import-engine]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent

#: Flower's telemetry, update check and run-time dependency installation: off, as everywhere in FedSM.
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}

APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "transportbench"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedsm"

[tool.flwr.app.components]
serverapp = "bench_app:server"
clientapp = "bench_app:client"

[tool.flwr.app.config]
rounds = 3
down-bytes = 1024
up-bytes = 1024
out = ""
"""

#: The app: public API only (``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp``).
APP_MODULE = '''"""Moves arrays of the configured sizes back and forth; no training."""

import json
import os
import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

def process_start() -> float:
    """When this process started (Linux; else when it imported the app)."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


PROCESS_STARTED = process_start()  # a ClientApp process: one per message
STARTED = time.time()
if os.environ.get("FEDSM_BENCH_IMPORT_ENGINE") == "1":
    import engine.federation.flower.client_app  # noqa: F401  (torch, MONAI, the engine's site half)
    import monai  # noqa: F401
IMPORTED = time.time()


def arrays(total: int, seed: int) -> ArrayRecord:
    rng = np.random.default_rng(seed)
    parts = 8
    return ArrayRecord([rng.standard_normal(total // 2 // parts).astype(np.float16) for _ in range(parts)])


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    received = time.time()
    up = int(msg.content["config"]["up-bytes"])
    reply = RecordDict({"arrays": arrays(up, 1), "metrics": MetricRecord(
        {"import-s": IMPORTED - STARTED, "start-to-call-s": received - PROCESS_STARTED, "received": received})})
    return Message(reply, reply_to=msg)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, down, up = int(cfg["rounds"]), int(cfg["down-bytes"]), int(cfg["up-bytes"])
    payload = arrays(down, 0)
    nodes = []
    while len(nodes) < int(cfg.get("sites", 0) or 1):
        nodes = list(grid.get_node_ids())
        time.sleep(0.2)
    out = []
    for r in range(1, rounds + 1):
        from flwr.app import ConfigRecord
        messages = [Message(RecordDict({"arrays": payload, "config": ConfigRecord({"up-bytes": up})}),
                            dst_node_id=node, message_type="train", group_id=str(r)) for node in nodes]
        t0 = time.time()
        replies = list(grid.send_and_receive(messages))
        t1 = time.time()
        ok = [m for m in replies if m.has_content()]
        out.append({"round": r, "wall_s": t1 - t0, "replies": len(ok),
                    "import_s": [float(m.content["metrics"]["import-s"]) for m in ok],
                    "start_to_call_s": [float(m.content["metrics"]["start-to-call-s"]) for m in ok],
                    "first_seen_s": [float(m.content["metrics"]["received"]) - t0 for m in ok]})
        tmp = cfg["out"] + ".part"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, cfg["out"])
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} while starting")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"{what} did not listen on {port} within {timeout:.0f} s")


def run_finished(env: dict[str, str]) -> bool:
    """Whether the SuperLink's only run has ended (``flwr ls``)."""
    listed = subprocess.run([str(BIN / "flwr"), "ls", "bench", "--format", "json"], env=env, capture_output=True,
                            text=True, timeout=120)
    try:
        runs = json.loads(listed.stdout).get("runs", [])
    except json.JSONDecodeError:
        return False
    return bool(runs) and all(str(r.get("status", "")).startswith("finished") for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--down-mib", type=float, default=11.40, help="MiB to each site per round")
    parser.add_argument("--up-mib", type=float, default=6.50, help="MiB from each site per round")
    parser.add_argument("--import-engine", action="store_true",
                        help="each ClientApp process imports FedSM's site half (torch, MONAI, engine)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    args = parser.parse_args()

    from cryptography.hazmat.primitives import serialization

    from engine.security import certs

    root = args.keep or Path(tempfile.mkdtemp(prefix="public-flower-"))
    root.mkdir(parents=True, exist_ok=True)
    pki = root / "pki"
    certs.create_ca(pki)
    certs.create_server_certificate(pki, pki, ["127.0.0.1"])
    app = root / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(APP_PYPROJECT)
    (app / "bench_app.py").write_text(APP_MODULE)
    port = free_port()
    home = root / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                      f'address = "127.0.0.1:{port}"\nroot-certificates = "{pki / "ca.pem"}"\n')
    env = {**os.environ, **QUIET, "FLWR_HOME": str(home), "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),  # Flower starts its own commands
           "FEDSM_BENCH_IMPORT_ENGINE": "1" if args.import_engine else "0"}
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str], extra: dict[str, str] | None = None) -> subprocess.Popen:
        log = (root / f"{name}.log").open("w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **(extra or {})},
                                start_new_session=True)
        procs.append(proc)
        return proc

    out = root / "rounds.json"
    try:
        link = start("superlink", [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
                                   "--ssl-ca-certfile", str(pki / "ca.pem"), "--ssl-certfile", str(pki / "server.pem"),
                                   "--ssl-keyfile", str(pki / "server.key"), "--enable-supernode-auth",
                                   "--disable-runtime-dependency-installation"])
        wait_port(port, link, "flower-superlink")
        for i in range(1, args.sites + 1):
            keys = certs.create_site_keys(f"site{i}", pki)
            ssh_public = pki / f"site{i}.pub"  # `flwr supernode register` reads the OpenSSH form
            ssh_public.write_bytes(certs.load_public_key(keys.cert).public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
            subprocess.run([str(BIN / "flwr"), "supernode", "register", str(ssh_public), "bench", "--name",
                            f"site{i}"], env=env, check=True, capture_output=True, timeout=120)
            node_home = root / f"site{i}-home"
            node_home.mkdir()
            start(f"supernode{i}", [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}",
                                    "--root-certificates", str(pki / "ca.pem"), "--auth-supernode-private-key",
                                    str(keys.key), "--port", str(free_port())], {"FLWR_HOME": str(node_home)})
        t_submit = time.time()
        down, up = int(args.down_mib * 2**20), int(args.up_mib * 2**20)
        subprocess.run([str(BIN / "flwr"), "run", str(app), "bench", "--run-config",
                        f'rounds={args.rounds} down-bytes={down} up-bytes={up} out="{out}"'],
                       env=env, check=True, capture_output=True, timeout=300)
        deadline = time.monotonic() + args.timeout
        rounds: list[dict] = []
        while time.monotonic() < deadline:
            if out.exists():
                rounds = json.loads(out.read_text())
                if len(rounds) >= args.rounds:
                    break
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"a Flower process ended early; logs in {root}")
            if run_finished(env):
                time.sleep(2)
                if not out.exists() or len(json.loads(out.read_text())) < args.rounds:
                    raise SystemExit(f"the run ended early; see `FLWR_HOME={home} flwr log RUN_ID bench --show`")
            time.sleep(2)
        else:
            raise SystemExit(f"{len(rounds)} of {args.rounds} rounds within {args.timeout:.0f} s; logs in {root}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    later = rounds[1:]  # round 1 also includes the run's start
    walls = [r["wall_s"] for r in later]
    imports = [s for r in later for s in r["import_s"]]
    seen = [max(r["first_seen_s"]) for r in later]
    print(json.dumps({
        "flwr": subprocess.run([str(BIN / "flwr"), "--version"], capture_output=True, text=True, env=env)
        .stdout.strip(),
        "sites": args.sites, "down_mib": args.down_mib, "up_mib": args.up_mib, "import_engine": args.import_engine,
        "first_round_s": round(rounds[0]["wall_s"], 2),
        "rounds_measured": len(later), "median_round_s": round(statistics.median(walls), 2),
        "max_round_s": round(max(walls), 2), "min_round_s": round(min(walls), 2),
        "median_last_site_sees_message_s": round(statistics.median(seen), 2),
        "median_clientapp_import_s": round(statistics.median(imports), 2),
        "median_clientapp_process_start_to_call_s": round(statistics.median(
            s for r in later for s in r["start_to_call_s"]), 2),
        "all_replies": all(r["replies"] == args.sites for r in rounds),
        "submitted_at": t_submit, "work": str(root)}, indent=1))


if __name__ == "__main__":
    main()
