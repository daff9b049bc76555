"""Quantize benchmark: BF16 -> MXFP8 rowwise with :func:`mxport.quantize`, against torchao and the memory
bound.

Rows (``run()``), every figure a median over ``runs`` timed calls after warm-up, all measured in the same
process, the contenders timed in interleaved rounds (:func:`interleaved_medians`) so that outside load hits
them alike:

* ``first call (compile)`` — seconds of the first ``quantize`` call of the process on the default path (it
  includes loading — or, once per machine, compiling — the native kernel and its self-check, or the
  ``torch.compile`` of the compiled kernel where that one is used); baseline: one steady-state call of the
  same shape.
* ``speed 4096x4096`` — quantize throughput in GB/s of bytes moved; baseline: torchao 0.18
  ``torchao.prototype.mx_formats.mx_tensor.to_mx(x, float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)`` on the
  same tensor; ratio = the speed-up (goal >= 10).
* ``memory bound 4096x4096`` — the same throughput against a ``Tensor.copy_`` of the same BF16 tensor (bytes
  read + written), ratio = the fraction of the memory bound reached (goal >= 0.25).
* ``throughput NxN`` — mxport vs torchao over a range of square sizes (the plot of ``mxport bench --plot``).
* ``model weights batched`` — the linear weights of a SmolLM2-135M-shaped model (per layer q/k/v/o 576x576,
  192x576, 192x576, 576x576, gate/up 1536x576, down 576x1536; 30 layers, 4 in quick mode; BF16), each into
  its own preallocated slot as a refit's send buffer does: :func:`mxport.quantize.quantize_many` (one batched
  call) against one ``quantize(x, out=...)`` call per tensor; ratio = the speed-up of batching.
* ``model weights memory bound`` — the same batched figure against one ``copy_`` of the same input bytes
  (bytes read + written); also on 1 thread (goal >= 0.4).
* ``fresh 8192x8192`` — ``quantize(x)`` of a BF16 8192x8192 tensor *without* ``out=`` (fresh outputs, above
  glibc's 32 MiB mmap threshold: every call maps new pages) against a ``copy_`` of the same BF16 tensor into
  a preallocated one; 1 thread (goal >= 0.6) and the default thread count.
* ``float32 8192x8192`` — ``quantize(x)`` of a float32 8192x8192 tensor against the same tensor in BF16,
  interleaved: nanoseconds per element, ratio float32 / BF16 (goal <= 1.3 on 1 thread; the default thread
  count too). ``model weights float32`` — the same for the SmolLM2-shaped weights batched (``quantize_many``).
* ``size sweep`` — the same fresh-output quantize, 1 thread, of ``(n / 4096, 4096)`` BF16 tensors for ``n`` =
  64K, 256K, ..., 256M elements (16M in quick mode), every size once per round (interleaved, so that load
  from other processes hits every size alike; each timed call right after an untimed one of the same size):
  nanoseconds per element per size, and the largest step up from one size to the next (goal: no size more
  than 25% slower per element than the size below it).

Bytes moved by a quantize of ``n`` BF16 elements: ``2n`` read + ``n`` FP8 written + ``n/32`` E8M0 bytes
written (the same count is used for torchao, so GB/s ratios are speed ratios).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .timing import measure

BENCHMARK = "quantize"
FULL_SIDE = 4096
QUICK_SIDE = 4096  # the headline shape in both modes: 1024² sits in L2 and flatters copy_ (~70 GB/s)
FULL_SWEEP = (256, 512, 1024, 2048, 4096)
QUICK_SWEEP = (128, 256, 512, 1024)


def quantize_bytes(numel: int) -> int:
    """Bytes a rowwise MXFP8 quantize of ``numel`` BF16 elements must move: 2 in + 1 out + 1/32 scale bytes.

    >>> quantize_bytes(4096 * 4096) / 2**20   # MiB for the 4096x4096 headline
    48.5
    """
    return 2 * numel + numel + (numel + 31) // 32


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _torchao_to_mx():
    """The torchao baseline ``x -> to_mx(x, e4m3, 32, RCEIL)``.

    Returns ``(fn, None)``, or ``(None, reason)`` when torchao is missing."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:  # noqa: BLE001 - torchao is optional; any import failure means "no baseline"
        return None, f"torchao unavailable: {type(exc).__name__}: {exc}"[:200]

    def fn(x: torch.Tensor):
        return to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)

    return fn, None


