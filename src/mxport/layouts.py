"""E8M0 scale layouts: compact <-> padded (TE storage) <-> swizzled (cuBLAS / FlashInfer 128×4 tiles).

All functions take and return ``torch.uint8`` tensors (``float8_e8m0fnu`` input is bit-viewed) and work on any
device: the swizzle and unswizzle of CPU tensors run in the native library (:mod:`mxport.native`, one pass
over the bytes) where it is available, else (and on other devices) one reshape/permute, never a per-element
loop.

Source: docs/format.md, "Scale layouts: compact, padded, swizzled"; cuBLAS docs "1D block scaling factors
layout" (VEC32_UE8M0); TE ``pytorch/tensor/storage/mxfp8_tensor_storage.py`` (padding to 128×4); FlashInfer
``layout_128x4``.
"""

from __future__ import annotations

import functools
import operator

import torch

from . import native
from .components import check_direction
from .formats import allocating, as_e8m0_bytes, describe, roundup
from .pages import fresh_bytes
from .quantize import NATIVE_PATH

TILE_ROWS = 128
TILE_COLS = 4
TILE_BYTES = TILE_ROWS * TILE_COLS


def _check_2d(scale: torch.Tensor, argname: str) -> torch.Tensor:
    scale = as_e8m0_bytes(scale, argname=argname)
    if scale.dim() != 2:
        raise ValueError(f"{argname} must be a 2-D scale grid, got shape {tuple(scale.shape)}")
    return scale


