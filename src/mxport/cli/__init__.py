"""The ``mxport`` command. Each subcommand lives in its own module and registers itself on :data:`app`."""

from __future__ import annotations

from . import bench, export, info, inspect_cmd  # noqa: F401  (register the subcommands)
from . import refit as _refit  # noqa: F401  (issue 6: mxport refit)
from .app import app
from .verify import verify as _verify  # noqa: F401  (issue 5: mxport verify)


def main() -> None:
    """Console-script entry point."""
    app()
