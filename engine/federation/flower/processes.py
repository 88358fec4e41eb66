"""Child processes (SuperLink, SuperNode): start, watch their output, stop them by PID.

Each child runs through :mod:`engine.federation.flower.launch`, which stops it when this
process dies. Children start in their own session, so a Ctrl-C in the terminal reaches only
the FedSM process, which then stops its children itself, in order: SIGINT (Flower's graceful
exit: a SuperNode deactivates itself at the coordinator), SIGTERM, SIGKILL, each by PID.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from engine.errors import FedSMError
from engine.federation.flower import FLOWER_ENV
from engine.federation.preflight import port_open

log = logging.getLogger(__name__)

#: Flower settings a child may inherit from the environment of the FedSM process (a log level
#: changes nothing but the log). Every other ``FLWR_*`` variable is dropped: Flower reads
#: dozens of them, some of which open ports or redirect traffic (``FLWR_INTERNAL_GRPC_CONTROL_API``
#: and ``FLWR_INTERNAL_GRPC_FLEET_API`` start the SuperLink's gRPC Control and Fleet APIs on
#: their default addresses, beside the fleet listener; ``FLWR_DATABASE`` moves its state,
#: ``FLWR_SUPERGRID_*`` and ``FLWR_UPDATE_CHECK_URL`` point at other servers,
#: ``FLWR_PRIVATE_*`` change chunking and concurrency, ``FLWR_TRACING_ENABLED`` and
#: ``FLWR_ENABLE_EVENT_LOG`` switch on reporting). What a child gets is :data:`FLOWER_ENV` plus
#: what FedSM passes explicitly.
INHERITED_FLOWER_VARIABLES = frozenset({"FLWR_LOG_LEVEL"})


def child_environment(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Flower child: ``base`` (default: this process's) without Flower's
    own variables, then FedSM's fixed Flower settings, then ``extra``."""
    inherited = dict(os.environ if base is None else base)
    clean = {k: v for k, v in inherited.items()
             if not k.upper().startswith("FLWR_") or k.upper() in INHERITED_FLOWER_VARIABLES}
    return {**clean, **FLOWER_ENV, **(extra or {})}


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port on ``host`` that nothing listens on right now, and not one of ``avoid``.

    ``avoid``: ports already chosen but not yet listened on (the coordinator's Fleet port while it picks
    its SuperLink's loopback port): the system may hand a just-released port out again, and two
    listeners on one port end the SuperLink at start (seen in CI: "address already in use").
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free TCP port on {host} outside {sorted(avoid)}")


def launcher_argv(component: str, flower_args: list[str], poll_interval: float | None = None,
                  approved_apps: list[str] | tuple[str, ...] | None = None, site: str | None = None,
                  fleet_address: str | None = None, record_dir: str | None = None,
                  run_policy: str | None = None, max_reply_bytes: int | None = None,
                  fleet_keys: str | None = None) -> list[str]:
    """Command line that runs a Flower component under the FedSM launcher.

    ``approved_apps`` (SuperNode): the app hashes it may serve; anything else is refused
    before its payload is pulled (:func:`engine.federation.flower.launch.guard_apps`).
    ``fleet_address`` (SuperLink): where to serve the Fleet API alone, ``record_dir`` where to
    write every fleet request body (:mod:`engine.federation.flower.fleet_listener`).
    """
    argv = [sys.executable, "-m", "engine.federation.flower.launch", component, "--parent-pid", str(os.getpid())]
    if poll_interval is not None:
        argv += ["--poll-interval", str(poll_interval)]
    if approved_apps is not None:
        argv += ["--approved-apps", ",".join(approved_apps)]
    if site is not None:
        argv += ["--site", site]
    if fleet_address is not None:
        argv += ["--fleet-address", fleet_address]
    if record_dir is not None:
        argv += ["--record-dir", record_dir]
    if run_policy is not None:  # SuperNode: JSON {ca_cert, bounds} for the signed run spec
        argv += ["--run-policy", run_policy]
    if max_reply_bytes is not None:  # SuperLink: largest reply a site may upload
        argv += ["--max-reply-bytes", str(int(max_reply_bytes))]
    if fleet_keys is not None:  # SuperLink: enrolled keys, checked from the headers before a body is read
        argv += ["--fleet-keys", fleet_keys]
    return [*argv, "--", *flower_args]


class ChildProcess:
    """A Flower component running as a child of this process.

    Parameters
    ----------
    name
        For messages, e.g. ``"SuperLink"``.
    argv
        Command line (see :func:`launcher_argv`).
    log_path
        File that receives the child's output (appended).
    on_line
        Called with each output line (from a reader thread).
    env
        Extra environment variables. The child inherits this process's environment without
        Flower's own variables (:func:`child_environment`).
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, on_line: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.on_line = on_line
        self.env = child_environment(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=30)
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[3]
        env = dict(self.env)
        # the child must import this very engine, also when it is not installed (a checkout)
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"{self.name}-output")
        self._reader.start()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("a", encoding="utf-8") as out:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                out.write(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {line}\n")
                out.flush()
                self._tail.append(line)
                if self.on_line is not None:
                    try:
                        self.on_line(line)
                    except Exception:  # a broken listener must not stop the log
                        log.exception("output listener of %s failed", self.name)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 12) -> str:
        """The child's last output lines (for error messages)."""
        return "\n".join(list(self._tail)[-lines:])

    def wait_for_port(self, host: str, port: int, timeout: float) -> None:
        """Block until the child listens on ``host:port``; :class:`FedSMError` if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                time.sleep(0.2)  # let the reader thread catch the last lines
                raise FedSMError(f"{self.name} exited with status {self.returncode()} while starting; its last "
                                 f"output ({self.log_path}):\n{self.tail()}")
            if port_open(host, port):
                return
            time.sleep(0.1)
        raise FedSMError(f"{self.name} did not listen on {host}:{port} within {timeout:.0f} s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the child by PID: SIGINT, then SIGTERM, then SIGKILL. Returns its exit status."""
        proc = self.proc
        if proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, timeout), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            if proc.poll() is not None:
                break
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) still running after %s", self.name, proc.pid, signal.Signals(sig).name)
        code = proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        log.info("%s (pid %d) stopped with status %s", self.name, proc.pid, code)
        return code
