"""The Typer application that every ``mxport`` subcommand module registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="mxport",
    help="MXFP8 weights from training to inference: export, convert, sync (refit), verify.\n\n"
    "Exit codes: 0 success; 1 a check failed (inspect found problems, verify exceeded --max-kl, ...); "
    "2 bad input or usage.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """MXFP8 weights from training to inference: export, convert, sync (refit), verify."""
    from .._env import quiet_third_party_logs
    from ._common import json_to_stdout

    quiet_third_party_logs()
    json_to_stdout(None)  # reports to stdout unless the command writes JSON there
