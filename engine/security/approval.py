"""App approval: a site runs only a Flower app whose hash it pinned in ``site.toml``.

With plain Flower, whoever can reach a coordinator's control API can start a run with any app
bundle (FAB), and every connected SuperNode would download and execute its code. FedSM closes
this twice: the control API listens on the coordinator's loopback interface only, and a site
checks the SHA-256 of every FAB it is asked to serve against ``approved_apps`` in its
``site.toml`` and answers anything else with an error, before any of it is used. (The site
never imports code from a FAB anyway: its ClientApp is the installed engine.)

Hashes are written ``sha256:<64 hex digits>``; ``fedsm certs app-hash`` prints the hash of
the app this installation builds, and a refusal names the hash it refused.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from engine.errors import ConfigError

_HASH = re.compile(r"^(sha256:)?([0-9a-fA-F]{64})$")


def normalise_app_hash(value: object) -> str:
    """``sha256:<lowercase hex>`` from ``sha256:<hex>`` or bare hex; :class:`ConfigError` otherwise."""
    match = _HASH.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"approved app {value!r} is not a SHA-256 app hash; write it as 'sha256:' followed by "
                          "64 hexadecimal digits (the coordinator prints it; 'fedsm certs app-hash' shows yours)")
    return "sha256:" + match.group(2).lower()


def app_hash(fab: bytes) -> str:
    """The hash a site pins: ``sha256:`` + SHA-256 of the FAB's bytes (Flower's FAB hash)."""
    return "sha256:" + hashlib.sha256(fab).hexdigest()


class AppNotApproved(ConfigError):
    """A site was asked to serve an app whose hash it has not approved."""


def check_app_approved(fab: bytes, approved: Iterable[str], site: str) -> str:
    """Return the FAB's hash if ``approved`` lists it, else raise :class:`AppNotApproved`.

    The hash is computed here from the bytes received, never taken from the sender's label.
    """
    digest = app_hash(fab)
    allowed = {normalise_app_hash(a) for a in approved}
    if digest not in allowed:
        raise AppNotApproved(
            f"site {site} refused app {digest}: it is not in approved_apps of its site.toml. If the coordinator "
            "confirms this is the FedSM app it runs, add the hash to approved_apps and restart the site")
    return digest
