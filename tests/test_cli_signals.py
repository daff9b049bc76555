"""SIGTERM (what `timeout`, a CI cancel or `kill` sends) unwinds a command like Ctrl-C: its `finally` blocks
run, so temporary folders are removed and worker processes stopped (Python's default SIGTERM ends the process
at once, leaving them behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def test_sigterm_mid_benchmark_leaves_no_temporary_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mxport.cli", "bench", "--quick", "--only", "checkpoint"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith("mxport-bench-ckpt-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the benchmark never made its folder"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("mxport-")]
