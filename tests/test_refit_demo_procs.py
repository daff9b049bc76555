"""``mxport refit``'s processes (:func:`mxport.demo.single.run_demo`): nothing it starts outlives it — not its
trainer and inference processes, not multiprocessing's resource tracker — whether the run succeeds, a process
raises, or the caller is interrupted (KeyboardInterrupt)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mxport.testing import make_tiny_llama

# Runs in its own session (start_new_session): after run_demo returns or raises it lists the other processes
# of its session (every process it started, however far down, stays in it unless it calls setsid).
CHILD = r"""
import json, os, sys
from mxport.demo.procs import DemoFailed
from mxport.demo.single import DemoConfig, run_demo

def session_others():
    sid, me, out = os.getsid(0), os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        if int(fields[3]) == sid:
            out.append(f"{d} {fields[0]} {cmd}")
    return out

mode, source = sys.argv[1], sys.argv[2]

def on_event(kind, rank, payload):
    if mode == "interrupt" and kind == "plan":
        raise KeyboardInterrupt

cfg = DemoConfig(source=source, steps=1, bucket_bytes=1 << 16, max_new_tokens=2, timeout_s=60)
try:
    run_demo(cfg, on_event, timeout_s=240)
    outcome = "ok"
except DemoFailed as exc:
    outcome = "failed: " + str(exc).splitlines()[0][:200]
except KeyboardInterrupt:
    outcome = "interrupted"
print("RESULT " + json.dumps({"outcome": outcome, "left": session_others()}), flush=True)
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "llama")


def _session_left(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,sid,stat,cmd"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:] if line.split()[1] == str(sid)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "worker_raises", "interrupt"])
def test_nothing_outlives_run_demo(mode, llama):
    source = "/nonexistent/model" if mode == "worker_raises" else str(llama)
    env = dict(os.environ, MXPORT_DISABLE_COMPILE="1", PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode, source], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, err[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    want = {"ok": "ok", "worker_raises": "failed:", "interrupt": "interrupted"}[mode]
    assert res["outcome"].startswith(want), res
    # when run_demo returns, the processes it started are gone (none running, none a zombie) ...
    assert res["left"] == [], res["left"]
    # ... and after the command exits, nothing of its session remains
    deadline = time.monotonic() + 2
    while _session_left(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_left(p.pid) == []


# Run as a file (spawn re-imports it in each child as __mp_main__): two children via spawn_and_collect; once
# both run, the parent signals its whole process group with SIGINT, as a terminal's Ctrl-C does.
CTRL_C = r"""
import json, os, signal, sys, time
from mxport.demo.procs import spawn_and_collect

def target(rank, world, outbox):
    outbox.put(("step", rank, signal.getsignal(signal.SIGINT) == signal.SIG_IGN))
    time.sleep(60)
    outbox.put(("done", rank, None))

if __name__ == "__main__":
    # as in a terminal: a job started in the background of a non-interactive shell (a CI runner's `cmd &`)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    seen = []

    def on_event(kind, rank, payload):
        seen.append(payload)
        if len(seen) == 2:
            os.killpg(0, signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt comes here

    try:
        spawn_and_collect(target, 2, (), on_event, timeout_s=120)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "interrupted"
    print("RESULT " + json.dumps({"outcome": outcome, "children_ignore": seen}), flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_is_handled_by_the_parent_alone(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) reaches the parent, which ends its children: they
    ignore SIGINT, so none prints a KeyboardInterrupt traceback on the terminal, and none is left."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, err[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"outcome": "interrupted", "children_ignore": [True, True]}
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 2
    while _session_left(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_left(p.pid) == []
