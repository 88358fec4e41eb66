"""Start the loopback tests' FedSM processes from a warm interpreter (a fork server).

Every site and coordinator process of a loopback test is a fresh ``python -m engine.cli.main ...``
whose first ~9 CPU-seconds go to importing torch, ``torch._dynamo`` (the first optimizer imports
it) and MONAI, before any FedSM code runs. A CI run starts ~25 of them, on 2 cores, mostly while
the other pytest worker is busy: about a fifth of the suite's CPU time was these imports.

A :class:`WarmStarter` keeps one process per pytest worker that has imported those three
packages and nothing else: no FedSM module, no Flower, no logging configuration, no thread
(Python threads, checked before every fork). Asked to start ``argv``, it forks; the child points its standard
streams at the test's log, takes the test's environment, working folder and ``sys.path`` as a
fresh ``python`` would set them from ``argv`` and ``PYTHONPATH``, and runs the module or script
of ``argv`` as ``__main__`` through :mod:`runpy`, ending with a normal interpreter shutdown
(``atexit`` handlers, flushed streams). What differs from a fresh interpreter: torch, its
compiler front end and MONAI are imported before FedSM's own modules rather than when FedSM first
imports them (FedSM sets no environment that those imports read: ``engine.federation.flower``
sets Flower's, and Flower is not preloaded), and the process's command line is the starter's.
``tests/federation/test_loopback_secure.py`` starts its processes cold, so a real interpreter
start stays covered; ``FEDSM_TESTS_COLD_START=1`` starts every process cold.

The starter is a child of the pytest worker and reaps the processes it forks, recording each exit
status in a file that :class:`WarmProcess` (what the test holds: ``pid``, ``poll``, ``wait``,
``returncode``, as :class:`subprocess.Popen`) reads. It exits when the worker does.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Packages the starter imports before it forks (heavy, and read no FedSM setting when imported).
PRELOAD = ("torch", "torch._dynamo", "monai")
#: How long a test waits for the starter to finish its imports.
READY_TIMEOUT_S = 180.0
COLD_ENV = "FEDSM_TESTS_COLD_START"


def cold_start_forced() -> bool:
    return os.environ.get(COLD_ENV, "") not in ("", "0")


class WarmProcess:
    """A process the starter forked, as the tests use a :class:`subprocess.Popen`."""

    def __init__(self, pid: int, args: list[str], status_dir: Path) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._status = status_dir / str(pid)

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """The test side: starts the starter process on first use, then asks it for processes."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="fedsm-warm-"))
        self.socket_path = self._dir / "starter.sock"
        self.status_dir = self._dir / "status"

    def _ensure_started(self) -> None:
        """Start the starter on first use and wait until it has imported :data:`PRELOAD`."""
        if self._proc is None:
            self.status_dir.mkdir()
            with (self._dir / "starter.log").open("ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, __file__, str(self.socket_path), str(self.status_dir), str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.socket_path.exists():
            if self._proc.poll() is not None:
                raise RuntimeError(f"the warm starter exited ({self._proc.returncode}): "
                                   f"{(self._dir / 'starter.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the warm starter was not ready within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def start(self, argv: list[str], log: Path, cwd: Path, env: dict[str, str], stdin: bytes | None
              ) -> WarmProcess | None:
        """Fork ``argv``; None when the starter cannot (then the caller starts it cold)."""
        if argv[0] != sys.executable or len(argv) < 2:
            return None
        self._ensure_started()
        stdin_file = None
        if stdin is not None:
            fd, name = tempfile.mkstemp(dir=self._dir, prefix="stdin-")
            os.write(fd, stdin)
            os.close(fd)
            stdin_file = name
        request = {"argv": argv, "log": str(log), "cwd": str(cwd), "env": env, "stdin": stdin_file}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            conn.connect(str(self.socket_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(_read_line(conn))
        if "pid" not in reply:
            print(f"warm start refused ({reply.get('why')}); starting cold", file=sys.stderr)
            return None
        return WarmProcess(int(reply["pid"]), argv, self.status_dir)

    def close(self) -> None:
        """Stop the starter and remove its folder (socket, exit statuses, standard inputs, its log)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


# ------------------------------------------------------------------------------------------------
# The starter process
# ------------------------------------------------------------------------------------------------
def _threads() -> int:
    """Python threads of the starter (it forks only with one).

    The native thread pools of the BLAS libraries that numpy and scipy load (OpenBLAS starts its
    idle workers on import) are not counted: they register ``pthread_atfork`` handlers, which is
    what makes Python's ``fork`` start method (Linux's default through 3.13) safe after numpy.
    """
    import threading

    return threading.active_count()


def _write_status(status_dir: Path, pid: int, wait_status: int) -> None:
    code = os.waitstatus_to_exitcode(wait_status)  # negative signal number, as Popen.returncode
    tmp = status_dir / f".{pid}.tmp"
    tmp.write_text(str(code))
    os.replace(tmp, status_dir / str(pid))


def _reap(status_dir: Path) -> None:
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write_status(status_dir, pid, wait_status)


def _become(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked child: turn into ``request['argv']`` run by a fresh interpreter; never returns."""
    import runpy

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stdin_fd = os.open(request["stdin"] or os.devnull, os.O_RDONLY)
    os.dup2(stdin_fd, 0)
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(stdin_fd)
    os.close(log_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"][1:]
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    code: Any = 0
    try:
        if argv[0] == "-m":
            sys.path[:] = [request["cwd"], *python_path, *base_path]
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.path[:] = [os.path.dirname(script), *python_path, *base_path]
            sys.argv = [argv[0], *argv[1:]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # a normal interpreter shutdown from here: atexit handlers, non-daemon threads, flushed streams
    raise SystemExit(code)


def serve(socket_path: Path, status_dir: Path, parent: int) -> None:
    import gc
    import importlib

    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    for name in PRELOAD:
        importlib.import_module(name)
    # keep what the imports built out of the collector's generations: a child's first collections then
    # do not touch (and copy) every page the starter holds
    gc.collect()
    gc.freeze()
    me = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path) + ".tmp")
    listener.listen(16)
    os.replace(str(socket_path) + ".tmp", socket_path)  # ready
    while True:
        _reap(status_dir)
        if os.getppid() != parent:
            return
        ready, _, _ = select.select([listener], [], [], 0.05)
        if not ready:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(_read_line(conn))
            if _threads() != 1:
                conn.sendall(json.dumps({"why": f"{_threads()} Python threads in the starter"}).encode() + b"\n")
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                assert os.getpid() != me
                _become(request, base_path)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