def interleaved_medians(fns: dict[str, Callable[[], object]], *, runs: int, warmup: int,
                        device=None, settle: int = 0) -> dict[str, float]:
    """Median seconds per call of each function, timed in rounds (one call of each per round, after ``warmup``
    untimed rounds), so that load from other processes hits every contender alike and ratios stay fair.
    ``settle``: untimed calls of a function right before each of its timed ones (its caches and TLB warm
    again after the other contenders' calls: on the 2-core VM a 64K-element quantize takes 60 us warm and
    300-440 us right after any 256 MB pass over memory)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            times[k].append(measure(fn, runs=1, warmup=settle, device=device).median)
    return {k: statistics.median(v) for k, v in times.items()}


def _row(metric: str, value: float, unit: str, baseline: str, ratio: float, goal: str,
         note: str = "") -> dict:
    return {"benchmark": BENCHMARK, "metric": metric, "value": float(value), "baseline": baseline,
            "ratio": float(ratio), "unit": unit, "goal": goal, "note": note}


def run(quick: bool = False) -> list[dict]:
    """Run the quantize benchmark; return rows (see the module docstring).

    ``quick=True``: the same 4096x4096 headline, 3 runs after 1 warm-up, sizes up to 1024² (a few seconds;
    plus ~20 s the first time where the compiled kernel is used). The default kernel is used in both modes:
    native where the CPU has AVX-512 or AVX2, else compiled when ``torch.compile`` works, else eager (``mxport
    info`` says; row notes name it). Runs on CUDA when available, else CPU.
    """
    device = _device()
    side = QUICK_SIDE if quick else FULL_SIDE
    sweep = QUICK_SWEEP if quick else FULL_SWEEP
    runs, warmup = (3, 1) if quick else (7, 2)
    ao_fn, ao_missing = _torchao_to_mx()
    gen = torch.Generator().manual_seed(0)

    def make(n: int) -> torch.Tensor:
        return torch.randn(n, n, generator=gen, dtype=torch.float32).to(device=device, dtype=torch.bfloat16)

    x = make(side)
    rows = _headline_rows(x, ao_fn, ao_missing, runs=runs, warmup=warmup, device=device)
    for n in sweep:
        xs = x if n == side else make(n)
        rows.append(_sweep_row(xs, ao_fn, ao_missing, runs=runs, warmup=warmup, device=device))
    rows += _model_rows(4 if quick else 30, runs=runs, warmup=warmup, device=device)
    if device.type == "cpu":
        with _threads(1):
            rows += [dict(r, metric=r["metric"] + ", 1 thread", goal="ratio >= 0.4")
                     for r in _model_rows(4 if quick else 30, runs=runs, warmup=warmup, device=device)[1:]]
    rows += _fresh_rows(runs=runs, warmup=warmup, device=device)
    rows += _f32_rows(runs=runs, warmup=warmup, device=device)
    rows += _model_f32_rows(4 if quick else 30, runs=runs, warmup=warmup, device=device)
    if device.type == "cpu":
        rows += _sweep_rows(1 << (24 if quick else 28), runs=runs, device=device)
    return rows


class _threads:
    """``torch.set_num_threads(n)`` inside a ``with`` block."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _fresh_rows(*, runs: int, warmup: int, device: torch.device) -> list[dict]:
    """Quantize of a fresh-output BF16 8192x8192 tensor against a copy_ of it: 1 thread and default."""
    from ..quantize import kernel_label
    from ..quantize import quantize as mx_quantize

    x = torch.randn(8192, 8192, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    dst = torch.empty_like(x)
    rows = []
    counts = [1, torch.get_num_threads()] if device.type == "cpu" else [torch.get_num_threads()]
    for n in dict.fromkeys(counts):
        with _threads(n):
            med = interleaved_medians({"mxport": lambda: mx_quantize(x), "copy": lambda: dst.copy_(x)},
                                      runs=runs, warmup=warmup, device=device)
        g_mx = quantize_bytes(x.numel()) / med["mxport"] / 1e9
        g_c = 2 * x.numel() * x.element_size() / med["copy"] / 1e9
        label = "1 thread" if n == 1 else f"{n} threads"
        rows.append(_row(f"fresh 8192x8192, {label}", g_mx, "GB/s", f"copy_ {g_c:.2f} GB/s", g_mx / g_c,
                         "ratio >= 0.6" if n == 1 else "informational",
                         f"quantize without out= (fresh outputs) {med['mxport'] * 1e3:.1f} ms vs copy_ of "
                         f"the same bf16 tensor {med['copy'] * 1e3:.1f} ms, {runs} interleaved runs; "
                         f"{kernel_label(x)}"))
    return rows


def _f32_rows(*, runs: int, warmup: int, device: torch.device) -> list[dict]:
    """Quantize of a float32 8192x8192 tensor against the same tensor in BF16, per element: 1 thread and
    default."""
    from ..quantize import kernel_label
    from ..quantize import quantize as mx_quantize

    x32 = torch.randn(8192, 8192, generator=torch.Generator().manual_seed(4)).to(device)
    x16 = x32.to(torch.bfloat16)
    rows = []
    counts = [1, torch.get_num_threads()] if device.type == "cpu" else [torch.get_num_threads()]
    for n in dict.fromkeys(counts):
        with _threads(n):
            med = interleaved_medians({"f32": lambda: mx_quantize(x32), "bf16": lambda: mx_quantize(x16)},
                                      runs=runs, warmup=warmup, device=device)
        f32, bf16 = (med[k] / x32.numel() * 1e9 for k in ("f32", "bf16"))
        label = "1 thread" if n == 1 else f"{n} threads"
        rows.append(_row(f"float32 8192x8192, {label}", f32, "ns/elem", f"bfloat16 {bf16:.3f} ns/elem",
                         f32 / bf16, "ratio <= 1.3" if n == 1 else "informational",
                         f"quantize without out= of the same values in float32 ({med['f32'] * 1e3:.1f} ms) "
                         f"and bfloat16 ({med['bf16'] * 1e3:.1f} ms), {runs} interleaved runs; ratio = "
                         f"float32 / bfloat16 per element; {kernel_label(x32)}"))
    return rows


def _model_f32_rows(layers: int, *, runs: int, warmup: int, device: torch.device) -> list[dict]:
    """The SmolLM2-shaped linear weights in float32 (a trainer's master weights) against the same in BF16,
    batched into preallocated slots, per element, 1 thread on CPU."""
    from ..quantize import quantize_many

    gen = torch.Generator().manual_seed(1)
    x32 = [torch.randn(s, generator=gen).to(device) for _ in range(layers) for s in SMOLLM2_LAYER]
    x16 = [x.to(torch.bfloat16) for x in x32]
    outs = [(torch.empty(x.shape, dtype=torch.uint8, device=device),
             torch.empty((x.shape[0], -(-x.shape[1] // 32)), dtype=torch.uint8, device=device)) for x in x32]
    numel = sum(x.numel() for x in x32)
    with _threads(1 if device.type == "cpu" else torch.get_num_threads()):
        med = interleaved_medians({"f32": lambda: quantize_many(x32, outs=outs),
                                   "bf16": lambda: quantize_many(x16, outs=outs)},
                                  runs=runs, warmup=warmup, device=device)
    f32, bf16 = (med[k] / numel * 1e9 for k in ("f32", "bf16"))
    label = ", 1 thread" if device.type == "cpu" else ""
    return [_row(f"model weights float32{label}", f32, "ns/elem", f"bfloat16 {bf16:.3f} ns/elem", f32 / bf16,
                 "ratio <= 1.3",
                 f"{len(x32)} weights of {layers} SmolLM2-135M layers ({numel / 1e6:.1f} M elements) "
                 f"batched into preallocated slots, float32 (master weights) {med['f32'] * 1e3:.2f} ms vs "
                 f"bfloat16 {med['bf16'] * 1e3:.2f} ms, {runs} interleaved runs; ratio = float32 / bfloat16 "
                 "per element")]


def _sweep_rows(top: int, *, runs: int, device: torch.device) -> list[dict]:
    """Fresh-output quantize per element over sizes 64K .. ``top`` elements (x4 steps), 1 thread, the sizes
    interleaved: each round times one call of each size, right after an untimed one of the same size. Timed
    one size after the other (as before), the sizes met different load from other processes: on the shared
    2-core VM the worst step of three such sweeps in a row was 1.48x, 2.66x and 1.50x, at 64M -> 256M, 4M ->
    16M and 4M -> 16M elements."""
    from ..quantize import quantize as mx_quantize

    sizes = [1 << b for b in range(16, top.bit_length(), 2)]
    gen = torch.Generator().manual_seed(3)
    xs = {n: torch.randn(n // 4096, 4096, generator=gen, dtype=torch.bfloat16) for n in sizes}
    with _threads(1):
        med = interleaved_medians({str(n): (lambda x=x: mx_quantize(x)) for n, x in xs.items()}, runs=runs,
                                  warmup=1, device=device, settle=1)
    per = {n: med[str(n)] / n * 1e9 for n in sizes}
    steps = [per[b] / per[a] for a, b in zip(sizes, sizes[1:], strict=False)]
    worst = max(range(len(steps)), key=steps.__getitem__)
    rows = [_row(f"size sweep {n >> 10}K elements, 1 thread", per[n], "ns/elem", "itself", 1.0, "plot",
                 "quantize without out=, (n/4096, 4096) bf16") for n in sizes]
    rows.append(_row("size sweep worst step", steps[worst], "x", f"{sizes[worst] >> 10}K -> "
                     f"{sizes[worst + 1] >> 10}K elements", steps[worst], "ratio <= 1.25",
                     "largest ratio of ns/elem between a size and the size below it (x4 steps), 1 thread; "
                     + ", ".join(f"{n >> 10}K: {v:.3f}" for n, v in per.items())))
    return rows


#: the linear weight shapes of one SmolLM2-135M layer: q, k, v, o, gate, up, down
SMOLLM2_LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def _model_rows(layers: int, *, runs: int, warmup: int, device: torch.device) -> list[dict]:
    """The rows of a SmolLM2-shaped set of linear weights: batched vs per-tensor quantize, vs a copy."""
    from ..components import compact_scale_shape
    from ..quantize import kernel_label, quantize, quantize_many

    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(s, generator=gen).to(device=device, dtype=torch.bfloat16)
          for _ in range(layers) for s in SMOLLM2_LAYER]
    outs = [(torch.empty(x.shape, dtype=torch.uint8, device=device),
             torch.empty(compact_scale_shape(tuple(x.shape), "rowwise"), dtype=torch.uint8, device=device))
            for x in xs]
    numel = sum(x.numel() for x in xs)
    flat = torch.cat([x.reshape(-1) for x in xs])
    dst = torch.empty_like(flat)

    def per_tensor():
        for x, o in zip(xs, outs, strict=True):
            quantize(x, out=o)

    med = interleaved_medians({"batched": lambda: quantize_many(xs, outs=outs), "per_tensor": per_tensor,
                               "copy": lambda: dst.copy_(flat)}, runs=runs, warmup=warmup, device=device)
    nbytes = quantize_bytes(numel)
    g_b, g_p = nbytes / med["batched"] / 1e9, nbytes / med["per_tensor"] / 1e9
    g_c = 2 * flat.numel() * flat.element_size() / med["copy"] / 1e9
    what = (f"{len(xs)} bf16 weights of {layers} SmolLM2-135M layers ({numel / 1e6:.1f} M elements) into "
            f"preallocated slots, {kernel_label(xs[0])}")
    return [
        _row("model weights batched", g_b, "GB/s", f"per-tensor quantize {g_p:.3f} GB/s", g_b / g_p,
             "ratio >= 1",
             f"{what}; median {med['batched'] * 1e3:.2f} ms batched vs {med['per_tensor'] * 1e3:.2f} ms "
             f"per tensor, {runs} interleaved runs"),
        _row("model weights memory bound", g_b, "GB/s", f"copy_ {g_c:.2f} GB/s", g_b / g_c, "ratio >= 0.4",
             f"{what}; copy_ of the same input bytes in one tensor (median {med['copy'] * 1e3:.2f} ms); "
             f"per tensor: {g_p / g_c:.3f} of it"),
    ]


def _headline_rows(x: torch.Tensor, ao_fn, ao_missing: str | None, *, runs: int, warmup: int,
                   device: torch.device) -> list[dict]:
    """The rows of the headline tensor ``x``: first call (compile), speed against torchao, memory bound."""
    from ..quantize import kernel_label
    from ..quantize import quantize as mx_quantize

    side = x.shape[0]
    numel = x.numel()
    nbytes = quantize_bytes(numel)
    path = kernel_label(x)
    shape_s = f"{side}x{side}"
    rows: list[dict] = []

    # first call of the process on the default path (includes the torch.compile of the fast kernel)
    t0 = time.perf_counter()
    mx_quantize(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    dst = torch.empty_like(x)
    contenders = {"mxport": lambda: mx_quantize(x), "copy": lambda d=dst: d.copy_(x)}
    if ao_fn is not None:
        contenders["torchao"] = lambda: ao_fn(x)
    med = interleaved_medians(contenders, runs=runs, warmup=warmup, device=device)
    mx_t = med["mxport"]
    rows.append(_row(
        "first call (compile)", first, "s", f"steady call {mx_t * 1e3:.2f} ms", first / mx_t, "-",
        f"{path}; first quantize call of this process, {shape_s} bf16; ratio = first / steady call",
    ))

    mx_gbps = nbytes / mx_t / 1e9
    if ao_fn is not None:
        ao_t = med["torchao"]
        ao_gbps = nbytes / ao_t / 1e9
        rows.append(_row(
            f"speed {shape_s}", mx_gbps, "GB/s", f"torchao to_mx RCEIL {ao_gbps:.3f} GB/s",
            mx_gbps / ao_gbps, "ratio >= 10",
            f"bf16 -> e4m3 rowwise, {path}; median {mx_t * 1e3:.2f} ms vs torchao {ao_t * 1e3:.1f} ms, "
            f"{runs} interleaved runs",
        ))
    else:
        rows.append(_row(f"speed {shape_s}", mx_gbps, "GB/s", "torchao to_mx RCEIL (not installed)", 0.0,
                         "ratio >= 10", ao_missing))

    copy_t = med["copy"]
    copy_gbps = 2 * x.numel() * x.element_size() / copy_t / 1e9
    rows.append(_row(
        f"memory bound {shape_s}", mx_gbps, "GB/s", f"copy_ {copy_gbps:.2f} GB/s",
        mx_gbps / copy_gbps, "ratio >= 0.25",
        f"copy_ of the same bf16 tensor (bytes read + written, median {copy_t * 1e3:.2f} ms); quantize moves "
        f"{nbytes / numel:.3f} B/elem; {path}",
    ))
    return rows


def _sweep_row(xs: torch.Tensor, ao_fn, ao_missing: str | None, *, runs: int, warmup: int,
               device: torch.device) -> dict:
    """The throughput row of one square tensor ``xs`` of the size sweep."""
    from ..quantize import kernel_for
    from ..quantize import quantize as mx_quantize

    n = xs.shape[0]
    b = quantize_bytes(xs.numel())
    sub = {"mxport": lambda xs=xs: mx_quantize(xs)}
    if ao_fn is not None:
        sub["torchao"] = lambda xs=xs: ao_fn(xs)
    # torchao's to_mx is torch.compile'd: each new size recompiles over its first calls (48 ms at 256x256
    # after one warm-up, 0.6 ms once warm), which inflated the sweep's ratios 50x: warm every size up well
    med = interleaved_medians(sub, runs=runs, warmup=max(warmup, 5), device=device)
    g_mx = b / med["mxport"] / 1e9
    if ao_fn is None:
        return _row(f"throughput {n}x{n}", g_mx, "GB/s", "torchao to_mx RCEIL (not installed)", 0.0,
                    "plot", ao_missing)
    g_ao = b / med["torchao"] / 1e9
    sub_path = kernel_for(xs)
    return _row(f"throughput {n}x{n}", g_mx, "GB/s", f"torchao to_mx RCEIL {g_ao:.3f} GB/s",
                g_mx / g_ao, "plot", f"{sub_path}; ratio = speed-up over torchao")
