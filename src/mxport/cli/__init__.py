"""The ``mxport`` command. Each subcommand lives in its own module and registers itself on :data:`app`."""

from __future__ import annotations

from . import bench, export, info, inspect_cmd, plan, refit, verify  # noqa: F401  (register the subcommands)
from .app import app


def main() -> None:
    """Console-script entry point. A missing optional package that escaped a command's own checks still ends
    in one line naming the extra to install, exit 2 (not a traceback)."""
    import signal
    import sys
    import threading

    from ._common import EXIT_USAGE, fail, missing_extra

    if threading.current_thread() is threading.main_thread():
        # SIGTERM (`timeout`, a CI cancel, `kill`) unwinds like Ctrl-C: every `finally` runs, so worker
        # processes are stopped and temporary files removed (Python's default SIGTERM ends it at once)
        signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except ImportError as exc:
        advice = missing_extra(exc)
        if advice is None:
            raise
        fail(advice)
        sys.exit(EXIT_USAGE)


def _terminate(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise SystemExit(128 + signum)
