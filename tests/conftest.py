"""Test-wide settings: the compiled quantize path is off by default (compiling costs tens of seconds on a
2-core machine); tests of the compiled path switch it on explicitly with the ``fast_path`` fixture. The native CPU
kernel stays on (it builds in about a second, once per machine): most quantize tests run through it; the
``no_native`` fixture turns it off for one test."""

import os

os.environ.setdefault("MXPORT_DISABLE_COMPILE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture
def no_native():
    """Turn the native CPU kernel off for one test (``quantize`` then picks the compiled or eager kernel)."""
    from mxport.quantize import NATIVE_PATH

    saved = NATIVE_PATH.disabled_reason
    NATIVE_PATH.disabled_reason = "turned off by the no_native test fixture"
    try:
        yield NATIVE_PATH
    finally:
        NATIVE_PATH.disabled_reason = saved


@pytest.fixture
def fast_path(no_native):
    """Enable the torch.compile'd quantize kernel for one test, with the native kernel off so that
    ``fast=True`` means the compiled one."""
    from mxport.quantize import FAST_PATH

    saved = FAST_PATH.disabled_reason
    FAST_PATH.disabled_reason = None
    try:
        yield FAST_PATH
    finally:
        FAST_PATH.disabled_reason = saved
