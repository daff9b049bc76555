"""Test-wide settings: the compiled quantize path is off by default (compiling costs tens of seconds on a
2-core machine); tests of the fast path switch it on explicitly with the ``fast_path`` fixture."""

import os

os.environ.setdefault("MXPORT_DISABLE_COMPILE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture
def fast_path():
    """Enable the torch.compile'd quantize kernel for one test; skip where torch.compile cannot run."""
    from mxport.quantize import FAST_PATH

    saved = FAST_PATH.disabled_reason
    FAST_PATH.disabled_reason = None
    try:
        yield FAST_PATH
    finally:
        FAST_PATH.disabled_reason = saved
