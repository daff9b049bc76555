"""Atomic writes give files the mode a plain open() gives (not mkstemp's 0o600), so reports and cached models
are readable by other users (found by a fresh-clone trial: `mxport refit --json FILE` wrote a 0o600 file)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mxport import _fs
from mxport._fs import (
    OutputError,
    atomic_write_text,
    clean_stale_temps,
    default_file_mode,
    replace_dir,
    stale_temps,
)


def test_atomic_write_text_uses_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        assert default_file_mode() == 0o644
        path = tmp_path / "sub" / "report.json"  # a missing parent folder is created
        atomic_write_text(path, '{"ok": true}')
        assert path.read_text() == '{"ok": true}'
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o077)
        atomic_write_text(path, "again")  # replaces the file, with the mode of the current umask
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "again"
        assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temporary file left
    finally:
        os.umask(old)


# -- output folders: place checks, temporaries, overwrite swap, "cannot write here" errors -------------------

@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    from mxport.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("fs") / "m", hidden=64, intermediate=64, layers=1)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_output_that_is_contains_or_lies_inside_the_source_is_refused(tiny_src, tmp_path, monkeypatch):
    """`mxport export ./m -o . --overwrite` deleted ./m: an output that is, contains or lies inside the source
    (real paths, symlinks too) is refused with exit 2 and the source is untouched."""
    from mxport.checkpoint.export import export_checkpoint
    from mxport.cli import app

    work = tmp_path / "w"
    work.mkdir()
    src = work / "m"
    src.symlink_to(tiny_src, target_is_directory=True)
    monkeypatch.chdir(work)
    before = sorted(p.name for p in tiny_src.iterdir())
    res = CliRunner().invoke(app, ["export", "./m", "-o", ".", "--overwrite"])
    assert res.exit_code == 2, res.output
    assert "contains the source directory" in res.output
    for out, relation in ((tiny_src.parent, "contains"), (tiny_src, "is"), (tiny_src / "q", "lies inside"),
                          (src, "is"), (src / "sub" / "q", "lies inside")):
        with pytest.raises(ValueError, match=f"{relation} the source directory"):
            export_checkpoint(str(src), out, overwrite=True)
    link_into_src = work / "alias"
    link_into_src.symlink_to(tiny_src / "x")  # not there yet: resolves to a path inside the source
    with pytest.raises(ValueError, match="lies inside the source directory"):
        export_checkpoint(str(tiny_src), link_into_src, overwrite=True)
    with pytest.raises(ValueError, match="is or contains the current directory"):
        export_checkpoint(str(tiny_src), work.parent, overwrite=True)
    assert sorted(p.name for p in tiny_src.iterdir()) == before
    gguf = work / "d" / "model.gguf"  # a file source: an output containing it is refused before loading
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="contains the source file"):
        export_checkpoint(str(gguf), gguf.parent, overwrite=True)
    assert gguf.read_bytes() == b"GGUF"


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.ELOOP])
@pytest.mark.parametrize("where", ["write", "rename", "mkdtemp"])
def test_cannot_write_errors_are_one_line_and_leave_nothing(tiny_src, tmp_path, monkeypatch, err, where):
    """ENOSPC / EFBIG / EROFS / ELOOP raised while writing, renaming into place or creating the temporary
    folder: one-line OutputError (a ValueError: CLI exit 2) naming the output and the reason; no temporary
    left; an existing output (overwrite) untouched."""
    from mxport.checkpoint import export as ex
    from mxport.checkpoint.writers import ShardedSafetensorsWriter
    from mxport.cli import app

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous export")

    def boom(*a, **k):
        raise OSError(err, os.strerror(err), str(tmp_path / "out.file"))

    target = {"write": (ShardedSafetensorsWriter, "write_part"), "rename": (ex, "replace_dir"),
              "mkdtemp": (_fs, "make_temp_dir")}[where]
    monkeypatch.setattr(*target, boom)
    with pytest.raises(OutputError) as info:
        ex.export_checkpoint(str(tiny_src), out, overwrite=True)
    msg = str(info.value)
    assert "\n" not in msg and str(out) in msg and _fs.OUTPUT_ERRNOS[err] in msg
    assert isinstance(info.value, ValueError) and info.value.errno == err
    assert _siblings(tmp_path) == ["out"] and _siblings(out) == ["old.txt"]
    res = CliRunner().invoke(app, ["export", str(tiny_src), "-o", str(out), "--overwrite"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and _fs.OUTPUT_ERRNOS[err] in res.output
    assert _siblings(tmp_path) == ["out"] and _siblings(out) == ["old.txt"]


def test_other_os_errors_keep_their_type_and_still_clean_up(tiny_src, tmp_path, monkeypatch):
    from mxport.checkpoint import export as ex
    from mxport.checkpoint.writers import ShardedSafetensorsWriter

    def boom(*a, **k):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(ShardedSafetensorsWriter, "write_part", boom)
    with pytest.raises(OSError) as info:
        ex.export_checkpoint(str(tiny_src), tmp_path / "out")
    assert type(info.value) is OSError and info.value.errno == errno.EIO
    assert _siblings(tmp_path) == []


_KILL_MID_WRITE = """
import os, signal, sys
from mxport.checkpoint.export import export_checkpoint
def progress(name, done):
    os.kill(os.getpid(), signal.SIGKILL)
