"""Every example in docs/ runs: fenced ```python blocks (plain scripts or doctest style), ```bash blocks
marked ``<!-- run -->`` (each ``mxport ...`` line through the CLI), and the docstring examples of mxport's
modules.

Markers, an HTML comment on the line(s) right before a fence:

- ``<!-- requires: mxport.refit, mxport.nn, cli:export -->``: skip the block while one of those modules is not
  importable, or (``cli:NAME``) while ``mxport NAME`` is not registered (a feature still being built); the
  block runs as soon as it lands.
- ``<!-- skip: reason -->``: never run (e.g. it needs vLLM or a GPU); the reason is reported.
- ``<!-- run -->`` / ``<!-- run: exit=1 -->`` (bash blocks only): run each line, expect that exit code.

Python blocks of one page share one namespace, in page order, and run in a per-page temporary directory.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"(?P<markers>(?:[ \t]*<!--[^\n]*-->[ \t]*\n)*)```(?P<lang>[\w-]*)[^\n]*\n"
                   r"(?P<body>.*?)^```[ \t]*$",
                   re.S | re.M)
MARKER = re.compile(r"<!--\s*(?P<key>requires|skip|run)\s*(?::\s*(?P<arg>.*?))?\s*-->")


def _blocks():
    out = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for i, m in enumerate(FENCE.finditer(text)):
            markers = {mm.group("key"): (mm.group("arg") or "") for mm in MARKER.finditer(m.group("markers"))}
            lang = m.group("lang")
            if lang == "python" or (lang in ("bash", "sh", "console") and "run" in markers):
                line = text.count("\n", 0, m.start("body")) + 1
                out.append(pytest.param(page, i, lang, m.group("body"), markers, line,
                                        id=f"{page.relative_to(DOCS)}:{line}"))
    return out


BLOCKS = _blocks()
_NAMESPACES: dict[Path, dict] = {}


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory):
    dirs: dict[Path, Path] = {}

    def get(page: Path) -> Path:
        if page not in dirs:
            dirs[page] = tmp_path_factory.mktemp(page.stem)
        return dirs[page]

    return get


def _check_requires(markers: dict) -> None:
    if "skip" in markers:
        pytest.skip(f"marked skip: {markers['skip'] or 'no reason given'}")
    for name in filter(None, (s.strip() for s in markers.get("requires", "").split(","))):
        if name.startswith("cli:"):
            if name[4:] not in _cli_commands():
                pytest.skip(f"requires the `mxport {name[4:]}` command, which has not landed yet")
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                pytest.skip(f"requires {name}, which has not landed yet")
            raise


def _cli_commands() -> set[str]:
    import typer

    from mxport.cli import app

    return {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands} | {
        g.name for g in app.registered_groups if isinstance(g.typer_instance, typer.Typer)}


def _run_python(body: str, ns: dict, where: str) -> None:
    if body.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(body, ns, where, where, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out: list[str] = []
        runner.run(test, out=out.append, clear_globs=False)
        assert runner.failures == 0, "".join(out)
    else:
        exec(compile(body, where, "exec"), ns)


def _run_shell(body: str, expect_exit: int, where: str) -> None:
    from typer.testing import CliRunner

    from mxport.cli import app

    lines = [ln.strip().removeprefix("$ ") for ln in body.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines, f"{where}: a run block with no commands"
    for ln in lines:
        args = shlex.split(ln, comments=True)
        assert Path(args[0]).name == "mxport", (f"{where}: run blocks may only hold mxport commands, "
                                                f"got {ln!r}")
        res = CliRunner().invoke(app, args[1:])
        assert res.exit_code == expect_exit, f"{where}: {ln!r} exited {res.exit_code}\n{res.output[-3000:]}"


@pytest.mark.parametrize(("page", "index", "lang", "body", "markers", "line"), BLOCKS)
def test_docs_example(page, index, lang, body, markers, line, page_dirs, monkeypatch):
    _check_requires(markers)
    monkeypatch.chdir(page_dirs(page))
    where = f"{page.relative_to(ROOT)}:{line}"
    if lang == "python":
        ns = _NAMESPACES.setdefault(page, {"__name__": f"docs_{page.stem}"})
        _run_python(body, ns, where)
    else:
        arg = markers.get("run", "")
        expect = int(arg.split("=", 1)[1]) if arg.startswith("exit=") else 0
        _run_shell(body, expect, where)


def test_docs_have_examples_and_every_guide_is_linked():
    assert len([b for b in BLOCKS if b.values[2] == "python"]) >= 8
    index = (DOCS / "index.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_docs_relative_links_exist():
    link = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)")
    for page in DOCS.rglob("*.md"):
        for target in link.findall(page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links missing {target}"


def test_docstring_examples():
    """doctest over every mxport module's docstrings (modules without examples contribute nothing)."""
    import mxport

    names = ["mxport"] + sorted(m.name for m in pkgutil.walk_packages(mxport.__path__, "mxport."))
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an integration whose engine (vLLM) is missing: its own tests cover it
            if name.startswith("mxport.integrations.") and getattr(exc, "name", None) != name:
                continue
            raise
        for t in doctest.DocTestFinder(exclude_empty=True).find(module, name):
            if t.examples:
                runner.run(t, out=out.append)
    assert runner.failures == 0, "".join(out)


def test_swizzle_figure_positions_follow_the_formula(tmp_path):
    """The figure's byte map (computed with mxport.layouts.swizzle) equals the byte formula of docs/format.md,
    "Scale layouts"."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_swizzle_figure",
                                                  ROOT / "scripts" / "make_swizzle_figure.py")
    fig = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fig)
    for rows, cols in ((128, 4), (130, 6)):
        src_r, src_c = fig.tile_sources(rows, cols)
        flat_r, flat_c = src_r.reshape(-1), src_c.reshape(-1)
        c4 = -(-cols // 4)
        seen = 0
        for r in range(rows):
            for c in range(cols):
                byte = ((r // 128) * c4 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
                assert (int(flat_r[byte]), int(flat_c[byte])) == (r, c)
                seen += 1
        assert int((flat_r >= 0).sum()) == seen  # every other byte is padding
    assert (ROOT / "docs" / "img" / "swizzle_128x4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = fig.draw(tmp_path / "s.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
