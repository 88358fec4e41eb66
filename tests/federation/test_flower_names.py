"""The Flower names FedSM replaces at run time exist in the installed Flower, and its code uses them.

FedSM admits more than one Flower version (pyproject.toml); each replacement in
:mod:`engine.federation.flower.launch` is of a Flower-internal name. A replacement that Flower
no longer reads would drop a property silently (approval before pull, the fleet-only
listener), so these checks run against whichever Flower is installed.
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest

from engine.federation.flower.launch import TESTED_FLOWER, require_names


def test_the_supernode_loop_calls_the_replaced_names_as_module_globals():
    module = importlib.import_module("flwr.supernode.start_client_internal")
    require_names(module, "time", "pull_objects", "_pull_and_store_message", "_insert_message")
    source = inspect.getsource(module)
    # looked up in the module at each call, so the launcher's replacement is the one called
    for call in ("_pull_and_store_message(", "_insert_message(", "time.sleep(", "pull_objects("):
        assert call in source, call


def test_the_superlink_command_serves_its_api_through_the_replaced_function():
    # the package exports a function of the module's name; the module itself is wanted
    module = importlib.import_module("flwr.superlink.cli.flower_superlink")
    require_names(module, "_run_superlink_http_api", "SuperLinkLifespan", "console_handler")
    assert "_run_superlink_http_api(" in inspect.getsource(module.flower_superlink)


def test_a_flower_without_a_replaced_name_is_refused_with_the_tested_versions():
    from engine.federation.flower.launch import guard_apps

    with pytest.raises(SystemExit, match="_insert_message") as refused:
        guard_apps(SimpleNamespace(_pull_and_store_message=lambda **kw: None), [], "site1")
    assert TESTED_FLOWER in str(refused.value)
