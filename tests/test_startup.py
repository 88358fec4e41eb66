"""engine.startup: imports with the garbage collector paused, and what they built frozen."""

from __future__ import annotations

import gc
import importlib
import sys

from engine.startup import collector_paused


def test_the_collector_is_off_inside_and_back_on_after_even_after_an_error():
    assert gc.isenabled()
    try:
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():  # nested: leaves it off for the outer block
                assert not gc.isenabled()
            assert not gc.isenabled()
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.isenabled()


def test_a_block_that_imports_freezes_what_exists_and_one_that_does_not_freezes_nothing(tmp_path, monkeypatch):
    (tmp_path / "startup_probe_module.py").write_text("DATA = [[k] for k in range(1000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = gc.get_freeze_count()
    with collector_paused():  # nothing imported: the garbage the process holds now must not become permanent
        assert not gc.isenabled()
    assert gc.get_freeze_count() == before
    with collector_paused():
        module = importlib.import_module("startup_probe_module")
    assert gc.get_freeze_count() >= before + len(module.DATA)  # the module's objects left the collected heap
    monkeypatch.delitem(sys.modules, "startup_probe_module")


def test_a_paused_collector_is_left_paused():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
