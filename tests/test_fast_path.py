"""The torch.compile'd quantize kernel gives the same bytes as the eager kernel (design: one kernel function,
two execution modes)."""

from __future__ import annotations

import pytest
import torch

from mxport import quantize


def _special_tensor(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-40, 40, (m, k), generator=g).float())
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (64,), generator=g)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, 480.0, 2.0**-140, 3.4e38, -0.0])
    flat[idx] = specials.repeat(8)
    x[3] = 0.0  # an all-zero row
    return x


def _same(a, b):
    assert torch.equal(a.scale_inv, b.scale_inv)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(fp8_dtype=torch.float8_e5m2, rounding="floor", direction="columnwise"),
    dict(block_2d=True),
])
def test_compiled_kernel_is_bit_identical_to_eager(kwargs):
    from mxport.quantize import FAST_PATH

    for m, k, dtype in ((256, 576, torch.bfloat16), (200, 100, torch.float32)):
        x = _special_tensor(m, k, m + k).to(dtype)
        _same(quantize(x, kernel="compiled", **kwargs), quantize(x, kernel="eager", **kwargs))
    assert FAST_PATH.failed_reason is None, FAST_PATH.failed_reason


def test_fast_true_without_compile_raises(no_native):
    from mxport.quantize import FAST_PATH

    if FAST_PATH.available:
        pytest.skip("compile is enabled in this run")
    with pytest.raises(RuntimeError, match="fast=True"):
        quantize(torch.ones(2, 32), fast=True)


def test_compiled_kernels_take_only_the_tensor_and_its_sizes(monkeypatch):
    """One compiled kernel per element format / rounding, whose only inputs are x and its (dynamic) sizes: the
    scalar parameters are constants. Passed as arguments they became graph inputs (emax a symbolic int64), and
    on an H200 (torch 2.11) triton then failed to bitcast the int64 E8M0 arithmetic to float32, so the second
    element format / rounding never compiled. A new shape must not recompile."""
    import sys

    q = sys.modules["mxport.quantize"]
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=capture))
    monkeypatch.setattr(q, "FAST_PATH", q._FastPath())  # a fresh cache of compiled kernels
    cases = [(torch.float8_e4m3fn, "floor"), (torch.float8_e5m2, "floor"), (torch.float8_e4m3fn, "rceil")]
    for fp8, rounding in cases:
        for shape in ((300, 200), (301, 77)):
            x = _special_tensor(*shape, seed=shape[1])
            _same(quantize(x, fp8, rounding=rounding, kernel="compiled"),
                  quantize(x, fp8, rounding=rounding, kernel="eager"))
    assert q.FAST_PATH.failed_reason is None
    assert len(graphs) == len(cases)  # no recompile for the second shape
    for gm in graphs:
        inputs = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
        assert len(tensors) == 1 and tensors[0].dim() == 2  # x2 only: no scalar parameter became an input
        assert all(isinstance(v, torch.SymInt) for v in inputs if not isinstance(v, torch.Tensor))
        assert len(inputs) <= 3  # x2 and its two sizes


def test_native_kernel_on_avx2_cpus():
    """A CPU with AVX2 + F16C and a C compiler gets the native kernel.

    Before the AVX2 build only AVX-512 CPUs did, and quantize on AMD Zen ran the eager kernel, about 100x
    slower."""
    import shutil
    from pathlib import Path

    from mxport.quantize import NATIVE_PATH

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((set(ln.split(":", 1)[1].split()) for ln in info.splitlines() if ln.startswith("flags")),
                 set())
    if not {"avx2", "f16c"} <= flags or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("needs an x86-64 CPU with AVX2 + F16C and a C compiler")
    assert NATIVE_PATH.available, NATIVE_PATH.disabled_reason
