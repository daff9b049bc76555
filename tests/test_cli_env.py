"""The command line in the environments people have: a plain ``pip install mxport`` (no ``models``
extra) gets one line naming the extra to install, exit 2; optional packages stay quiet (no warnings, no
progress bars of theirs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mxport.testing import make_tiny_llama

SRC = str(Path(__file__).resolve().parents[1] / "src")

BLOCKER = textwrap.dedent('''
    """Loaded at start-up (sitecustomize): these packages cannot be imported, as after a plain pip install."""
    import os
    import sys

    BLOCKED = set(os.environ["MXPORT_TEST_BLOCK"].split(","))

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Blocker())
''')


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "llama")


def mxport(args, *, timeout: float, block: str | None = None, site: Path | None = None):
    env = dict(os.environ, MXPORT_DISABLE_COMPILE="1")
    for key in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        env.pop(key, None)  # the command line sets them itself
    path = [SRC, env.get("PYTHONPATH", "")]
    if block is not None:
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCKER)
        env["MXPORT_TEST_BLOCK"] = block
        path.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return subprocess.run([sys.executable, "-m", "mxport.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_the_blocker_blocks(tmp_path):
    env = dict(os.environ, MXPORT_TEST_BLOCK="transformers", PYTHONPATH=str(tmp_path))
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    r = subprocess.run([sys.executable, "-c", "import transformers"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 1 and "No module named 'transformers'" in r.stderr


@pytest.mark.parametrize("command", [["verify", "--max-new-tokens", "1"], ["refit", "--steps", "1"]])
def test_without_the_models_extra_one_line_exit_2(tmp_path, llama, command):
    r = mxport([command[0], llama, *command[1:]], timeout=180, block="transformers,gguf,accelerate",
               site=tmp_path / "site")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line == ("error: this needs the optional package 'transformers', not installed here: "
                    "pip install 'mxport[models]'")


def test_gguf_input_without_gguf_names_the_extra(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    r = mxport(["refit", gguf, "--steps", "1"], timeout=120, block="gguf", site=tmp_path / "site")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip() == ("error: this needs the optional package 'gguf', not installed here: "
                                "pip install 'mxport[models]'")


def _third_party_noise(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines()
            if "warn" in x.lower() or "Loading weights" in x or "Failed to load" in x or "it/s]" in x]


def test_verify_is_quiet(llama):
    """No warnings, no progress bars from transformers / torchao on stderr (the command's own progress bar is
    transient, and piped it draws nothing)."""
    r = mxport(["verify", llama, "--max-new-tokens", "1"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _third_party_noise(r.stderr) == [], r.stderr[-3000:]


def test_quiet_env_silences_save_pretrained(tmp_path):
    """What the command line (and its worker processes) set up silences torchao's
    missing-library warning, torch's pytree deprecation warnings and transformers' shard-writing
    bar, printed on every ``save_pretrained``."""
    code = ("import sys; from mxport._env import quiet_third_party_logs; quiet = sys.argv[2] == '1'\n"
            "quiet and quiet_third_party_logs()\n"
            "from mxport.testing import make_tiny_llama; make_tiny_llama(sys.argv[1], layers=1)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    for key in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        env.pop(key, None)
    loud = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), "0"], capture_output=True,
                          text=True, env=env, timeout=180)
    quiet = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"), "1"], capture_output=True,
                           text=True, env=env, timeout=180)
    assert loud.returncode == 0 and quiet.returncode == 0, quiet.stderr
    assert _third_party_noise(loud.stderr)  # the noise exists here (the dev extra installs torchao) ...
    assert quiet.stderr == ""  # ... and none of it is left