def _sized(argname: str):
    """Decorator: an allocation failure for a huge (e.g. ``expand()``ed) first argument is a clear
    :class:`~mxport.formats.TooLargeError` naming it, not the allocator's RuntimeError."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(t, *args, **kwargs):
            with allocating(argname, t):
                return fn(t, *args, **kwargs)
        return call
    return wrap


def _check_count(value, argname: str) -> int:
    """A grid dimension: a non-negative integer (Python / numpy int, 0-d integer tensor), returned as int.

    Raises TypeError for anything else (bool and float included: a float is never truncated), ValueError when
    negative."""
    if isinstance(value, bool):
        raise TypeError(f"{argname} must be an integer, got the bool {describe(value)}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{argname} must be an integer, got {describe(value)}") from None
    if n < 0:
        raise ValueError(f"{argname} must be >= 0, got {n}")
    return n


def _pad_multiples(direction: str) -> tuple[int, int]:
    return (TILE_ROWS, TILE_COLS) if check_direction(direction) == "rowwise" else (TILE_COLS, TILE_ROWS)


def padded_shape(rows: int, cols: int, direction: str = "rowwise") -> tuple[int, int]:
    """TE's padded scale shape for a compact ``(rows, cols)`` grid: rowwise
    ``(roundup(rows,128), roundup(cols,4))``, columnwise ``(roundup(rows,4), roundup(cols,128))``."""
    rows, cols = _check_count(rows, "rows"), _check_count(cols, "cols")
    mr, mc = _pad_multiples(direction)
    return roundup(rows, mr), roundup(cols, mc)


@_sized("scale_inv_2d")
def pad(scale_inv_2d: torch.Tensor, direction: str = "rowwise") -> torch.Tensor:
    """Compact ``(R, C)`` scales -> TE's padded layout (zeros in the padding); see :func:`padded_shape`.

    Returns a new uint8 tensor (the input itself when no padding is needed). Raises TypeError / ValueError for
    a non-E8M0 dtype or a non-2-D tensor.
    """
    scale = _check_2d(scale_inv_2d, "scale_inv_2d")
    r, c = scale.shape
    pr, pc = padded_shape(r, c, direction)
    if (pr, pc) == (r, c):
        return scale
    out = torch.zeros((pr, pc), dtype=torch.uint8, device=scale.device)
    out[:r, :c] = scale
    return out


def unpad(padded: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The compact ``(rows, cols)`` corner of a padded scale grid, as a view (no copy).

    TE leaves padding bytes uninitialized, so they are dropped, never read. Raises ValueError when ``padded``
    is smaller than ``(rows, cols)`` or they are negative, TypeError when they are not integers.
    """
    padded = _check_2d(padded, "padded")
    rows, cols = _check_count(rows, "rows"), _check_count(cols, "cols")
    if padded.shape[0] < rows or padded.shape[1] < cols:
        raise ValueError(f"padded scale grid {tuple(padded.shape)} is too small for ({rows}, {cols}) "
                         "compact scales")
    return padded[:rows, :cols]


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the swizzled grid for ``(rows, cols)`` compact scales:
    ``(roundup(rows,128), roundup(cols,4))``."""
    rows, cols = _check_count(rows, "rows"), _check_count(cols, "cols")
    return roundup(rows, TILE_ROWS), roundup(cols, TILE_COLS)


@_sized("scale_inv_2d")
def swizzle(scale_inv_2d: torch.Tensor) -> torch.Tensor:
    """Compact ``(R, C)`` rowwise scales -> the 128×4-tile swizzle of cuBLAS ``VEC32_UE8M0`` / FlashInfer.

    Returns uint8 ``(roundup(R,128), roundup(C,4))`` whose row-major bytes put compact entry ``(r, c)`` at
    ``((r//128)*ceil(C/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + (c%4)``; padding bytes are 0. Columnwise
    scales are swizzled as their transpose: ``swizzle(scale.T)``. An empty grid gives the empty result of that
    shape, e.g. ``(0, 4)`` for ``(0, 3)`` and ``(128, 0)`` for ``(5, 0)``. NVFP4's ``float8_e4m3fn`` block
    scales (one per 16) take the same 128x4 tiles (cuBLAS ``VEC16_UE4M3``, FlashInfer ``layout_128x4``): the
    result is then viewed as ``float8_e4m3fn``.
    """
    if isinstance(scale_inv_2d, torch.Tensor) and scale_inv_2d.dtype == torch.float8_e4m3fn:
        return swizzle(scale_inv_2d.view(torch.uint8)).view(torch.float8_e4m3fn)
    scale = _check_2d(scale_inv_2d, "scale_inv_2d")
    r, c = scale.shape
    pr, pc = swizzled_shape(r, c)
    if scale.numel() == 0:  # R or C is 0: so is roundup(R,128) or roundup(C,4), nothing to place
        return torch.zeros((pr, pc), dtype=torch.uint8, device=scale.device)
    lib = _native_lib(scale)
    if lib is not None:
        return native.swizzle(lib, scale, fresh_bytes((pr, pc)))  # every byte written, padding included
    return _swizzle_torch(scale, pr, pc)


def _native_lib(t: torch.Tensor):
    """The native library when it may take ``t`` (a CPU tensor; the native kernel built, loaded and enabled:
    see :class:`mxport.quantize._NativePath`), else None. Its swizzle runs in one pass over the bytes on one
    thread (4-byte words of four tiles moved together, 16 bytes a load: 1.2-1.4x a memcpy of the bytes), into
    outputs from :func:`mxport.pages.fresh_bytes` (large ones reused without page faults); a torch permute of
    4-byte words took about 3x a copy, and its copy runs on torch's thread pool, which waits for a descheduled
    thread when another process holds a core."""
    return NATIVE_PATH.lib_for(t)


def _swizzle_torch(scale: torch.Tensor, pr: int, pc: int) -> torch.Tensor:
    """:func:`swizzle` with torch ops (any device): pad, then one permute."""
    r, c = scale.shape
    if (pr, pc) != (r, c):
        grid = torch.zeros((pr, pc), dtype=torch.uint8, device=scale.device)
        grid[:r, :c] = scale
    else:
        grid = scale
    # r = 128a + 32b + i, c = 4d + j  ->  offset (a, d, i, b, j); the 4 bytes j move together
    words = _as_words(grid)
    if words is not None:
        tiles = words.reshape(pr // TILE_ROWS, 4, 32, pc // TILE_COLS).permute(0, 3, 2, 1)
        return tiles.contiguous().view(torch.uint8).reshape(pr, pc)
    tiles = grid.reshape(pr // TILE_ROWS, 4, 32, pc // TILE_COLS, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(pr, pc)


def _as_words(grid: torch.Tensor) -> torch.Tensor | None:
    """A contiguous uint8 grid whose rows are multiples of 4 bytes as int32 words (one word = the 4 scale
    bytes a swizzle moves together: a permute of 4x fewer elements), or None when its memory is not 4-byte
    aligned."""
    if not grid.is_contiguous() or grid.numel() == 0 or grid.data_ptr() % 4 or grid.shape[-1] % 4:
        return None
    return grid.view(torch.int32)


@_sized("swizzled")
def unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`: swizzled bytes (1-D, or 2-D padded, ``roundup(rows,128)*roundup(cols,4)``
    of them) -> compact uint8 ``(rows, cols)``. Raises ValueError when the byte count does not match."""
    sw = as_e8m0_bytes(swizzled, argname="swizzled")
    rows, cols = _check_count(rows, "rows"), _check_count(cols, "cols")
    pr, pc = swizzled_shape(rows, cols)
    if sw.numel() != pr * pc:
        raise ValueError(
            f"swizzled holds {sw.numel()} bytes, but ({rows}, {cols}) scales swizzle to "
            f"{pr}x{pc} = {pr * pc} bytes"
        )
    if sw.numel() == 0:
        return torch.zeros((rows, cols), dtype=torch.uint8, device=sw.device)
    lib = _native_lib(sw)
    if lib is not None:
        return native.unswizzle(lib, sw.contiguous(), rows, cols, fresh_bytes((rows, cols)))
    return _unswizzle_torch(sw, rows, cols, pr, pc)


def _unswizzle_torch(sw: torch.Tensor, rows: int, cols: int, pr: int, pc: int) -> torch.Tensor:
    """:func:`unswizzle` with torch ops (any device): one permute, then the compact corner."""
    words = _as_words(sw.reshape(pr, pc)) if sw.is_contiguous() else None
    if words is not None:
        tiles = words.reshape(pr // TILE_ROWS, pc // TILE_COLS, 32, 4).permute(0, 3, 2, 1)
        return tiles.contiguous().view(torch.uint8).reshape(pr, pc)[:rows, :cols].contiguous()
    tiles = sw.reshape(pr // TILE_ROWS, pc // TILE_COLS, 32, 4, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(pr, pc)[:rows, :cols].contiguous()
