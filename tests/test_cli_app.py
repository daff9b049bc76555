"""What every ``mxport`` command shares: ``--version``, plain ``mxport``, ``--help`` of every command
(flags shown as flags, paragraphs wrapped once), usage errors as one ``error:`` line with exit 2,
``--json FILE|-`` everywhere."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

import mxport.cli
from mxport import __version__
from mxport.cli import app
from mxport.cli.app import unwrap_paragraphs
from mxport.cli.verify import export_command
from mxport.testing import make_tiny_llama

runner = CliRunner()
COMMANDS = ("bench", "export", "info", "inspect", "plan", "refit", "verify")
WIDE = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout == f"mxport {__version__}\n"


def test_no_arguments_prints_the_help():
    r = runner.invoke(app, [])
    assert r.exit_code == 0
    assert "Usage:" in r.stdout and all(c in r.stdout for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_works_and_shows_flags_as_flags(command):
    r = runner.invoke(app, [command, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.stdout  # `--dry-run`, not `--dry-run <bool>`
    cmd = typer.main.get_command(app).commands[command]
    flags = [p.opts[0] for p in cmd.params if getattr(p, "is_flag", False)]
    assert set(flags) >= {"export": {"--overwrite", "--dry-run"}, "inspect": {"--no-stats"},
                          "bench": {"--quick"}, "verify": {"--per-layer"}}.get(command, set())
    for flag in flags:
        (row,) = [x for x in r.stdout.splitlines() if re.match(rf"^\W*{flag}\s", x)]
        assert "<" not in row, row  # no value type in the flag's row


@pytest.mark.parametrize("command", COMMANDS)
def test_json_takes_a_file_or_dash_everywhere(command):
    r = runner.invoke(app, [command, "--help"], env=WIDE)
    (line,) = [x for x in r.stdout.splitlines() if re.match(r"^\W*--json\s", x)]
    assert "FILE|-" in line


@pytest.mark.parametrize("option", ["--json", "--exclude", "--max-new-tokens"])
def test_shared_options_are_declared_once(option):
    """An option several commands take is declared once, in cli/_common.py (``--json`` was declared seven
    times, and plan's had no FILE|-), and the commands take the same option."""
    cli = Path(mxport.cli.__file__).parent
    decl = re.compile(rf'typer\.Option\((?:\s*[^,()]+,)?\s*"{option}"')
    assert [p.name for p in sorted(cli.glob("*.py")) if decl.search(p.read_text())] == ["_common.py"]
    root = typer.main.get_command(app)
    taking = [[p for p in cmd.params if option in p.opts] for cmd in root.commands.values()]
    taking = [p for ps in taking for p in ps]
    assert len(taking) >= 2 and len({(p.metavar, p.help.split(" as JSON")[-1]) for p in taking}) == 1


def test_help_paragraphs_are_wrapped_once():
    """On a wide terminal a paragraph of a command's docstring is one line: the source's own line breaks are
    not kept on top of the renderer's wrapping."""
    r = runner.invoke(app, ["export", "--help"], env=WIDE)
    assert r.exit_code == 0
    line = next(x for x in r.stdout.splitlines() if "Linear-layer weights" in x)
    assert line.rstrip().endswith("Exit 0 ok, 2 bad input.")
    assert unwrap_paragraphs("a\n  b\n\n  c\nd\n") == "a b\n\nc d"


@pytest.mark.parametrize("columns", ["80", "100"])
@pytest.mark.parametrize("command", [*COMMANDS, None])
def test_help_shows_every_option_name_whole_in_narrow_terminals(command, columns, monkeypatch):
    """At 80-100 columns typer's six-column options panel cut long names (``--trainer-quantiz…``): every
    option name (and its negative, ``--no-overlap``) appears whole, and no line is wider than the terminal.

    typer reads TERMINAL_WIDTH once, when ``typer.rich_utils`` is first imported (whichever test's env that
    was: a 400-column run of another module froze it there): set it as the env says."""
    import typer.rich_utils

    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", int(columns))
    args = [command, "--help"] if command else ["--help"]
    r = runner.invoke(app, args, env={"COLUMNS": columns, "TERMINAL_WIDTH": columns})
    assert r.exit_code == 0, r.output
    root = typer.main.get_command(app)
    cmd = root.commands[command] if command else root
    names = [o for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)
             for o in (*p.opts, *p.secondary_opts)]
    assert names
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", r.stdout), (name, r.stdout)
    assert "\u2026" not in r.stdout
    assert max(len(x) for x in r.stdout.splitlines()) <= int(columns)


