"""``--help`` panels whose option names are never cut.

Typer lays out an options panel as six columns (name, short name, negative name, negative short name, value
type, help) and lets rich shrink them all alike when the terminal is narrow: at 80-100 columns long names
ended in "…" (``--trainer-quantiz…``). Here each panel typer prints is laid out again as two columns: the
names with their value type, as wide as the longest name (the type goes on a line of its own when name and
type do not fit in :data:`NAMES_SHARE` of the width), and the help in the rest. Typer still builds every cell
(defaults, ranges, required marks, markup); only the layout changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.table import Table
from rich.text import Text

#: the share of the panel's width that names and types take before a type moves under its name
NAMES_SHARE = 0.45
#: columns the panel's border and padding take
_PANEL_EDGES = 4


def _text(cell) -> Text:
    return cell if isinstance(cell, Text) else Text(str(cell or ""))


def _joined(cells, sep: str) -> Text:
    return Text(sep).join(_text(c) for c in cells if _text(c).plain)


def _name_cell(names: list) -> Text:
    """One option's names: required mark, ``--long, -s``, then `` / --no-long`` for an on/off pair."""
    *required, long, short, neg_long, neg_short = names
    cell = Text.assemble(*(_text(c) for c in required if _text(c).plain))
    if cell.plain:
        cell.append(" ")
    cell.append_text(_joined([long, short], ", "))
    negative = _joined([neg_long, neg_short], ", ")
    if negative.plain:
        cell.append(" / ")
        cell.append_text(negative)
    return cell


def _wrapped(kind: Text, limit: int) -> Text:
    """A value type wider than ``limit`` (``<modelopt|compressed-tensors|sglang>``) broken after its ``|``
    separators, never inside a choice."""
    if kind.cell_len <= limit or "|" not in kind.plain:
        return kind
    parts = [p + "|" for p in kind.plain.split("|")]
    parts[-1] = parts[-1][:-1]
    lines = [""]
    for part in parts:
        if lines[-1] and len(lines[-1]) + len(part) > limit:
            lines.append("")
        lines[-1] += part
    return Text("\n".join(lines), style=kind.style)


def relayout(table: Table, width: int) -> Table:
    """Typer's options table (``[required,] long, short, negative long, negative short, type, help``) as a
    two-column table for a panel ``width`` columns wide, every name whole."""
    columns = [list(c.cells) for c in table.columns]
    *name_columns, types, helps = columns
    names = [_name_cell([col[i] for col in name_columns]) for i in range(len(helps))]
    widest_name = max((n.cell_len for n in names), default=0)
    limit = max(widest_name, int((width - _PANEL_EDGES) * NAMES_SHARE))
    cells = []
    for name, kind in zip(names, (_wrapped(_text(t), limit) for t in types), strict=True):
        sep = " " if name.cell_len + 1 + kind.cell_len <= limit else "\n"
        cells.append(Text.assemble(name, sep, kind) if kind.plain else name)
    out = Table(show_header=False, box=None, padding=(0, 1), pad_edge=False, expand=True,
                highlight=table.highlight)
    out.add_column(width=min(limit, max(line.cell_len for c in cells for line in c.split())), overflow="fold")
    out.add_column(ratio=1)
    for cell, help_cell in zip(cells, helps, strict=True):
        out.add_row(cell, help_cell)
    return out


class _RelayoutConsole:
    """Typer's help console, except that an options panel it prints is laid out by :func:`relayout`."""

    def __init__(self, console) -> None:
        self._console = console

    def print(self, renderable, *args, **kwargs) -> None:
        table = getattr(renderable, "renderable", None)
        if isinstance(table, Table) and len(table.columns) >= 6 and table.row_count:
            renderable.renderable = relayout(table, self._console.width)
        self._console.print(renderable, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._console, name)


@contextlib.contextmanager
def whole_option_names() -> Iterator[None]:
    """While rendering a command's help: typer's options panels through :class:`_RelayoutConsole` (nothing
    changes with a typer that renders help otherwise)."""
    try:
        from typer import rich_utils
    except ImportError:  # typer without rich: click's plain help, whose names are whole
        yield
        return
    original = getattr(rich_utils, "_print_options_panel", None)
    if original is None:
        yield
        return

    def panel(*args, console, **kwargs):
        return original(*args, console=_RelayoutConsole(console), **kwargs)

    rich_utils._print_options_panel = panel
    try:
        yield
    finally:
        rich_utils._print_options_panel = original
