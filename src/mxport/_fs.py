"""Atomic file-system writes: a file through a temporary sibling and a rename; a folder swapped into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the process umask (``tempfile.mkstemp`` makes 0o600 files,
    which other users could not read once renamed into place)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def mkstemp_like_open(path: Path, suffix: str = "") -> tuple[int, str]:
    """A temporary sibling of ``path`` (``tempfile.mkstemp`` in its folder) with the mode a plain ``open()`` gives."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.fchmod(fd, default_file_mode())
    return fd, tmp


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename (the file gets the mode
    a plain ``open()`` would give it). Missing parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp_like_open(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed only
    after the rename, so at every moment one complete copy exists (``tmp`` and ``out`` share a parent)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, trash / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(trash / out.name, out)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)
