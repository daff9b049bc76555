"""Export benchmark: export_components of a TE-layout weight (views / unswizzle) against quantize of it.

Rows (``run()``), medians over ``runs`` timed calls after warm-up, all measured in the same process on CUDA
when available, else CPU:

* ``quantize NxN`` — :func:`mxport.quantize` of the BF16 weight on its default kernel (native, compiled or
  eager: the note names it); the baseline of the rows below.
* ``view export NxN`` — :func:`mxport.export_components` of a TE rowwise storage whose scales need no crop of
  the last dimension and no unswizzle (N % 128 == 0): views only. Ratio to quantize; goal: O(1), microseconds.
* ``view export 256x256`` — the same on a small weight; ratio = small / large (about 1: independent of size).
* ``swizzled export NxN`` — the same storage with ``_with_gemm_swizzled_scales`` (one unswizzle of the
  scales: the native library's one-pass routine on CPU, a permute elsewhere). Ratio to quantize; goal <= 0.05.

N = 8192 (quick: 2048).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .timing import measure

BENCHMARK = "export"
FULL_SIDE = 8192
QUICK_SIDE = 2048
SMALL_SIDE = 256


def _row(metric: str, value: float, unit: str, baseline: str, ratio: float, goal: str,
         note: str = "") -> dict:
    return {"benchmark": BENCHMARK, "metric": metric, "value": float(value), "baseline": baseline,
            "ratio": float(ratio), "unit": unit, "goal": goal, "note": note}


def te_storage(components, swizzled: bool) -> SimpleNamespace:
    """A TE ``MXFP8TensorStorage``-shaped object holding ``components`` (rowwise) in TE's layout."""
    from ..sources.te import to_te_layout

    data, scale = to_te_layout(components, swizzled=swizzled)
    return SimpleNamespace(_rowwise_data=data, _rowwise_scale_inv=scale, _columnwise_data=None,
                           _columnwise_scale_inv=None, _fp8_dtype=7, _with_gemm_swizzled_scales=swizzled)


def run(quick: bool = False) -> list[dict]:
    """Run the export benchmark; return rows (see the module docstring).

    ``quick=True``: a 2048x2048 weight, 5 runs after 1 warm-up for quantize (seconds on 2 CPU cores; more the
    first time where the compiled kernel is used); the export timings always use >= 30 runs after 30 warm-ups
    since each call takes microseconds.
    """
    from ..export import export_components
    from ..quantize import kernel_label, quantize

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    side = QUICK_SIDE if quick else FULL_SIDE
    q_runs, q_warm = (5, 1) if quick else (7, 2)
    # many warm-ups: the first calls after a large op are slow
    e_runs, e_warm = (30, 30) if quick else (50, 30)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(side, side, generator=gen).to(device=device, dtype=torch.bfloat16)
    shape_s = f"{side}x{side}"
    path = kernel_label(x)

    # Exports are timed first: right after a compiled quantize, short CPU ops run ~100x slower for about a
    # second (inductor's worker threads / processes settling), which would time that, not the export.
    comps = quantize(x, fast=False)  # the same bytes as the default path (tests check bit-identity)
    plain = te_storage(comps, swizzled=False)
    swz = te_storage(comps, swizzled=True)
    small = te_storage(quantize(torch.randn(SMALL_SIDE, SMALL_SIDE, generator=gen).to(device)),
                       swizzled=False)
    view_t = measure(lambda: export_components(plain), runs=e_runs, warmup=e_warm, device=device).median
    small_t = measure(lambda: export_components(small), runs=e_runs, warmup=e_warm, device=device).median
    sw_t = measure(lambda: export_components(swz), runs=e_runs, warmup=e_warm, device=device).median
    q_t = measure(lambda: quantize(x), runs=q_runs, warmup=q_warm, device=device).median

    q_label = f"quantize {shape_s} {q_t * 1e3:.2f} ms"
    return [
        _row(f"quantize {shape_s}", q_t * 1e3, "ms", "itself", 1.0, "-",
             f"bf16 -> e4m3 rowwise, {path}, {device.type}; the baseline of this benchmark's rows"),
        _row(f"view export {shape_s}", view_t * 1e6, "us", q_label, view_t / q_t, "O(1): microseconds",
             f"TE rowwise storage, unpadded last dim, unswizzled: data and scale views only; {e_runs} runs"),
        _row(f"view export {SMALL_SIDE}x{SMALL_SIDE}", small_t * 1e6, "us",
             f"view export {shape_s} {view_t * 1e6:.1f} us", small_t / view_t, "ratio ~ 1 (size-independent)",
             f"the same export on a weight 1/{(side // SMALL_SIDE) ** 2} the size"),
        _row(f"swizzled export {shape_s}", sw_t * 1e6, "us", q_label, sw_t / q_t, "ratio <= 0.05",
             f"_with_gemm_swizzled_scales: one unswizzle (copy) of {comps.scale_inv.numel()} scale bytes"),
    ]
