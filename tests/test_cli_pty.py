"""Every command that shows progress finishes in a real terminal (a pseudo-terminal), within a time limit.

Rich's ``Live`` display (progress bars, status spinners) on a terminal swaps ``sys.stdout`` / ``sys.stderr``
for proxies that print into its console: a console that looked up ``sys.stdout`` at each write wrote into
itself and every such command hung (piped, as under CliRunner, no proxy is installed and nothing showed it).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from mxport.checkpoint.export import export_checkpoint
from mxport.testing import make_tiny_llama

CLI = [sys.executable, "-m", "mxport.cli"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "llama")


def run_in_terminal(args, timeout: float, *, stdout_pipe: bool = False):
    """Run ``mxport ARGS`` with a pseudo-terminal as stderr (and stdout, unless ``stdout_pipe``);
    return (exit code or None on timeout, terminal text, stdout text when piped). The process group
    is killed on timeout."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # 200 columns: no wrapping
    env = dict(os.environ, MXPORT_DISABLE_COMPILE="1", TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(CLI + [str(a) for a in args], stdin=slave, stderr=slave,
                            stdout=subprocess.PIPE if stdout_pipe else slave, env=env, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal closed it
                    data = b""
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None and not select.select([master], [], [], 0)[0]:
                break
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, b"".join(chunks).decode(errors="replace"), None
        out = proc.stdout.read().decode() if stdout_pipe else None
        return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace"), out
    finally:
        os.close(master)
        if proc.stdout is not None:
            proc.stdout.close()


def test_export_in_a_terminal(tmp_path, llama):
    code, term, _ = run_in_terminal(["export", llama, "-o", tmp_path / "out"], timeout=90)
    assert code == 0, term[-2000:]
    assert "wrote" in term and (tmp_path / "out" / "model.safetensors").is_file()


def test_export_json_to_stdout_reports_on_the_terminal(tmp_path, llama):
    """``--json -``: progress and reports on stderr (the terminal), stdout holds the JSON only."""
    code, term, out = run_in_terminal(["export", llama, "-o", tmp_path / "out", "--json", "-"], timeout=90,
                                      stdout_pipe=True)
    assert code == 0, term[-2000:]
    assert json.loads(out)["out"] == str(tmp_path / "out")
    assert "wrote" in term


def test_inspect_in_a_terminal(tmp_path, llama):
    export_checkpoint(llama, tmp_path / "ck", fmt="modelopt")
    code, term, _ = run_in_terminal(["inspect", tmp_path / "ck"], timeout=90)
    assert code == 0, term[-2000:]
    assert "no problems found" in term
    code, term, out = run_in_terminal(["inspect", tmp_path / "ck", "--json", "-"], timeout=90,
                                      stdout_pipe=True)
    assert code == 0, term[-2000:]
    assert json.loads(out)["problems"] == [] and "{" not in term  # the JSON on stdout only ...
    assert "weights" in term  # ... the progress bar on the terminal (stderr)


def test_verify_in_a_terminal(llama):
    code, term, _ = run_in_terminal(["verify", llama, "--max-new-tokens", "2"], timeout=180)
    assert code == 0, term[-2000:]
    assert "gen_kl_error_mean" in term


def test_bench_quick_in_a_terminal():
    code, term, _ = run_in_terminal(["bench", "--quick", "--only", "export"], timeout=180)
    assert code == 0, term[-2000:]
    assert "mxport bench --quick" in term


@pytest.mark.slow
def test_refit_in_a_terminal(llama):
    code, term, _ = run_in_terminal(["refit", llama, "--steps", "1", "--max-new-tokens", "2"], timeout=400)
    assert code == 0, term[-3000:]
    assert "generated (receiver 1, last step)" in term
