"""The ``mxport`` command. Each subcommand lives in its own module and registers itself on :data:`app`."""

from __future__ import annotations

from . import bench, export, info, inspect_cmd, plan, refit, verify  # noqa: F401  (register the subcommands)
from .app import app


def main() -> None:
    """Console-script entry point. A missing optional package that escaped a command's own checks still ends
    in one line naming the extra to install, exit 2 (not a traceback)."""
    import sys

    from ._common import EXIT_USAGE, fail, missing_extra

    try:
        app()
    except ImportError as exc:
        advice = missing_extra(exc)
        if advice is None:
            raise
        fail(advice)
        sys.exit(EXIT_USAGE)
