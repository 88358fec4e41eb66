"""How many CPU threads torch may use: the cores this process may run on that are not busy.

torch starts one intra-op thread per core it sees. On a machine whose cores are shared (other
users, other jobs, a CI runner) those threads spin waiting for each other and a job that needs
30 CPU seconds takes hundreds. :func:`free_cores` counts the cores of this process's CPU
affinity (``os.sched_getaffinity``, which honours ``taskset`` and container CPU sets) minus
the one-minute load average of the other work; :func:`use_free_cores` hands that to torch. An
explicit ``OMP_NUM_THREADS`` wins over the free cores: whoever set it knows the machine.

A command's ``--threads N`` (:func:`use_threads`) wins over both, for the rest of the process:
later :func:`use_free_cores` calls (inference calls it when it loads a model) keep ``N``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

from engine.errors import ConfigError

log = logging.getLogger(__name__)


def _affinity_cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # macOS, Windows
        return max(os.cpu_count() or 1, 1)


def _load_average() -> float:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # Windows
        return 0.0


def free_cores(cores: Callable[[], int] = _affinity_cores, load: Callable[[], float] = _load_average,
               own_threads: int = 0) -> int:
    """Cores available to this process that other work is not using, at least 1.

    Parameters
    ----------
    cores, load
        Sources of the core count and the one-minute load average (tests pass their own).
    own_threads
        Threads of this process already counted in the load average (busy before the call).
    """
    total = max(int(cores()), 1)
    busy_elsewhere = max(float(load()) - own_threads, 0.0)
    # rounded, so that a lingering 0.3 from a finished job does not take a core away
    return int(min(max(total - math.floor(busy_elsewhere + 0.5), 1), total))


#: The thread count this process was told to use (a command's ``--threads``); ``None``: follow the free cores.
_chosen: int | None = None


def use_threads(threads: int | None, environ: dict[str, str] | None = None, **kwargs: object) -> int:
    """Set torch's intra-op threads for this process's command; return the count.

    ``threads`` (a command's ``--threads N``, at least 1) is kept for the rest of the process:
    later :func:`use_free_cores` calls return it instead of counting free cores. ``None`` forgets
    any earlier choice and uses :func:`use_free_cores` (``OMP_NUM_THREADS`` when set, else the
    cores other work is not using).
    """
    global _chosen
    if threads is None:
        _chosen = None
        return use_free_cores(environ, **kwargs)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads must be a whole number >= 1, got {threads!r}")
    _chosen = threads
    return use_free_cores(environ, **kwargs)


def use_free_cores(environ: dict[str, str] | None = None, **kwargs: object) -> int:
    """Set torch's intra-op threads to the count :func:`use_threads` chose, else ``OMP_NUM_THREADS``, else
    :func:`free_cores`; return the count."""
    import torch

    env = os.environ if environ is None else environ
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if _chosen is not None:
        threads = _chosen
    elif explicit.isdigit() and int(explicit) > 0:
        threads = int(explicit)
    else:
        threads = free_cores(**kwargs)  # type: ignore[arg-type]
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("torch uses %d CPU thread(s) (%d core(s) in this process's affinity, load %.2f)", threads,
                 _affinity_cores(), _load_average())
    return threads
