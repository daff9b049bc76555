"""The ``mxport`` command. Each subcommand lives in its own module and registers itself on :data:`app`."""

from __future__ import annotations

from . import bench, export, info, inspect_cmd, plan, refit, verify  # noqa: F401  (register the subcommands)
from .app import app


def main() -> None:
    """Console-script entry point."""
    app()
