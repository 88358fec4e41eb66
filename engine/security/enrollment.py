"""The coordinator's register of enrolled sites: one public key per site name.

Enrolling a site stores its public key as ``<enrolled_dir>/<site>.pub.pem``. When the
coordinator starts, every configured site's key is registered with the SuperLink; the
SuperLink then accepts only requests signed by a registered key, and the node identity that
Flower gives each key is what the coordinator addresses that site's messages to. A site
without an enrolled key cannot join; a stranger's key never gets a node identity.
"""

from __future__ import annotations

from pathlib import Path

from engine.bundle import check_site_name
from engine.errors import ConfigError
from engine.security.certs import key_fingerprint, load_public_key, public_key_pem, write_public


def enrolled_key_path(enrolled_dir: Path, site: str) -> Path:
    """Where site ``site``'s public key is kept."""
    return Path(enrolled_dir) / f"{site}.pub.pem"


def enroll_site(enrolled_dir: Path, site: str, public_key: Path, force: bool = False) -> str:
    """Register ``site``'s public key with the coordinator; return the key's fingerprint.

    Raises
    ------
    ConfigError
        When the site name is not allowed, the key is not a usable public key, the site is
        already enrolled with another key (without ``force``), or another site has this key.
    """
    check_site_name(site)
    key = load_public_key(public_key)
    pem = public_key_pem(key)
    target = enrolled_key_path(enrolled_dir, site)
    for other, other_pem in enrolled_keys(enrolled_dir).items():
        if other != site and other_pem == pem:
            raise ConfigError(f"this key is already enrolled for site {other!r}; every site needs its own key "
                              "(create one with 'fedsm certs site')")
    if target.exists() and target.read_bytes() != pem and not force:
        raise ConfigError(f"site {site!r} is already enrolled with another key ({target}); pass --force to replace "
                          "it, after checking the new key's fingerprint with the site")
    write_public(target, pem)
    return key_fingerprint(key)


def remove_site(enrolled_dir: Path, site: str) -> None:
    """Withdraw ``site``'s enrolment (it cannot connect after the coordinator restarts)."""
    target = enrolled_key_path(enrolled_dir, site)
    if not target.exists():
        raise ConfigError(f"site {site!r} is not enrolled (no {target})")
    target.unlink()


def enrolled_keys(enrolled_dir: Path) -> dict[str, bytes]:
    """Enrolled sites and their public keys (PEM bytes), by site name."""
    folder = Path(enrolled_dir)
    if not folder.is_dir():
        return {}
    out: dict[str, bytes] = {}
    for path in sorted(folder.glob("*.pub.pem")):
        if path.name.startswith("."):  # a key being written (engine.io.atomic's temporary file), not a site
            continue
        out[path.name[: -len(".pub.pem")]] = public_key_pem(load_public_key(path))
    return out
