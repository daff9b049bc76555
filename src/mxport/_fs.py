"""File-system safety of outputs: atomic file writes (a temporary sibling and a rename), output folders built
under a findable temporary name and swapped into place, stale temporaries of killed runs cleaned, outputs that
would clobber their own source refused, and "cannot write here" errors (disk full, read-only, ...) turned into
one clear :class:`OutputError`."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: kinds of temporary siblings of an output folder ``out``: ``.<out.name>.mxport-tmp-<pid>-<8 chars>`` (being
#: built) and ``.<out.name>.mxport-old-<pid>-<8 chars>`` (the replaced output, during an overwrite)
TMP_KIND, OLD_KIND = "mxport-tmp", "mxport-old"

#: errnos that mean the output cannot be written where asked (the place, not mxport): reported in one line
OUTPUT_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system",
    errno.EROFS: "read-only file system",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "file name too long",
}


class OutputError(OSError, ValueError):
    """The output cannot be written (disk full, read-only file system, symlink loop, ...): an ``OSError`` with
    ``errno`` and ``filename``, and a ``ValueError`` (bad output place: the CLI's exit code 2). ``str()`` is
    one line naming the path and the reason."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


@contextlib.contextmanager
def output_errors(out: str | os.PathLike) -> Iterator[None]:
    """Turn an ``OSError`` with one of :data:`OUTPUT_ERRNOS` raised inside into an :class:`OutputError` naming
    ``out`` (and the file, when the error has one)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        reason = OUTPUT_ERRNOS.get(exc.errno)
        if reason is None:
            raise
        where = f" ({str(exc.filename)!r})" if exc.filename and str(exc.filename) != str(out) else ""
        raise OutputError(exc.errno, f"cannot write {str(out)!r}: {reason}{where}", str(out)) from exc


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the process umask (``tempfile.mkstemp`` makes 0o600
    files, which other users could not read once renamed into place)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def mkstemp_like_open(path: Path, suffix: str = "") -> tuple[int, str]:
    """A temporary sibling of ``path`` (``tempfile.mkstemp`` in its folder) with the mode a plain ``open()``
    gives; nothing is left behind when that fails."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.fchmod(fd, default_file_mode())
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd, tmp


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename (the file gets the
    mode a plain ``open()`` would give it). Missing parent folders are created. The temporary file is removed
    on any failure; a full disk, read-only file system, ... raise :class:`OutputError`."""
    path = Path(path)
    with output_errors(path):
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


# -- output folders ------------------------------------------------------------------------------------------


def _temp_pattern(out: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(out.name)}\.({TMP_KIND}|{OLD_KIND})-(\d+)-[a-z0-9_]{{8}}")


def make_temp_dir(out: Path) -> Path:
    """A new empty folder next to ``out`` to build it in: ``.<name>.mxport-tmp-<pid>-<random>``, found and
    removed by :func:`clean_stale_temps` if this process dies before it is renamed into place."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{TMP_KIND}-{os.getpid()}-", dir=out.parent))


@contextlib.contextmanager
def temp_output_dir(out: Path) -> Iterator[Path]:
    """Create ``out``'s parent folders and a :func:`make_temp_dir` to build ``out`` in; on any exception
    inside (KeyboardInterrupt included) the temporary folder is removed, and "cannot write here" errors are
    raised as :class:`OutputError` (:func:`output_errors`). The caller renames it into place
    (:func:`replace_dir`)."""
    with output_errors(out):
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:  # a component of the path is a file or a broken link
            raise OutputError(errno.ENOTDIR, f"cannot write {str(out)!r}: {str(exc.filename)!r} exists and "
                                             "is not a directory", str(out)) from None
        tmp = make_temp_dir(out)
        try:
            yield tmp
        except BaseException:
            _remove(tmp)
            raise


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists (another user's)
        return True
    return True


def stale_temps(out: Path) -> list[tuple[str, Path]]:
    """``(kind, path)`` of temporaries of ``out`` left by dead processes: exactly our name pattern, a real
    folder (not a link), owned by this user, whose pid is no longer running. Oldest first."""
    pattern, found = _temp_pattern(out), []
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.is_dir(follow_symlinks=False) and st.st_uid == os.getuid() and not _pid_alive(int(match[2])):
            found.append((st.st_mtime, match[1], Path(entry.path)))
    return [(kind, path) for _, kind, path in sorted(found)]


def _remove(path: Path) -> None:
    """Remove a folder tree, or just the link when ``path`` is a symlink (never what it points to)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def clean_stale_temps(out: Path) -> list[str]:
    """Recover from a killed run into ``out``: when ``out`` is missing and a replaced output (``mxport-old``)
    of a dead process is left, it is renamed back to ``out`` (an overwrite that died between its two renames);
    every other stale temporary (:func:`stale_temps`) is removed. Returns one line per action."""
    done = []
    stale = stale_temps(out)
    if not os.path.lexists(out):
        olds = [p for kind, p in stale if kind == OLD_KIND]
        if olds:
            os.rename(olds[-1], out)
            done.append(f"restored {str(out)!r} from {olds[-1].name} (an interrupted overwrite)")
            stale = [(k, p) for k, p in stale if p != olds[-1]]
    for _, path in stale:
        _remove(path)
        done.append(f"removed {path.name} (left by a killed run)")
    return done


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux ``renameat2(RENAME_EXCHANGE)``; False where that is not available
    (no such call, or a file system that does not support it)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out`` (same parent). An existing ``out`` is swapped with ``tmp``
    in one atomic ``renameat2(RENAME_EXCHANGE)`` where the system has it; elsewhere it is first renamed to
    ``.<name>.mxport-old-<pid>-<random>``, then ``tmp`` takes its place, then the old copy is removed. A crash
    at any point leaves either ``out`` complete or that old copy, which :func:`clean_stale_temps` renames
    back."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    if _rename_exchange(tmp, out):
        _remove(tmp)  # now the old output
        return
    old = Path(tempfile.mktemp(prefix=f".{out.name}.{OLD_KIND}-{os.getpid()}-", dir=out.parent))
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    _remove(old)


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def _absolute(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path)))


def check_output_place(out: str | os.PathLike, source: str | os.PathLike | None = None) -> None:
    """Refuse an output folder that would clobber what the user did not ask to replace, compared on real paths
    (symlinks resolved) and on the paths as named: ``out`` that is, contains or lies inside ``source`` (a file
    or folder), and ``out`` that is or contains the current directory, the home directory or ``/``.

    Raises ValueError naming the paths.
    """
    real_out = _real(out)
    if source is not None:
        real_src = _real(source)
        what = f"the source {'directory' if real_src.is_dir() else 'file'} {str(source)!r}"
        # real paths (links resolved) and the paths as named (a link to the source is the source, too)
        for o, s in ((real_out, real_src), (_absolute(out), _absolute(source))):
            for clash, relation in ((o == s, "is"), (o in s.parents, "contains"),
                                    (s in o.parents, "lies inside")):
                if clash:
                    raise ValueError(f"output {str(out)!r} {relation} {what}; "
                                     "write the export somewhere else")
    for what, place in (("the current directory", Path.cwd()), ("the home directory", Path.home()),
                        ("the root directory", Path("/"))):
        real_place = _real(place)
        if real_out == real_place or real_out in real_place.parents:
            raise ValueError(f"output {str(out)!r} is or contains {what} ({str(place)!r}); "
                             "write the export into a folder of its own")
