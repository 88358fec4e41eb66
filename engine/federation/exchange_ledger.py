"""Outbound ledger of a dialogue method: per exchange, what a site received and sent, and what each tensor is.

One JSON line per request (:class:`engine.federation.inprocess.ExchangeRecord`), with every
tensor's shape, bytes and its meaning from the method's declarations
(:attr:`engine.fl.exchange.ExchangeMethod.REQUEST_CONTENTS` / ``REPLY_CONTENTS``), so a site
operator (or a reviewer) reads "step 17: sent teacher logits (8, 2, 64, 64) and discriminator
scores", not an opaque byte count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.federation.inprocess import ExchangeRecord
    from engine.fl.exchange import ExchangeMethod


def ledger_entry(method: ExchangeMethod, record: ExchangeRecord) -> dict[str, Any]:
    """The ledger's view of one exchange (JSON-able)."""

    def described(shapes: dict[str, tuple[int, ...]], declared: dict[str, str]) -> dict[str, Any]:
        return {name: {"shape": list(shape), "what": declared.get(name, "undeclared")}
                for name, shape in sorted(shapes.items())}

    entry: dict[str, Any] = {
        "method": method.name, "round": record.round, "site": record.site, "action": record.action,
        "received": described(record.request_tensors, method.REQUEST_CONTENTS),
        "sent": described(record.reply_tensors, method.REPLY_CONTENTS),
        "bytes_received": record.bytes_to_site, "bytes_sent": record.bytes_from_site,
    }
    if "step" in record.config:  # e.g. FedIOD's distillation step
        entry["step"] = record.config["step"]
    if record.failed is not None:
        entry["failed"] = record.failed
    return entry


class LedgerWriter:
    """Appends :func:`ledger_entry` lines to a file; call it as the transport's ``recorder``."""

    def __init__(self, method: ExchangeMethod, path: Path) -> None:
        self.method = method
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("w", encoding="utf-8", buffering=1)  # line-buffered: readable while it runs

    def __call__(self, record: ExchangeRecord) -> None:
        self._fh.write(json.dumps(ledger_entry(self.method, record)) + "\n")

    def close(self) -> None:
        self._fh.close()