export_checkpoint(sys.argv[1], sys.argv[2], overwrite=True, progress=progress)
"""


def test_killed_export_leaves_a_findable_temp_that_the_next_run_removes(tiny_src, tmp_path):
    """SIGKILL mid-write leaves `.out.mxport-tmp-<pid>-*` (nothing can run then): the next export into the
    same output removes it (ours: exact pattern, this user, dead pid); temporaries not matching stay."""
    from mxport.checkpoint.export import export_checkpoint

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_MID_WRITE, str(tiny_src), str(out)], env=env)
    assert proc.wait(timeout=120) == -9
    left = _siblings(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".out.mxport-tmp-{proc.pid}-"), left
    foreign = [".out.mxport-tmp-x", ".out.mxport-tmp-1-abcdefgh.keep", ".other.mxport-tmp-123-abcdefgh"]
    for name in foreign:
        (tmp_path / name).mkdir()
    link = f".out.mxport-tmp-{_dead_pid()}-linkxxxx"  # our pattern but a link: never followed, never removed
    (tmp_path / link).symlink_to(tiny_src, target_is_directory=True)
    export_checkpoint(str(tiny_src), out)
    assert _siblings(tmp_path) == sorted([*foreign, link, "out"])
    assert (tiny_src / "config.json").exists()


def test_stale_temps_of_live_processes_are_kept(tmp_path):
    out = tmp_path / "out"
    live = tmp_path / f".out.mxport-tmp-{os.getpid()}-abcdefgh"  # this process: maybe another thread's
    live.mkdir()
    init = tmp_path / ".out.mxport-old-1-abcdefgh"  # pid 1 is running
    init.mkdir()
    dead = tmp_path / f".out.mxport-tmp-{_dead_pid()}-abcdefgh"
    dead.mkdir()
    assert stale_temps(out) == [("mxport-tmp", dead)]
    assert clean_stale_temps(out) == [f"removed {dead.name} (left by a killed run)"]
    assert _siblings(tmp_path) == sorted([live.name, init.name])


def test_interrupted_overwrite_is_recovered(tiny_src, tmp_path):
    """An overwrite killed between its two renames left no output, only
    `.out.mxport-old-<pid>-*` (the previous export) and the finished temp: the next run puts the
    previous export back before anything else."""
    from mxport.checkpoint.export import export_checkpoint

    out = tmp_path / "out"
    pid = _dead_pid()
    old = tmp_path / f".out.mxport-old-{pid}-abcdefgh"
    old.mkdir()
    (old / "previous.txt").write_text("the user's previous export")
    (tmp_path / f".out.mxport-tmp-{pid}-ijklmnop").mkdir()
    with pytest.raises(FileExistsError):  # restored, so it exists again: not replaced without overwrite
        export_checkpoint(str(tiny_src), out)
    assert (_siblings(tmp_path) == ["out"]
            and (out / "previous.txt").read_text() == "the user's previous export")
    export_checkpoint(str(tiny_src), out, overwrite=True)
    assert (_siblings(tmp_path) == ["out"] and (out / "config.json").exists()
            and not (out / "previous.txt").exists())


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_with_exchange_or_backup(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(_fs, "_rename_exchange", lambda a, b: False)
    out, tmp = tmp_path / "out", tmp_path / ".out.mxport-tmp-1-abcdefgh"
    for d, text in ((out, "old"), (tmp, "new")):
        d.mkdir()
        (d / "f").write_text(text)
    replace_dir(tmp, out)
    assert _siblings(tmp_path) == ["out"] and (out / "f").read_text() == "new"
    target = tmp_path / "elsewhere"  # out a symlink: the link is replaced, its target never touched
    target.mkdir()
    (target / "keep").write_text("keep")
    os.rename(out, tmp)
    out.symlink_to(target, target_is_directory=True)
    replace_dir(tmp, out)
    assert (not out.is_symlink() and (out / "f").read_text() == "new"
            and (target / "keep").read_text() == "keep")
    assert _siblings(tmp_path) == ["elsewhere", "out"]


def test_backup_swap_puts_the_old_output_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(_fs, "_rename_exchange", lambda a, b: False)
    out, tmp = tmp_path / "out", tmp_path / ".out.mxport-tmp-1-abcdefgh"
    out.mkdir()
    tmp.mkdir()
    (out / "f").write_text("old")
    real = os.rename

    def rename(a, b):
        if Path(a) == tmp:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(a, b)

    monkeypatch.setattr(_fs.os, "rename", rename)
    with pytest.raises(OSError):
        replace_dir(tmp, out)
    assert (out / "f").read_text() == "old" and _siblings(tmp_path) == sorted(["out", tmp.name])


def test_atomic_write_text_failure_leaves_no_temp_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old")
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs.os, "fdopen", lambda fd, mode: Full(real(fd, mode)))
    with pytest.raises(OutputError, match="no space left on the device") as info:
        atomic_write_text(path, "new")
    assert "\n" not in str(info.value)
    assert _siblings(tmp_path) == ["report.json"] and path.read_text() == "old"
    monkeypatch.setattr(_fs.os, "fdopen", real)
    monkeypatch.setattr(_fs.os, "fchmod", lambda fd, mode: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    with pytest.raises(OutputError, match="read-only file system"):
        atomic_write_text(path, "new")
    assert _siblings(tmp_path) == ["report.json"]


def test_a_dangling_or_looping_symlink_output_is_never_replaced(tiny_src, tmp_path):
    """Path.exists() is False for a dangling link or a link loop, so `-o LINK` replaced the link without
    --overwrite; with --overwrite it is not a directory: refused."""
    from mxport.checkpoint.export import export_checkpoint

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("a", "dangling"):
        with pytest.raises(FileExistsError, match="already exists"):
            export_checkpoint(str(tiny_src), tmp_path / name)
        with pytest.raises(ValueError, match="exists and is not a directory"):
            export_checkpoint(str(tiny_src), tmp_path / name, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "dangling"]
    assert all((tmp_path / n).is_symlink() for n in ("a", "b", "dangling"))


def test_an_output_under_a_file_or_a_link_loop_is_one_clear_line(tiny_src, tmp_path):
    from mxport.checkpoint.export import export_checkpoint

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "f").write_text("a file")
    for parent in ("a", "f"):
        with pytest.raises(OutputError, match=f"^cannot write '.*/{parent}/out': '.*/{parent}' exists and "
                                              "is not a directory$"):
            export_checkpoint(str(tiny_src), tmp_path / parent / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "f"]


def test_output_containing_a_gguf_source_given_as_a_reader_is_refused(tiny_src, tmp_path, monkeypatch):
    """The CLI opens the source itself and hands export_checkpoint a reader: for a GGUF source the reader had
    no path, so `mxport export d/model.gguf -o d --overwrite` deleted the GGUF. The reader now carries it."""
    from transformers import AutoModelForCausalLM

    import mxport.models
    from mxport.checkpoint.export import export_checkpoint, open_source

    d = tmp_path / "d"
    d.mkdir()
    gguf = d / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    model = AutoModelForCausalLM.from_pretrained(tiny_src)
    monkeypatch.setattr(mxport.models, "load_causal_lm", lambda src, dtype: (model, SimpleTok()))
    reader = open_source(str(gguf))
    assert reader.source_path == gguf
    with pytest.raises(ValueError, match="contains the source file"):
        export_checkpoint(reader, d, overwrite=True)
    assert gguf.read_bytes() == b"GGUF stand-in"


class SimpleTok:
    def save_pretrained(self, path):
        pass
