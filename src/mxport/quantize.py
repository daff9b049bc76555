"""quantize(): float tensors -> MXFP8 components, bit-exact with Transformer Engine ("rceil") or OCP MX ("floor").

One kernel function (``_rowwise_kernel``) holds the whole algorithm; the eager path calls it directly and the fast
path calls a ``torch.compile``d copy of the same function, so the two cannot drift apart (tests check bit-identity).

Sources: design.md §2; TE ``common/cast/mxfp8/quantize_mxfp8.cuh`` and ``common/util/ptx.cuh``; OCP MX v1.0 §6.3.
"""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .components import MXFP8Components, check_block_size, check_direction
from .formats import (
    BLOCK_SIZE,
    FLOAT_DTYPES,
    ElementFormat,
    ceil_div,
    e8m0_floor,
    e8m0_multiplier,
    e8m0_rceil,
    element_format,
    is_fp8_dtype,
    numel_of,
    saturating_cast,
)

ROUNDINGS = ("rceil", "floor")
#: tensors with fewer elements than this use the eager path under ``fast=None`` (compiled launch overhead wins).
FAST_MIN_NUMEL = 1 << 15


def _rowwise_kernel(x2: torch.Tensor, max_norm: float, inv_max_norm: float, emax: int, fp8_dtype: torch.dtype,
                    floor: bool, block_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP8 cast of a 2-D ``(M, K)`` tensor, blocks of 32 along K (32×32 with ``block_2d``).

    Returns FP8 value bytes ``(M, K)`` and E8M0 bytes ``(M, ceil(K/32))``, both uint8 (the caller views the
    values as FP8 outside the compiled region, which keeps the compiled output one fused pass). A short last block is padded with
    zeros, which never change an amax; NaN elements are skipped in the amax.
    """
    m, k = x2.shape
    nb = ceil_div(k, BLOCK_SIZE)
    xf = x2.to(torch.float32)
    pad = nb * BLOCK_SIZE - k
    if pad:
        xf = F.pad(xf, (0, pad))
    xb = xf.reshape(m, nb, BLOCK_SIZE)
    a = xb.abs()
    amax = torch.where(a != a, torch.zeros_like(a), a).amax(dim=-1)  # (m, nb); a != a: NaN test that vectorizes
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


#: graphs the fast path may hold: input dtypes (3) x elements (2) x roundings (2) x block_2d (2) x padded K (2)
RECOMPILE_LIMIT = 64


def _dynamo_recompile_limit(limit: int):
    """Raise dynamo's per-function recompile limit (default 8) for the fast path's calls only."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(limit, getattr(cfg, name))})


def _compile_options() -> dict | None:
    """Inductor options for the fast path: realize per-block intermediates (the scale) of more than 10 ops once per
    block instead of recomputing them for each of the block's 32 elements (about 30% faster on CPU)."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "realize_opcount_threshold"):
        return {"realize_opcount_threshold": 10}
    return None


class _FastPath:
    """Lazily compiled copy of ``_rowwise_kernel``; disabled for good after one failure (with a warning)."""

    def __init__(self) -> None:
        self._fn = None
        self._lock = threading.Lock()
        self.disabled_reason: str | None = None
        if os.environ.get("MXPORT_DISABLE_COMPILE", "") not in ("", "0"):
            self.disabled_reason = "MXPORT_DISABLE_COMPILE is set"
        elif not hasattr(torch, "compile"):
            self.disabled_reason = "torch.compile is not available"

    @property
    def available(self) -> bool:
        return self.disabled_reason is None

    def __call__(self, *args):
        with self._lock:
            if self._fn is None:
                self._fn = torch.compile(_rowwise_kernel, dynamic=True, options=_compile_options())
        try:
            with _dynamo_recompile_limit(RECOMPILE_LIMIT):
                return self._fn(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the eager kernel
            self.disabled_reason = f"torch.compile failed: {type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"mxport: fast quantize path disabled, using eager ({self.disabled_reason})", stacklevel=3)
            return _rowwise_kernel(*args)


FAST_PATH = _FastPath()


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of float32/bfloat16/float16 values, got {type(x).__name__}")
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"x must be a plain dense tensor, got the tensor subclass {type(x).__name__} (a quantized or wrapped "
            "tensor's nominal dtype is not its storage); use mxport.export_components for MXFP8 producers"
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
        raise ValueError("x must have at least one dimension (blocks run along the last one), got a 0-d tensor")


def _use_fast(fast: bool | None, numel: int) -> bool:
    if fast is not None and not isinstance(fast, bool):
        raise TypeError(f"fast must be None, True or False, got {fast!r}")
    if fast is None:
        return FAST_PATH.available and numel >= FAST_MIN_NUMEL
    if fast and not FAST_PATH.available:
        raise RuntimeError(f"fast=True but the compiled path is unavailable: {FAST_PATH.disabled_reason}")
    return bool(fast)


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    direction: str = "rowwise",
    rounding: str = "rceil",
    block_2d: bool = False,
    block_size: int = BLOCK_SIZE,
    fast: bool | None = None,
) -> MXFP8Components:
    """Quantize a float tensor to MXFP8: FP8 values plus one E8M0 shared scale per block of 32.

    Args:
        x: float32 / bfloat16 / float16 (float64 is read as float32) tensor of any rank >= 1, any device,
            contiguous or not, possibly empty. ``M = prod(x.shape[:-1])``, ``K = x.shape[-1]``.
        fp8_dtype: element format, ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        direction: ``"rowwise"`` (blocks along K; scales ``(*x.shape[:-1], ceil(K/32))``) or ``"columnwise"``
            (blocks along M; scales ``(ceil(M/32), K)``). Values keep the logical shape either way.
        rounding: ``"rceil"`` (default; TE / cuBLAS / ModelOpt / vLLM: smallest power of two >= amax/max_norm) or
            ``"floor"`` (OCP MX v1.0 §6.3: floor(log2 amax) - emax_elem).
        block_2d: amax over 32×32 blocks of the 2-D ``(M, K)`` view (TE ``with_2d_quantization``, weights); the
            scale keeps the compact layout of ``direction``, repeated over the block's 32 rows (columns).
        block_size: must be 32.
        fast: ``None`` picks the compiled kernel for large tensors when ``torch.compile`` works, ``True`` forces
            it, ``False`` forces eager. Both give identical bytes.

    A short last block (K not a multiple of 32) keeps its own scale from its valid elements; blocks never cross
    rows. NaN elements are skipped in the amax and stay NaN; Inf saturates to ±max_norm (amax Inf gives E = 254);
    an all-zero block gets E = 0.

    Returns:
        :class:`MXFP8Components` on ``x.device``.

    Raises:
        TypeError: ``x`` not a tensor, an integer / bool / complex / FP8 tensor; bad ``fp8_dtype``.
        ValueError: 0-d ``x``; unknown ``direction`` or ``rounding``; ``block_size`` != 32.
    """
    _check_input(x)
    fmt: ElementFormat = element_format(fp8_dtype)
    check_direction(direction)
    check_block_size(block_size)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be 'rceil' or 'floor', got {rounding!r}")

    shape = tuple(x.shape)
    k = shape[-1]
    m = numel_of(shape[:-1])
    x2 = x.reshape(m, k)
    if x2.dtype == torch.float64:
        x2 = x2.to(torch.float32)
    if direction == "columnwise" and not block_2d:
        x2 = x2.t().contiguous()  # columnwise blocks = rowwise blocks of the transpose (copied: strided reads are slower)
    kernel_args = (
        fmt.max_norm,
        float(np.float32(1.0) / np.float32(fmt.max_norm)),
        fmt.emax,
        fmt.dtype,
        rounding == "floor",
        block_2d,
    )
    if x2.numel() > 0 and _use_fast(fast, x2.numel()):
        q, e = FAST_PATH(x2, *kernel_args)
    else:
        q, e = _rowwise_kernel(x2, *kernel_args)
    q = q.view(fmt.dtype)

    if direction == "rowwise":
        return MXFP8Components(q.reshape(shape), e.reshape(*shape[:-1], ceil_div(k, BLOCK_SIZE)), "rowwise")
    if block_2d:
        # the 2-D block scale, laid out columnwise: entry (bm, k) = scale of block (bm, k // 32)
        e_col = e[::BLOCK_SIZE].repeat_interleave(BLOCK_SIZE, dim=1)[:, :k].contiguous()
        return MXFP8Components(q.reshape(shape), e_col, "columnwise")
    return MXFP8Components(q.t().contiguous().reshape(shape), e.t().contiguous(), "columnwise")
