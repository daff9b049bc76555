"""Atomic writes give files the mode a plain open() gives (not mkstemp's 0o600), so reports and cached models are
readable by other users (found by a fresh-clone trial: `mxport refit --json FILE` wrote a 0o600 file)."""

from __future__ import annotations

import os
import stat

from mxport._fs import atomic_write_text, default_file_mode


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
