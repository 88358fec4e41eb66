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



#: Test files that start whole loopback federations (a coordinator, its SuperLink, and a SuperNode and
#: site process per site: ~8 processes importing torch, MONAI and Flower) run one after another on a
#: single pytest-xdist worker, never two federations beside each other on CI's 2 cores; the other
#: worker takes the rest of the suite (``-n 2`` in pyproject.toml), including the in-process federation
#: tests. (Two serial groups, one per worker, measured no faster: the suite is CPU-bound, ~1,000 CPU-s
#: in ~580 s on 2 cores, and two federations at once only stretch each one's waits.) Every other module
#: also stays on one worker (a fuzz module's last test checks what its other tests counted). A new
#: end-to-end federation test belongs in a ``test_loopback_*.py`` file.
SERIAL_GROUPS = (("tests/federation/test_loopback_", "federations"),)

#: pytest-timeout's bound for a test that starts federation processes or is marked ``slow`` (the
#: default, ``timeout`` in pyproject.toml, bounds every other test). Generous: these tests wait on
#: SuperLink, SuperNodes and several rounds of training, and on a busy 2-core machine take several
#: times their idle duration; a hang still ends well inside CI's 90 minutes.
LONG_TIMEOUT_S = 600
#: Folders whose tests all get :data:`LONG_TIMEOUT_S` (the federation's, in-process or not, wait on rounds).
LONG_TIMEOUT_DIRS = ("tests/federation/",)


#: Hard bound on the whole session, in the controlling process: after this many seconds it prints every
#: thread's stack and exits with status 1, whatever is stuck (a test, a worker, pytest-xdist itself).
#: A normal run takes 6-10 minutes on 2 cores and up to ~25 on a busy machine; CI allows 90.
SESSION_LIMIT_S = 45 * 60


def pytest_configure(config):
    """In the controlling process (not in pytest-xdist's workers): start the session's watchdog, and let
    every process of the session cache the bytecode it compiles.

    The suite starts ~150 Python processes (sites, coordinators, CLI runs) that import torch, MONAI and
    Flower; one that finds no bytecode compiles them again (~15 CPU-s for the whole stack). Where
    ``PYTHONDONTWRITEBYTECODE`` is set, as on CI's machines, none of them would cache what it compiles.
    The test command installs with ``pip install --no-compile``: pip compiles every installed file on
    one core (~45 s of the install, ~12,000 files), while the suite imports ~5,000 of them. Here,
    before pytest-xdist starts its workers, the environment they and their processes inherit lets the
    first import of a module cache its bytecode for every later process. Measured from clean clones:
    install 64-74 s instead of 110-125 s; compiling every installed file here instead, on both cores,
    took 48 s more in all. Only caches are written (``__pycache__``, ignored by git).
    """
    import faulthandler
    import sys

    if not hasattr(config, "workerinput"):
        faulthandler.dump_traceback_later(SESSION_LIMIT_S, exit=True, file=sys.__stderr__)
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        sys.dont_write_bytecode = False


def pytest_unconfigure(config):
    import faulthandler

    if not hasattr(config, "workerinput"):
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collect (importing torch, MONAI, Qt and Flower in every worker) with the garbage collector paused, as the
    product's processes import them (:mod:`engine.startup`)."""
    from engine.startup import collector_paused

    with collector_paused():
        return (yield)


def pytest_collection_modifyitems(config, items):
    """Give the federation and slow tests their longer bound unless a test sets its own, and put the
    longest work first (:func:`heaviest_first`)."""
    for item in items:
        long = item.nodeid.startswith(LONG_TIMEOUT_DIRS) or item.get_closest_marker("slow") is not None
        if long and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))
    items[:] = heaviest_first(items)


def heaviest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The collection reordered by file: the loopback federations (:data:`SERIAL_GROUPS`), then files
    with a ``slow`` test, then the rest; each file's tests stay together and in their order.

    pytest-xdist hands out whole files in this order (:func:`pytest_xdist_make_scheduler`), so the
    suite ends on short files and both workers finish together. By default it would order files by
    how many tests they hold, which put the one-test, minute-long benchmark smoke test last and
    left the other worker idle for most of that minute.
    """
    def rank(item: pytest.Item) -> int:
        if item.nodeid.startswith(tuple(prefix for prefix, _ in SERIAL_GROUPS)):
            return 0
        return 1 if item.path in slow_files else 2

    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    return sorted(items, key=rank)  # stable: within a rank, the collection's order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's per-file scheduling, with the files of each of ``SERIAL_GROUPS`` as one scope."""
    from xdist.scheduler import LoadFileScheduling

    class FederationTogether(LoadFileScheduling):
        def schedule(self) -> None:
            # files in the collection's order (heaviest_first), not sorted by their number of tests
            self.config.option.loadscopereorder = False
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in SERIAL_GROUPS:
                if nodeid.startswith(prefix):
                    return group
            return super()._split_scope(nodeid)

    return FederationTogether(config, log)
