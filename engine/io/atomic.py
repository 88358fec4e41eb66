"""Atomic file writes: a reader never sees a half-written file, a crash never leaves one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it onto ``target`` on success.

    The temporary file keeps ``target``'s suffixes so writers that pick a format from the
    name (nibabel, Pillow) behave the same. On any exception the temporary file is removed
    and ``target`` is left as it was. Its name starts with ``.``: a reader that lists a folder
    another process writes into by suffix (``*.settings.json``, ``*.pub.pem``) sees it while it
    is written and must skip it (``pathlib``'s glob matches dot-files).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = "".join(target.suffixes)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=f".tmp{suffix}", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(target: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``target`` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(target: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``target`` atomically."""
    write_bytes_atomic(target, text.encode("utf-8"))
