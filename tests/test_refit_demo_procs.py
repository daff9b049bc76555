"""``mxport refit``'s processes (:func:`mxport.refit.demo.run_demo`): nothing it starts outlives it — not its
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
from mxport.refit.demo import DemoConfig, DemoFailed, run_demo

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
