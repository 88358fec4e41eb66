"""Turning exceptions from engine calls into sentences for the window."""

from __future__ import annotations

import logging

from engine.errors import CancelledError, FedSMError

log = logging.getLogger(__name__)


def user_message(exc: BaseException) -> str:
    """What to show the user for ``exc``.

    Engine errors already say what is wrong and what to do; anything else is a bug or an
    environment problem, logged with its traceback and shown as one line.
    """
    if isinstance(exc, FedSMError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "not enough memory for this study; close other programs or open a smaller series"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({exc.filename or 'file'}); check the path and permissions"
    log.error("unexpected error", exc_info=(type(exc), exc, exc.__traceback__))
    return f"unexpected error ({type(exc).__name__}: {exc}); details are in the log"


def is_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` means the user cancelled."""
    return isinstance(exc, CancelledError)