@pytest.mark.parametrize("args, message", [
    (["exprt"], "No such command 'exprt'. Did you mean 'export'?"),
    (["--bogus"], "No such option: --bogus"),
    (["inspect"], "Missing argument 'PATH'"),
    (["inspect", "x", "--json"], "Option '--json' requires an argument"),
    (["refit", "--steps", "0"], "Invalid value for '--steps'"),
    (["refit", "--receivers", "9"], "Invalid value for '--receivers'"),
    (["refit", "--lr", "nan"], "Invalid value for '--lr': must be > 0"),
    (["verify", "--activation", "w4"], "Invalid value for '--activation'"),
    (["bench", "--only", "nope"], "Invalid value for '--only'"),
])
def test_usage_errors_are_one_line_exit_2(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert r.stdout == ""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "llama")


def test_export_command_is_complete_and_quoted():
    cmd = export_command("/models/my model", ["model.layers.3.*"], "e5m2")
    assert shlex.split(cmd) == ["mxport", "export", "/models/my model", "-o", "my model-mxfp8", "--format",
                                "sglang", "--fp8-dtype", "e5m2", "--exclude", "model.layers.3.*"]
    assert shlex.split(export_command(None, [], "e4m3")) == ["mxport", "export", "-o",
                                                              "SmolLM2-135M-Instruct-mxfp8"]


@pytest.mark.slow
def test_verify_target_kl_prints_a_command_that_runs(tmp_path, llama, monkeypatch):
    """``verify --per-layer --target-kl`` prints, on one line however narrow the terminal, an ``mxport
    export`` command that runs as printed: it writes the checkpoint with the suggested layers (and the user's
    --exclude) kept in high precision."""
    r = runner.invoke(app, ["verify", str(llama), "--max-new-tokens", "2", "--per-layer", "--target-kl",
                            "1e-12", "--exclude", "model.layers.0.mlp.*"], env={"COLUMNS": "40"})
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.stdout.splitlines() if x.strip().startswith("mxport export")]
    argv = shlex.split(line)
    assert argv[:3] == ["mxport", "export", str(llama)] and "-o" in argv
    assert "model.layers.0.mlp.*" in argv and "model.layers.1.*" in argv
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, [*argv[1:], "--json", "-"])
    assert res.exit_code == 0, res.output
    kept = {d["name"] for d in json.loads(res.stdout)["decisions"] if not d["quantize"]}
    assert "model.layers.1.self_attn.q_proj.weight" in kept and "model.layers.0.mlp.up_proj.weight" in kept
    assert (tmp_path / argv[argv.index("-o") + 1] / "config.json").is_file()


@pytest.mark.parametrize("command", COMMANDS)
def test_unwritable_json_fails_first_exit_2(tmp_path, command):
    """A --json FILE that cannot be written fails at once, one line, exit 2: not a
    traceback after the work."""
    args = [command] + (["x"] if command == "inspect" else [])
    r = runner.invoke(app, [*args, "--json", str(tmp_path / "missing" / "out.json")])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: --json: {tmp_path / 'missing'} does not exist"
    r = runner.invoke(app, [*args, "--json", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.startswith("error: --json:") and "is a directory" in r.stderr


def test_a_long_list_of_choices_breaks_between_choices():
    """`export --help` at 80 columns cut `<modelopt|compressed-tensors|sglang>` inside a word ("sglan" /
    "g>"): a value type wider than the names' column breaks after a "|" only."""
    from rich.text import Text

    from mxport.cli._help import _wrapped

    lines = _wrapped(Text("<modelopt|compressed-tensors|sglang>"), 30).plain.split("\n")
    assert lines == ["<modelopt|compressed-tensors|", "sglang>"]
    r = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert "sglang>" in r.stdout and "compressed-tensors" in r.stdout
