"""quantize(): float tensors -> MXFP8 components, bit-exact with Transformer Engine ("rceil") or OCP MX
("floor").

One kernel function (``_rowwise_kernel``) holds the whole algorithm; the eager path calls it directly and the
compiled path calls a ``torch.compile``d copy of the same function, so the two cannot drift apart. On CPUs
with AVX-512 or AVX2 a native C kernel (:mod:`mxport.native`, the same algorithm in one pass) is used instead;
it is checked byte for byte against ``_rowwise_kernel`` on a probe tensor before its first use (tests check
all three agree).

Sources: docs/format.md ("Elements, blocks, scales", "Rounding rules"); TE
``common/cast/mxfp8/quantize_mxfp8.cuh`` and ``common/util/ptx.cuh``; OCP MX v1.0 §6.3.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from . import native
from .components import MXFP8Components, check_block_size, check_direction, compact_scale_shape
from .formats import (
    BLOCK_SIZE,
    FLOAT_DTYPES,
    ElementFormat,
    allocating,
    as_e8m0_bytes,
    ceil_div,
    describe,
    e8m0_floor,
    e8m0_multiplier,
    e8m0_rceil,
    element_format,
    is_alloc_failure,
    is_fp8_dtype,
    numel_of,
    saturating_cast,
)
from .pages import fresh_bytes

ROUNDINGS = ("rceil", "floor")
# : tensors with fewer elements than this use the eager path under ``fast=None`` (compiled launch overhead
# wins).
FAST_MIN_NUMEL = 1 << 15


def _rowwise_kernel(x2: torch.Tensor, max_norm: float, inv_max_norm: float, emax: int, fp8_dtype: torch.dtype,
                    floor: bool, block_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP8 cast of a 2-D ``(M, K)`` tensor, blocks of 32 along K (32×32 with ``block_2d``).

    Returns FP8 value bytes ``(M, K)`` and E8M0 bytes ``(M, ceil(K/32))``, both uint8 (the caller views the
    values as FP8 outside the compiled region, which keeps the compiled output one fused pass). A short last
    block is padded with zeros, which never change an amax; NaN elements are skipped in the amax.
    """
    m, k = x2.shape
    nb = ceil_div(k, BLOCK_SIZE)
    xf = x2.to(torch.float32)
    pad = nb * BLOCK_SIZE - k
    if pad:
        xf = F.pad(xf, (0, pad))
    xb = xf.reshape(m, nb, BLOCK_SIZE)
    a = xb.abs()
    # (m, nb); a != a: NaN test that vectorizes
    amax = torch.where(a != a, torch.zeros_like(a), a).amax(dim=-1)
    if block_2d:
        mb = ceil_div(m, BLOCK_SIZE)
        am = F.pad(amax, (0, 0, 0, mb * BLOCK_SIZE - m)).reshape(mb, BLOCK_SIZE, nb).amax(dim=1)
        amax = am.repeat_interleave(BLOCK_SIZE, dim=0)[:m]
    if floor:
        e = e8m0_floor(amax, emax)
    else:
        e = e8m0_rceil(amax * inv_max_norm)  # f32(amax * f32(1/max_norm)); inv_max_norm is f32-exact
    mult = e8m0_multiplier(e)
    q = saturating_cast(xb * mult.unsqueeze(-1), max_norm, fp8_dtype).reshape(m, nb * BLOCK_SIZE)
    if pad:
        q = q[:, :k].contiguous()
    return q, e.to(torch.uint8)  # q: uint8 bytes of fp8_dtype


# : graphs one compiled kernel (one element format, rounding and block shape) may hold: input dtypes (3) x
# padded K : (2), with room to spare
RECOMPILE_LIMIT = 64


def _dynamo_recompile_limit(limit: int):
    """Raise dynamo's per-function recompile limit (default 8) for the fast path's calls only."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(limit, getattr(cfg, name))})


def _compile_options() -> dict | None:
    """Inductor options for the fast path: realize per-block intermediates (the scale) of more than 10 ops
    once per block instead of recomputing them for each of the block's 32 elements (about 30% faster on
    CPU)."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "realize_opcount_threshold"):
        return {"realize_opcount_threshold": 10}
    return None


