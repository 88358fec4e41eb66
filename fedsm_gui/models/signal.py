"""A tiny Qt-free signal, so state objects can announce changes without importing Qt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Signal:
    """A list of callbacks called in order by :meth:`emit`.

    State objects own one per kind of change; controllers connect to them. Callbacks run
    synchronously on the thread that changes the state (always the GUI thread in the app).
    """

    def __init__(self) -> None:
        self._slots: list[Callable[..., Any]] = []

    def connect(self, slot: Callable[..., Any]) -> None:
        """Call ``slot(*args)`` on every :meth:`emit` (connecting twice calls it twice)."""
        self._slots.append(slot)

    def disconnect(self, slot: Callable[..., Any]) -> None:
        """Stop calling ``slot``; unknown slots are ignored."""
        if slot in self._slots:
            self._slots.remove(slot)

    def emit(self, *args: Any) -> None:
        """Call every connected slot with ``args``."""
        for slot in list(self._slots):
            slot(*args)
