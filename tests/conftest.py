"""Shared fixtures: small random site data and a fast local-training configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Keep Flower-free, display-free, deterministic defaults for every test process.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")



@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Run every test with one torch thread.

    The test networks are tiny and gain nothing from threads, while OpenMP threads spinning
    against other processes on a small shared machine make a forward pass up to 100x slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def restore_root_logging() -> Iterator[None]:
    """Remove the logging handlers a test added to the root logger (a CLI ``main()`` run in-process adds
    one bound to the test's captured stderr, which is closed afterwards: every later log line of the
    same worker then printed a '--- Logging error ---' traceback)."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


@pytest.fixture
def tiny_training():
    from engine.fl.local_training import LocalTrainingConfig

    return LocalTrainingConfig(epochs=1, batch_size=4, lr=1e-3, selector_lr=1e-4, selector_size=32, device="cpu")



#: Tests that start federation processes (SuperLink, SuperNodes, sites) or time them run one after
#: another on a single pytest-xdist worker, never beside each other, while the other worker takes
#: the rest of the suite (``-n 2`` in pyproject.toml). Every other module also stays on one worker
#: (a fuzz module's last test checks what its other tests counted).
SERIAL_GROUP_DIRS = ("tests/federation/",)

#: pytest-timeout's bound for a test that starts federation processes or is marked ``slow`` (the
#: default, ``timeout`` in pyproject.toml, bounds every other test). Generous: these tests wait on
#: SuperLink, SuperNodes and several rounds of training, and on a busy 2-core machine take several
#: times their idle duration; a hang still ends well inside CI's 90 minutes.
LONG_TIMEOUT_S = 600


#: Hard bound on the whole session, in the controlling process: after this many seconds it prints every
#: thread's stack and exits with status 1, whatever is stuck (a test, a worker, pytest-xdist itself).
#: A normal run takes 6-10 minutes on 2 cores and up to ~25 on a busy machine; CI allows 90.
SESSION_LIMIT_S = 45 * 60


def pytest_configure(config):
    """Start the session's watchdog in the controlling process (not in pytest-xdist's workers)."""
    import faulthandler
    import sys

    if not hasattr(config, "workerinput"):
        faulthandler.dump_traceback_later(SESSION_LIMIT_S, exit=True, file=sys.__stderr__)


def pytest_unconfigure(config):
    import faulthandler

    if not hasattr(config, "workerinput"):
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    """Give the federation and slow tests their longer bound unless a test sets its own."""
    for item in items:
        long = item.nodeid.startswith(SERIAL_GROUP_DIRS) or item.get_closest_marker("slow") is not None
        if long and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's per-file scheduling, with all of ``SERIAL_GROUP_DIRS`` as one scope."""
    from xdist.scheduler import LoadFileScheduling

    class FederationTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for folder in SERIAL_GROUP_DIRS:
                if nodeid.startswith(folder):
                    return folder
            return super()._split_scope(nodeid)

    return FederationTogether(config, log)
