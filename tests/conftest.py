"""Test-wide settings: the compiled quantize path is off for the automatic choice (compiling costs tens of
seconds on a 2-core machine); tests of the compiled path ask for it with ``quantize(..., kernel="compiled")``.
The native CPU kernel stays on where it builds (AVX-512; about a second, once per machine): most quantize
tests run through it; the ``no_native`` fixture turns it off for the automatic choice in one test. Compiler
runs have no time limit (``MXPORT_COMPILE_TIMEOUT=0``)."""

import os

os.environ.setdefault("MXPORT_DISABLE_COMPILE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# compiler runs (the native kernel's build, the ISA-branch check) wait as long as they take: no check may
# depend on the machine's load (a busy machine took past a 120 s compile limit)
os.environ.setdefault("MXPORT_COMPILE_TIMEOUT", "0")

import pytest  # noqa: E402


@pytest.fixture
def no_native(monkeypatch):
    """The native CPU kernel switched off for the automatic choice (``quantize(x)`` with ``kernel=None``) in
    one test, as ``MXPORT_DISABLE_NATIVE`` does for a process: for tests of that choice and its fallbacks.
    Tests that want one kernel say so with ``quantize(..., kernel="native" | "compiled" | "eager")``."""
    from mxport.quantize import NATIVE_PATH

    monkeypatch.setattr(NATIVE_PATH, "disabled_reason", "turned off by the no_native test fixture")
    return NATIVE_PATH
