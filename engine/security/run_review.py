"""What a site's operator reviews before the site trains for a run: its signed settings against the site's bounds.

A ``fedsm site --confirm-runs`` process (the desktop app starts its site this way) announces
each new run's verified settings in a ``run_settings`` event with ``confirm: true`` and the
site's ``[bounds]``, then waits for one line on its standard input: ``accept`` lets the site
train for that run, anything else (or the end of input) declines it, and the coordinator
gets an error reply before a byte of the run's payload is pulled.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from engine.security.run_spec import SiteBounds

#: The line that accepts a run on a ``--confirm-runs`` site's standard input.
ACCEPT = "accept"
#: ... and the line the desktop app sends to decline one.
DECLINE = "decline"


def review_rows(shown: Mapping[str, Any], bounds: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per reviewed setting: ``{"setting", "value", "bound", "ok"}``.

    ``shown`` is a ``run_settings`` event's ``settings`` (:func:`engine.security.run_spec.describe`),
    ``bounds`` its ``bounds`` (the site's ``[bounds]`` as :func:`engine.security.run_spec.bounds_dict`
    gives them; missing keys take their defaults).
    """
    b = SiteBounds.from_dict(dict(bounds))
    rows: list[dict[str, Any]] = []
    method = shown.get("method")
    allowed = b.allowed_methods
    rows.append({"setting": "method", "value": method,
                 "bound": "any method" if allowed is None else "one of " + ", ".join(allowed),
                 "ok": isinstance(method, str) and (allowed is None or method in allowed)})
    if method == "fedsm":
        # the rule decides what the site keeps and what it sends (docs/federation.md, "What leaves a site")
        rule = shown.get("personalization", "softpull")
        rules = b.allowed_personalizations
        rows.append({"setting": "personalization", "value": rule,
                     "bound": "any rule" if rules is None else "one of " + ", ".join(rules),
                     "ok": isinstance(rule, str) and (rules is None or rule in rules)})
    for key, bound, above in (("rounds", b.max_rounds, True), ("epochs", b.max_epochs, True),
                              ("lr", b.max_lr, True), ("selector_lr", b.max_selector_lr, True),
                              ("image_size", b.max_image_size, True), ("batch_size", b.max_batch_size, True),
                              ("batch_size", b.min_batch_size, False)):
        value = shown.get(key)
        if value is None and key in ("selector_lr", "epochs"):
            continue  # not part of this run's settings (the method's default applies)
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = number and (value <= bound if above else value >= bound)
        rows.append({"setting": key, "value": value, "bound": f"{'≤' if above else '≥'} {bound:g}", "ok": bool(ok)})
    signed = bool(shown.get("signed"))
    rows.append({"setting": "signature", "value": "signed by the coordinator" if signed else "not signed (insecure)",
                 "bound": "certified by the federation CA", "ok": signed})
    rows.append({"setting": "app", "value": shown.get("app_hash"), "bound": "in approved_apps", "ok": True})
    return rows


def stdin_confirmation(stream: TextIO | None = None) -> Callable[[Mapping[str, Any]], bool]:
    """A ``confirm(settings)`` that waits for :data:`ACCEPT` (accept) or any other line (decline) on ``stream``."""
    def confirm(settings: Mapping[str, Any]) -> bool:
        line = (stream or sys.stdin).readline()
        return line.strip().lower() == ACCEPT

    return confirm


__all__ = ["ACCEPT", "DECLINE", "review_rows", "stdin_confirmation"]