def _bound_kernel(params: tuple):
    """``_rowwise_kernel`` with its scalar parameters (max_norm, inv_max_norm, emax, fp8_dtype, floor,
    block_2d) closed over, in a code object of its own, compiled without ``dynamic=True`` (only x's sizes are
    marked dynamic): the parameters are constants of the compiled kernel. Passed as arguments under
    ``dynamic=True`` they became graph inputs — ``emax`` a symbolic int64 — and on an H200 (torch 2.11) triton
    then failed to bitcast the int64 E8M0 arithmetic to float32, so the floor rounding (and, after it, every
    other kernel) never compiled there."""
    def kernel(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rowwise_kernel(x2, *params)
    tag = "_".join(str(p).replace("torch.", "").replace(".", "p").replace("-", "m") for p in params)
    kernel.__code__ = kernel.__code__.replace(co_name=f"mxfp8_kernel_{tag}")
    return kernel


class _FastPath:
    """Lazily compiled copies of ``_rowwise_kernel``, one per set of scalar parameters (element format,
    rounding, block shape); disabled for good after one failure (with a warning).

    ``failed_reason``: why it cannot run at all (no ``torch.compile``, a compile failure).
    ``disabled_reason``: why the automatic choice (``kernel=None``) does not pick it: the failure, or
    ``MXPORT_DISABLE_COMPILE``; an
    explicit ``quantize(..., kernel="compiled")`` still runs it then."""

    def __init__(self) -> None:
        self._fns: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.failed_reason: str | None = (None if hasattr(torch, "compile")
                                          else "torch.compile is not available")
        self.disabled_reason: str | None = self.failed_reason
        if self.failed_reason is None and os.environ.get("MXPORT_DISABLE_COMPILE", "") not in ("", "0"):
            self.disabled_reason = "MXPORT_DISABLE_COMPILE is set"

    @property
    def available(self) -> bool:
        """True when the automatic choice may pick it."""
        return self.disabled_reason is None

    def __call__(self, x2: torch.Tensor, *params):
        with self._lock:
            fn = self._fns.get(params)
            if fn is None:
                fn = self._fns[params] = torch.compile(_bound_kernel(params), options=_compile_options())
        try:
            for dim in range(x2.dim()):  # any M, K without a recompile; the parameters stay constants
                torch._dynamo.maybe_mark_dynamic(x2, dim)
            with _dynamo_recompile_limit(RECOMPILE_LIMIT):
                return fn(x2)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the eager kernel
            if is_alloc_failure(exc):  # the input's size, not the compiler: the eager kernel would fail alike
                raise
            self.disabled_reason = self.failed_reason = (
                f"torch.compile failed: {type(exc).__name__}: {exc}"[:500])
            warnings.warn(f"mxport: fast quantize path disabled, using eager ({self.disabled_reason})",
                          stacklevel=3)
            return _rowwise_kernel(x2, *params)


FAST_PATH = _FastPath()


def _probe_inputs() -> list[torch.Tensor]:
    """Small tensors that reach every branch of the kernels: one full group of 16 blocks and a short last
    block (K = 600), a full and a short group of 32 rows (M = 36), NaN / ±Inf / ±0 / subnormals / FP32 max /
    FP8 ties and rounding edges, many binades."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(36, 600, generator=g) * torch.exp2(torch.randint(-30, 30, (36, 600), generator=g).float())
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-40, 3.4e38,
                            480.0, 464.0, 448.0, 61440.0, 2.0 ** -10, 2.0 ** -9 * 1.5, 2.0 ** -17 * 3, 1.0])
    x[1, :16] = special
    x[2, 560:576] = special.flip(0)
    x[3] = x[3] * 1e-30
    x[34, 100] = float("nan")
    return [x, x.to(torch.bfloat16), x.to(torch.float16)]


def _check_native_swizzle(lib) -> None:
    """The native swizzle / unswizzle put every byte of a probe grid (partial tiles, 16-column chunks, a
    transposed view) where the cuBLAS ``VEC32_UE8M0`` layout does (the offset formula of
    :func:`mxport.layouts.swizzle`); NativeUnavailable otherwise."""
    g = torch.Generator().manual_seed(5)
    grid = torch.randint(0, 256, (300, 45), generator=g, dtype=torch.uint8)
    for src in (grid, grid.t()):
        r, c = src.shape
        pr, pc = ceil_div(r, 128) * 128, ceil_div(c, 4) * 4
        rows, cols = torch.arange(r).view(-1, 1), torch.arange(c).view(1, -1)
        at = ((rows // 128 * (pc // 4) + cols // 4) * 512 + rows % 32 * 16 + rows % 128 // 32 * 4 + cols % 4)
        want = torch.zeros(pr * pc, dtype=torch.uint8)
        want[at.reshape(-1)] = src.reshape(-1)
        want = want.view(pr, pc)
        got = native.swizzle(lib, src, torch.empty((pr, pc), dtype=torch.uint8))
        back = native.unswizzle(lib, want, r, c, torch.empty((r, c), dtype=torch.uint8))
        if not (torch.equal(want, got) and torch.equal(back, src)):
            raise native.NativeUnavailable(f"self-check failed: the swizzle of a {tuple(src.shape)} grid "
                                           "differs from the cuBLAS layout")


class _NativePath:
    """The native CPU kernel (:mod:`mxport.native`), built and loaded lazily, checked against the eager kernel
    on probe tensors before first use; disabled for good (with the reason) when any of that fails.

    ``failed_reason``: why it cannot run at all (build, load or self-check failed). ``disabled_reason``: why
    the automatic choice (``kernel=None``) does not pick it: the failure, or ``MXPORT_DISABLE_NATIVE``; an
    explicit
    ``quantize(..., kernel="native")`` still builds and runs it then."""

    def __init__(self) -> None:
        self._lib = None
        self._lock = threading.Lock()
        self.failed_reason: str | None = None
        self.disabled_reason: str | None = None
        if os.environ.get(native.ENV_DISABLE, "") not in ("", "0"):
            self.disabled_reason = f"{native.ENV_DISABLE} is set"

    @property
    def available(self) -> bool:
        """True when the automatic choice may pick it: built, loaded and self-checked (builds it on first
        call)."""
        return self.disabled_reason is None and self.loaded()

    def loaded(self) -> bool:
        """Build, load and self-check the kernel once (whatever ``disabled_reason`` says); True when it
        works."""
        if self._lib is None and self.failed_reason is None:
            with self._lock:
                if self._lib is None and self.failed_reason is None:
                    self._load()
        return self._lib is not None

    def isa(self) -> str | None:
        """The instruction set the loaded kernel was built for (``"avx512"`` or ``"avx2"``), or None when it
        is not loaded."""
        return native.isa(self._lib) if self._lib is not None else None

    def _load(self) -> None:
        try:
            lib = native.load(native.build())
            for x, fmt, floor, block_2d in itertools.product(
                    _probe_inputs(), (element_format(torch.float8_e4m3fn), element_format(torch.float8_e5m2)),
                    (False, True), (False, True)):
                want = _rowwise_kernel(x, *_kernel_args(fmt, floor, block_2d))
                got = native.quantize_rows(lib, x, *_native_args(fmt, floor), block_2d=block_2d)
                if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
                    raise native.NativeUnavailable(
                        f"self-check failed: {x.dtype} -> {fmt.name}, {'floor' if floor else 'rceil'}"
                        f"{', 32x32 blocks' if block_2d else ''} differs from the eager kernel")
            _check_native_swizzle(lib)
        except native.NativeUnavailable as exc:
            self._fail(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - anything unexpected disables the native path, never quantize
            self._fail(f"native kernel failed to load: {type(exc).__name__}: {exc}")
            return
        self._lib = lib

    def _fail(self, reason: str) -> None:
        self.failed_reason = reason[:500]
        self.disabled_reason = self.disabled_reason or self.failed_reason

    def lib_for(self, t: torch.Tensor):
        """The loaded library when the automatic choice may run it on ``t`` (a CPU tensor), else None."""
        return self._lib if t.device.type == "cpu" and self.available else None

    @staticmethod
    def takes(x2: torch.Tensor) -> bool:
        """True for the inputs the kernel handles: a CPU float32 / bfloat16 / float16 tensor."""
        return x2.device.type == "cpu" and x2.dtype in native.INPUT_CODES

    def supports(self, x2: torch.Tensor) -> bool:
        """True when the automatic choice runs it for this input (:meth:`takes` and :attr:`available`)."""
        return self.takes(x2) and self.available

    def __call__(self, x2: torch.Tensor, fmt: ElementFormat, floor: bool, block_2d: bool = False,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return native.quantize_rows(self._lib, x2, *_native_args(fmt, floor), block_2d=block_2d, out=out)

    def many(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], fmt: ElementFormat,
             floor: bool, sums: native.StreamSums | None = None) -> None:
        """Rowwise quantize of several ``(x2, q, e)`` jobs in batched native calls (:func:`quantize_many`),
        optionally summing the outputs into ``sums``."""
        native.quantize_rows_many(self._lib, jobs, *_native_args(fmt, floor), sums=sums)


NATIVE_PATH = _NativePath()


def _reset_locks_after_fork() -> None:
    """A fork while another thread held a path's lock (building the native kernel, compiling) would leave the
    child waiting forever on a lock nobody owns: the child gets fresh locks (an unfinished build is
    redone)."""
    NATIVE_PATH._lock = threading.Lock()
    FAST_PATH._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_after_fork)


def _kernel_args(fmt: ElementFormat, floor: bool, block_2d: bool) -> tuple:
    """The trailing arguments of ``_rowwise_kernel`` for an element format and rounding."""
    return (fmt.max_norm, float(np.float32(1.0) / np.float32(fmt.max_norm)), fmt.emax, fmt.dtype, floor,
            block_2d)


def _native_args(fmt: ElementFormat, floor: bool) -> tuple:
    """The trailing arguments of :func:`mxport.native.quantize_rows` (same numbers as
    :func:`_kernel_args`)."""
    return (0 if fmt.dtype == torch.float8_e4m3fn else 1, floor,
            float(np.float32(1.0) / np.float32(fmt.max_norm)), fmt.emax)


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError("x must be a torch.Tensor of float32/bfloat16/float16 values, "
                        f"got {type(x).__name__}")
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"x must be a plain dense tensor, got the tensor subclass {type(x).__name__} (a quantized or "
            "wrapped tensor's nominal dtype is not its storage); use mxport.export_components for MXFP8 "
            "producers"
        )
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"x must be a dense (strided) tensor, got layout {x.layout}")
    if is_fp8_dtype(x.dtype):
        raise TypeError(
            f"x must be a high-precision float tensor (float32/bfloat16/float16), got FP8 ({x.dtype}); "
            "use mxport.export_components for tensors that are already MXFP8"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a float32/bfloat16/float16 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (blocks run along the last one), "
                         "got a 0-d tensor")


def _check_bool(value, argname: str) -> bool:
    """A flag: a Python (or numpy) bool, never an int / string read for its truth (``block_2d="no"`` is
    True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{argname} must be a bool (True or False), got {describe(value)}")


def _check_rounding(rounding) -> str:
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be 'rceil' or 'floor', got {describe(rounding)}")
    return rounding


#: the kernels ``quantize(..., kernel=...)`` can be told to run (all give identical bytes)
KERNELS = ("native", "compiled", "eager")


def kernel_for(x2: torch.Tensor, *, fast: bool | None = None, kernel: str | None = None) -> str:
    """Which kernel :func:`quantize` runs for the 2-D ``(M, K)`` view ``x2``: ``"native"``, ``"compiled"`` or
    ``"eager"`` (``fast`` and ``kernel`` as in :func:`quantize`).

    ``kernel`` names one (:data:`KERNELS`): it runs whatever ``MXPORT_DISABLE_NATIVE`` /
    ``MXPORT_DISABLE_COMPILE`` say (they steer the automatic choice only); RuntimeError when it cannot run
    here (no AVX-512 or AVX2 / a failed build, a failed compile, an input the native kernel does not take).
    ``kernel=None`` chooses by ``fast``: ``fast=None``: native where it supports the input (x86-64 CPU with
    AVX-512 or AVX2, float32 / bfloat16 / float16), else compiled for ``>= FAST_MIN_NUMEL`` elements when
    ``torch.compile`` works, else eager. ``fast=True``: native or compiled, RuntimeError when neither is
    available. ``fast=False``: eager.
    """
    if fast is not None and not isinstance(fast, bool):
        raise TypeError(f"fast must be None, True or False, got {describe(fast)}")
    if kernel is not None:
        return _named_kernel(x2, kernel, fast)
    if fast is False or x2.numel() == 0:
        return "eager"
    if NATIVE_PATH.supports(x2):
        return "native"
    if fast is None:
        return "compiled" if FAST_PATH.available and x2.numel() >= FAST_MIN_NUMEL else "eager"
    if not FAST_PATH.available:
        why_native = NATIVE_PATH.disabled_reason or "does not take this input"
        raise RuntimeError(f"fast=True but no fast kernel is available (native: {why_native}; "
                           f"compiled: {FAST_PATH.disabled_reason})")
    return "compiled"


def _named_kernel(x2: torch.Tensor, kernel, fast) -> str:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be None, 'native', 'compiled' or 'eager', got {describe(kernel)}")
    if fast is not None:
        raise ValueError(f"give fast or kernel, not both (fast={fast}, kernel={kernel!r})")
    if kernel == "native":
        if not NATIVE_PATH.takes(x2):
            raise RuntimeError(f"kernel='native' takes CPU float32/bfloat16/float16 input, got {x2.dtype} on "
                               f"{x2.device}")
        if not NATIVE_PATH.loaded():
            raise RuntimeError(f"kernel='native' is not available here: {NATIVE_PATH.failed_reason}")
    elif kernel == "compiled" and FAST_PATH.failed_reason is not None:
        raise RuntimeError(f"kernel='compiled' is not available here: {FAST_PATH.failed_reason}")
    return kernel if x2.numel() else "eager"  # nothing to compute: no build, no compile


def _check_out(out, x: torch.Tensor, fmt: ElementFormat, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``quantize``'s ``out``; return ``(values, scales)`` as 2-D ``(M, K)`` / ``(M, ceil(K/32))``
    uint8 views of the caller's tensors."""
    values, scales = _check_out_layout(out, x, fmt, direction)
    for a, b, what in ((out[0], x, "out[0] (values) and x"), (out[1], x, "out[1] (scales) and x"),
                       (out[0], out[1], "out[0] (values) and out[1] (scales)")):
        if _overlap(a, b):
            raise ValueError(f"{what} share memory: out must not overlap the input or each other")
    return values, scales


def _check_out_layout(out, x: torch.Tensor, fmt: ElementFormat, direction: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_check_out` but for overlaps (the caller checks them: :func:`_check_disjoint` for a batch):
    direction, pair, dtypes, shapes, layout and device; return the 2-D uint8 views."""
    if direction != "rowwise":
        raise ValueError("out is supported for direction='rowwise' only, "
                         f"got direction={describe(direction)}")
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(t, torch.Tensor) for t in out)):
        raise TypeError("out must be a (values, scales) pair of tensors")
    values, scales = out
    shape = x.shape
    k = shape[-1]
    kb = ceil_div(k, BLOCK_SIZE)
    if values.dtype not in (fmt.dtype, torch.uint8):
        raise TypeError(f"out[0] (values) must be {fmt.dtype} or torch.uint8, got {values.dtype}")
    scales_u8 = as_e8m0_bytes(scales, argname="out[1] (scales)")
    for name, t, ok, want in (
            ("out[0] (values)", values, values.shape == shape, shape),
            ("out[1] (scales)", scales, scales.shape[:-1] == shape[:-1] and scales.shape[-1:] == (kb,),
             (*shape[:-1], kb))):
        if not ok:
            raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} must be on {x.device}, got {t.device}")
    values_u8 = values if values.dtype == torch.uint8 else values.view(torch.uint8)
    if len(shape) == 2:  # already (M, K) / (M, ceil(K/32))
        return values_u8, scales_u8
    m = numel_of(shape[:-1])
    return values_u8.reshape(m, k), scales_u8.reshape(m, kb)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` byte addresses a strided tensor's elements can touch (empty for an empty tensor;
    torch strides are never negative)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (extent + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors on the same device may share bytes (same storage, intersecting spans)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def kernel_label(x: torch.Tensor) -> str:
    """One line naming the kernel ``quantize(x)`` runs by default, with the reason when it is the eager one
    (for reports and benchmark notes)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    if x2.dtype == torch.float64:
        x2 = x2.to(torch.float32)
    kind = kernel_for(x2)
    if kind == "native":
        return f"native ({NATIVE_PATH.isa().upper().replace('AVX512', 'AVX-512')} C kernel)"
    if kind == "compiled":
        return "compiled (torch.compile)"
    why = [f"native: {NATIVE_PATH.disabled_reason or 'does not take this input'}",
           f"compiled: {FAST_PATH.disabled_reason or 'below FAST_MIN_NUMEL'}"]
    return f"eager ({'; '.join(why)})"


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    direction: str = "rowwise",
    rounding: str = "rceil",
    block_2d: bool = False,
    block_size: int = BLOCK_SIZE,
    fast: bool | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernel: str | None = None,
    nonzero_scales: bool = False,
) -> MXFP8Components:
    """Quantize a float tensor to MXFP8: FP8 values plus one E8M0 shared scale per block of 32.

    Args:
        x: float32 / bfloat16 / float16 (float64 is read as float32) tensor of any rank >= 1, any device,
            contiguous or not, possibly empty. ``M = prod(x.shape[:-1])``, ``K = x.shape[-1]``.
        fp8_dtype: element format, ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        direction: ``"rowwise"`` (blocks along K; scales ``(*x.shape[:-1], ceil(K/32))``) or ``"columnwise"``
            (blocks along M; scales ``(ceil(M/32), K)``). Values keep the logical shape either way.
        rounding: ``"rceil"`` (default; TE / cuBLAS / ModelOpt / vLLM: smallest power of two >= amax/max_norm)
            or ``"floor"`` (OCP MX v1.0 §6.3: floor(log2 amax) - emax_elem).
        block_2d: amax over 32×32 blocks of the 2-D ``(M, K)`` view (TE ``with_2d_quantization``, weights);
            the scale keeps the compact layout of ``direction``, repeated over the block's 32 rows (columns).
        block_size: must be 32.
        fast: ``None`` picks the fastest kernel that takes the input (:func:`kernel_for`: the native C kernel
            on CPU, else the ``torch.compile``d one for large tensors, else eager); ``True`` requires a fast
            kernel (native or compiled); ``False`` forces eager. All give identical bytes.
        kernel: ``None`` (choose by ``fast``), or the kernel to run: ``"native"``, ``"compiled"`` or
            ``"eager"`` (:func:`kernel_for`; it runs even where ``MXPORT_DISABLE_NATIVE`` /
            ``MXPORT_DISABLE_COMPILE``, which steer the automatic choice, are set). Not together with
            ``fast``.
        nonzero_scales: write E8M0 byte 1 (2^-126) for every block whose scale byte would be 0, as NeMo-RL
            does for FlashInfer's TRT-LLM MXFP8 kernels, which reject byte 0 (see :func:`lift_zero_scales`:
            the block's values are re-encoded for that scale, so decoding stays right). Off by default.
        out: optional ``(values, scales)`` to write the result into, rowwise only (e.g. slots of a refit send
            arena): ``values`` contiguous, ``x.shape``, dtype ``fp8_dtype`` or uint8; ``scales`` contiguous,
            the rowwise scale shape, uint8 or ``float8_e8m0fnu``; both on ``x.device``, overlapping neither
            ``x`` nor each other. The native kernel writes them directly (no temporary, no page faults of
            fresh outputs); other kernels copy into them. The returned components are views of them
            (``scale_inv`` as uint8 bytes).

    A short last block (K not a multiple of 32) keeps its own scale from its valid elements; blocks never
    cross rows. NaN elements are skipped in the amax and stay NaN; Inf saturates to ±max_norm (amax Inf gives
    E = 254); an all-zero block gets E = 0 (1 with ``nonzero_scales``).

    Returns:
        :class:`MXFP8Components` on ``x.device``.

    Raises:
        TypeError: ``x`` not a tensor, an integer / bool / complex / FP8 tensor; bad ``fp8_dtype`` (anything
            but the two MXFP8 element dtypes, e.g. ``float8_e4m3fnuz`` or ``float8_e8m0fnu``); ``block_2d``
            or ``nonzero_scales`` not a bool; ``fast`` not None / True / False.
        ValueError: 0-d ``x``; unknown ``direction`` or ``rounding``; ``block_size`` != 32.
        TooLargeError (a MemoryError and a ValueError): the outputs cannot be allocated (a huge view).
        RuntimeError: ``fast=True`` where no fast kernel is available; a ``kernel`` that cannot run here.
        ValueError: an unknown ``kernel``, or ``kernel`` with ``fast``.
        TypeError / ValueError: ``out`` not a pair of tensors of the dtypes, shapes, device and layout above,
            overlapping ``x`` or each other, or given with ``direction="columnwise"``.
    """
    _check_input(x)
    fmt: ElementFormat = element_format(fp8_dtype)
    if not isinstance(direction, str):
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {describe(direction)}")
    check_direction(direction)
    check_block_size(block_size)
    _check_rounding(rounding)
    block_2d = _check_bool(block_2d, "block_2d")
    nonzero = _check_bool(nonzero_scales, "nonzero_scales")
    with allocating("x", x):
        return _quantize(x, fmt, direction, rounding, block_2d, fast, out, kernel, nonzero)


def _quantize(x: torch.Tensor, fmt: ElementFormat, direction: str, rounding: str, block_2d: bool, fast,
              out, kernel: str | None, nonzero: bool = False) -> MXFP8Components:
    """:func:`quantize` once its arguments are checked."""
    shape = tuple(x.shape)
    k = shape[-1]
    m = numel_of(shape[:-1])
    out_bytes = None if out is None else _check_out(out, x, fmt, direction)
    x2 = x.reshape(m, k)
    if x2.dtype == torch.float64:
        x2 = x2.to(torch.float32)
    if direction == "columnwise" and not block_2d:
        # columnwise blocks = rowwise blocks of the transpose (copied: strided reads are slower)
        x2 = x2.t().contiguous()
    floor = rounding == "floor"
    kernel = kernel_for(x2, fast=fast, kernel=kernel)
    if kernel == "native":
        q, e = NATIVE_PATH(x2, fmt, floor, block_2d, out=out_bytes)
    elif kernel == "compiled":
        q, e = FAST_PATH(x2, *_kernel_args(fmt, floor, block_2d))
    else:
        q, e = _rowwise_kernel(x2, *_kernel_args(fmt, floor, block_2d))
    if nonzero:
        q, e = _lift_rows(q, e, fmt)
    if out_bytes is not None:
        if kernel != "native" or nonzero:
            out_bytes[0].copy_(q)
            out_bytes[1].copy_(e)
        return MXFP8Components(out[0].view(fmt.dtype), as_e8m0_bytes(out[1]), "rowwise")
    q = q.view(fmt.dtype)

    if direction == "rowwise":
        return MXFP8Components(q.reshape(shape), e.reshape(*shape[:-1], ceil_div(k, BLOCK_SIZE)), "rowwise")
    if block_2d:
        # the 2-D block scale, laid out columnwise: entry (bm, k) = scale of block (bm, k // 32)
        e_col = e[::BLOCK_SIZE].repeat_interleave(BLOCK_SIZE, dim=1)[:, :k].contiguous()
        return MXFP8Components(q.reshape(shape), e_col, "columnwise")
    return MXFP8Components(q.t().contiguous().reshape(shape), e.t().contiguous(), "columnwise")


def _lift_rows(q: torch.Tensor, e: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lift_zero_scales` on rowwise 2-D bytes: ``q`` uint8 ``(M, K)`` values, ``e`` uint8
    ``(M, ceil(K/32))`` scales; returns them unchanged (the same tensors) when no scale byte is 0."""
    zero = e == 0
    if not bool(zero.any()):
        return q, e
    k = q.shape[-1]
    in_zero_block = zero.repeat_interleave(BLOCK_SIZE, dim=-1)[..., :k]
    v = q.view(fmt.dtype).to(torch.float32)
    halved = saturating_cast(v * 0.5, fmt.max_norm, fmt.dtype)  # same value at twice the scale, RNE
    keep = ~in_zero_block | (v == 0) | torch.isnan(v)  # zeros and NaNs keep their bytes
    return torch.where(keep, q, halved), torch.where(zero, torch.ones_like(e), e)


def lift_zero_scales(components: MXFP8Components) -> MXFP8Components:
    """NeMo-RL's rule for FlashInfer's TRT-LLM MXFP8 kernels (which reject scale byte 0): every block whose
    E8M0 byte is 0 gets byte 1 (``torch.where(scale == 0, 1, scale)`` in NeMo-RL's
    ``quantize_mxfp8_weight``), not only all-zero blocks.

    Unlike a bare byte rewrite, the block's values are re-encoded for the new scale (each FP8 value halved,
    round to nearest even), so decoding never doubles. An all-zero block (the usual byte-0 block) keeps its
    value bytes and decodes to the same zeros; a nonzero block can have byte 0 only when its amax is at most
    448 * 2^-127 (about 2.6e-36): its values decode the same except an odd multiple of the element
    format's smallest subnormal, which rounds to even. Returns ``components`` itself when no byte is 0.

    Raises TypeError when ``components`` is not an :class:`MXFP8Components`.
    """
    if not isinstance(components, MXFP8Components):
        raise TypeError(f"components must be an MXFP8Components, got {type(components).__name__}")
    fmt = element_format(components.fp8_dtype)
    data = components.data.view(torch.uint8)
    shape = tuple(data.shape)
    if components.direction == "rowwise":
        k = shape[-1]
        q, e = _lift_rows(data.reshape(-1, k), components.scale_inv.reshape(-1, ceil_div(k, BLOCK_SIZE)), fmt)
        if e.data_ptr() == components.scale_inv.data_ptr():
            return components
        return MXFP8Components(q.reshape(shape).view(fmt.dtype), e.reshape(components.scale_inv.shape),
                               "rowwise")
    q, e = _lift_rows(data.reshape(-1, shape[-1]).t(), components.scale_inv.t(), fmt)
    if e.data_ptr() == components.scale_inv.data_ptr():
        return components
    values = q.t().contiguous().reshape(shape).view(fmt.dtype)
    return MXFP8Components(values, e.t().contiguous(), "columnwise")


def quantize_many(
    tensors: list[torch.Tensor] | tuple[torch.Tensor, ...],
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rounding: str = "rceil",
    outs: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    kernel: str | None = None,
    sums=None,
    offsets: list[tuple[int, int]] | None = None,
) -> list[MXFP8Components]:
    """Rowwise :func:`quantize` of several tensors, the ones the native CPU kernel takes in one batched native
    call (per thread): for many small tensors (a model's weights) the per-call cost is paid once. The bytes
    are those of ``quantize(t, fp8_dtype, rounding=rounding, out=outs[i], kernel=kernel)`` for each tensor,
    which is what every other tensor gets (another device, float64, a kernel other than native).

    Args:
        tensors: the inputs, as :func:`quantize`'s ``x``.
        fp8_dtype, rounding, kernel: as in :func:`quantize` (``kernel`` applies to every tensor).
        outs: None, or one entry per tensor: None or a ``(values, scales)`` pair as :func:`quantize`'s
            ``out``. No output may overlap any input or another output.
        sums: None, or an accumulator of a byte stream's word sums
            (:class:`mxport.refit.buckets.ChunkSums`) to which the bytes of every output are added, at the
            stream offsets ``offsets[i] = (values_offset, scales_offset)`` (required with ``sums``): the
            native kernel sums each tile of output while it is in cache; the other kernels sum their outputs
            with torch ops. The sums are the same on every kernel.

    Returns:
        one :class:`MXFP8Components` (rowwise) per tensor, in order.

    Raises:
        what :func:`quantize` raises for a tensor; ValueError: ``outs`` of another length, outputs that
        overlap an input or each other.
    """
    tensors = list(tensors)
    outs = [None] * len(tensors) if outs is None else list(outs)
    if len(outs) != len(tensors):
        raise ValueError(f"outs must have one entry per tensor ({len(tensors)}), got {len(outs)}")
    if sums is not None and (offsets is None or len(offsets) != len(tensors)):
        raise ValueError(f"sums needs offsets: one (values, scales) stream offset pair per tensor "
                         f"({len(tensors)})")
    fmt = element_format(fp8_dtype)
    floor = _check_rounding(rounding) == "floor"
    results: list[MXFP8Components | None] = [None] * len(tensors)
    batch: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    native_for: dict[tuple, bool] = {}  # kernel_for depends on the device and dtype of a non-empty input only
    for i, (x, out) in enumerate(zip(tensors, outs, strict=True)):
        _check_input(x)
        if x.dtype != torch.float64 and x.numel() and _batchable(x, kernel, native_for):
            if out is None:
                out = (fresh_bytes(tuple(x.shape)).view(fmt.dtype),
                       fresh_bytes(compact_scale_shape(tuple(x.shape), "rowwise")))
            q, e = _check_out_layout(out, x, fmt, "rowwise")  # overlaps: _check_disjoint, for all at once
            x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
            batch.append((i, x, x2, q, e))
            results[i] = _rowwise_components(out[0].view(fmt.dtype), as_e8m0_bytes(out[1]))
        else:
            results[i] = c = quantize(x, fp8_dtype, rounding=rounding, out=out, kernel=kernel)
            if sums is not None:
                sums.add(c.data.view(torch.uint8), offsets[i][0])
                sums.add(c.scale_inv, offsets[i][1])
    if batch:
        _check_disjoint(batch)
        spec = None if sums is None else sums.native([((offsets[i][0], q.numel()), (offsets[i][1], e.numel()))
                                                      for i, _, _, q, e in batch])
        NATIVE_PATH.many([(x2, q, e) for _, _, x2, q, e in batch], fmt, floor, sums=spec)
    return results


def _rowwise_components(values: torch.Tensor, scales: torch.Tensor) -> MXFP8Components:
    """``MXFP8Components(values, scales, "rowwise")`` of outputs :func:`_check_out_layout` accepted, built
    without checking again what it checked: FP8 ``values`` of ``x``'s shape (at least 1-D), uint8 ``scales``
    of the compact rowwise shape, both on ``x``'s device (checking again costs ~3 us a
    tensor on the 2-core VM: 0.6 ms on a model's 210 linear weights)."""
    c = object.__new__(MXFP8Components)
    for name, value in (("data", values), ("scale_inv", scales), ("direction", "rowwise"),
                        ("block_size", BLOCK_SIZE)):
        object.__setattr__(c, name, value)
    return c


def _batchable(x: torch.Tensor, kernel: str | None, cache: dict[tuple, bool]) -> bool:
    """True when :func:`quantize` would run the native kernel on the non-empty ``x`` (2-D view) with this
    ``kernel``: decided once per device and dtype (``cache``), as :func:`kernel_for` decides it."""
    key = (x.device, x.dtype)
    if key not in cache:
        cache[key] = kernel_for(x.reshape(-1, x.shape[-1]), kernel=kernel) == "native"
    return cache[key]


def _check_disjoint(batch) -> None:
    """Refuse a batch whose outputs overlap an input (its own or another's) or another output (the threads
    would race, or read what they wrote): one sort of the byte spans of every input and output, then each
    span must start after the end of every output before it, and an output after the end of every span
    before it (the sweep is vectorized)."""
    spans = np.array([(*_byte_span(x), 0) for _, x, _, _, _ in batch]
                     + [(p := t.data_ptr(), p + t.numel(), 1) for *_, q, e in batch for t in (q, e)],
                     dtype=np.int64).reshape(-1, 3)
    spans = spans[spans[:, 0] < spans[:, 1]]  # empty spans touch nothing
    spans = spans[np.lexsort((spans[:, 2], spans[:, 1], spans[:, 0]))]
    start, end, is_out = spans[:, 0], spans[:, 1], spans[:, 2].astype(bool)
    end_any = np.maximum.accumulate(np.concatenate(([0], end)))[:-1]  # the largest end before each span
    end_out = np.maximum.accumulate(np.concatenate(([0], np.where(is_out, end, 0))))[:-1]
    if np.any((start < end_out) | (is_out & (start < end_any))):
        raise ValueError("quantize_many: outs must not overlap the inputs or each other")
