"""The Typer application that every ``mxport`` subcommand module registers on, and what all commands share:
help paragraphs wrapped once (by the help renderer, not also by the source's line breaks), on/off flags shown
without a value type, usage errors as one ``error:`` line with exit code 2, ``--version``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import typer
from typer.core import TyperCommand, TyperGroup

from .. import __version__


def unwrap_paragraphs(text: str | None) -> str | None:
    """Join the source's line breaks inside each paragraph (paragraphs are separated by blank lines), so that
    the help renderer wraps the text once, at the terminal's width."""
    if not text:
        return text
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _flags_without_type(params) -> None:
    """On/off flags take no value: show ``--dry-run``, not ``--dry-run <bool>``."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """Typer's (click's) usage errors -- a bad flag value, an unknown option or command, a missing argument --
    as one ``error:`` line on stderr and their exit code (2), like the commands' own bad-input errors."""
    try:
        yield
    except typer.TyperException as exc:  # click's ClickException (Typer vendors click) derives from it
        from ._common import fail

        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        raise fail(exc.format_message() + hint, getattr(exc, "exit_code", 2)) from None


class _MxportParsing:
    """What every ``mxport`` command and the group share: on/off flags shown without a type, usage errors as
    one line, option names whole in ``--help`` at any width (:mod:`._help`)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flags_without_type(params)
        return params

    def make_context(self, *args, **kwargs):
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def format_help(self, ctx, formatter):
        from ._help import whole_option_names

        with whole_option_names():
            return super().format_help(ctx, formatter)


class MxportCommand(_MxportParsing, TyperCommand):
    """Every ``mxport`` subcommand."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.help = unwrap_paragraphs(self.help)


class MxportGroup(_MxportParsing, TyperGroup):
    """The ``mxport`` command itself."""

    def resolve_command(self, ctx, args):
        with _one_line_usage_errors():
            return super().resolve_command(ctx, args)


class MxportApp(typer.Typer):
    """A Typer app whose commands are :class:`MxportCommand` unless told otherwise."""

    def command(self, *args, cls=MxportCommand, **kwargs):
        return super().command(*args, cls=cls, **kwargs)


app = MxportApp(
    name="mxport",
    cls=MxportGroup,
    help="MXFP8 weights from training to inference: export, convert, sync (refit), verify.\n\n"
    "Exit codes: 0 success; 1 a check failed (inspect found problems, verify exceeded --max-kl, ...); "
    "2 bad input or usage.",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"mxport {__version__}")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print mxport's version and exit."),
) -> None:
    """MXFP8 weights from training to inference: export, convert, sync (refit), verify."""
    from .._env import quiet_third_party_logs
    from ._common import json_to_stdout

    if ctx.invoked_subcommand is None:  # plain `mxport`: the help, as `mxport --help` prints it
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    quiet_third_party_logs()
    json_to_stdout(None)  # reports to stdout unless the command writes JSON there
