"""An independent MXFP8 reference in numpy + ml_dtypes, written from the format's rules (OCP MX v1.0; TE's
rceil; summarized in docs/format.md, "Elements, blocks, scales" and "Rounding rules"), not from mxport's code.

Differences in method from mxport: E is found with ``math.frexp`` on float64 (exact for float32 inputs)
instead of bit fields, the FP8 cast is ml_dtypes' (round-to-nearest-even), loops run per block.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

ELEM = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15),
}


def ref_scale_byte(amax: float, elem: str, rounding: str) -> int:
    """E8M0 byte for a block's amax (NaNs already skipped), docs/format.md "Rounding rules"."""
    _, max_norm, emax = ELEM[elem]
    if math.isnan(amax):
        return 255
    if rounding == "rceil":
        v = float(np.float32(amax) * np.float32(np.float32(1.0) / np.float32(max_norm)))
        if math.isnan(v):
            return 255
        if math.isinf(v):
            return 254
        if v == 0.0:
            return 0
        m, ex = math.frexp(v)  # v = m * 2**ex, 0.5 <= m < 1
        ceil_log2 = ex - 1 if m == 0.5 else ex
        return min(max(ceil_log2 + 127, 0), 254)
    # floor (OCP MX v1.0 §6.3)
    if math.isinf(amax):
        return 254
    if amax == 0.0:
        return 0
    _, ex = math.frexp(amax)
    return min(max((ex - 1) - emax + 127, 0), 254)


def ref_multiplier(e: int) -> np.float32:
    """2**(127-E) as float32 (E=254 -> 2**-127, a float32 subnormal)."""
    if e == 255:
        return np.float32("nan")
    return np.float32(math.ldexp(1.0, 127 - e))


def ref_cast(x: np.ndarray, elem: str) -> np.ndarray:
    """float32 -> FP8 bytes: RNE, saturating to ±max_norm, NaN kept."""
    dt, max_norm, _ = ELEM[elem]
    clipped = np.clip(x.astype(np.float32), -max_norm, max_norm)  # np.clip keeps NaN
    return clipped.astype(dt).view(np.uint8)


def _block_amax(vals: np.ndarray) -> float:
    a = np.abs(vals.astype(np.float32))
    a = a[~np.isnan(a)]
    return float(a.max()) if a.size else 0.0


def ref_quantize_2d(x: np.ndarray, elem: str, rounding: str, block_2d: bool = False):
    """Rowwise MXFP8 of a 2-D float32 array: (uint8 values (M, K), uint8 scales (M, ceil(K/32)))."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    nb = -(-k // 32)
    scales = np.zeros((m, nb), dtype=np.uint8)
    if block_2d:
        for bi in range(-(-m // 32)):
            for bj in range(nb):
                e = ref_scale_byte(_block_amax(x[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32]), elem,
                                   rounding)
                scales[bi * 32:(bi + 1) * 32, bj] = e
    else:
        for i in range(m):
            for bj in range(nb):
                scales[i, bj] = ref_scale_byte(_block_amax(x[i, bj * 32:(bj + 1) * 32]), elem, rounding)
    q = np.zeros((m, k), dtype=np.uint8)
    for bj in range(nb):
        cols = slice(bj * 32, min((bj + 1) * 32, k))
        mult = np.array([ref_multiplier(int(e)) for e in scales[:, bj]], dtype=np.float32)[:, None]
        q[:, cols] = ref_cast((x[:, cols] * mult).astype(np.float32), elem)
    return q, scales


def ref_quantize(x: np.ndarray, elem: str, rounding: str = "rceil", direction: str = "rowwise",
                 block_2d: bool = False):
    """N-D reference: values (uint8, logical shape) and compact scales for ``direction``.

    Rules and layouts: docs/format.md, "Rounding rules" and "Scale layouts"."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    k = shape[-1]
    m = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    x2 = x.reshape(m, k)
    if direction == "rowwise":
        q, s = ref_quantize_2d(x2, elem, rounding, block_2d)
        return q.reshape(shape), s.reshape(*shape[:-1], -(-k // 32))
    if block_2d:
        q, s_row = ref_quantize_2d(x2, elem, rounding, True)
        s = np.zeros((-(-m // 32), k), dtype=np.uint8)
        for bi in range(s.shape[0]):
            s[bi, :] = np.repeat(s_row[bi * 32], 32)[:k]
        return q.reshape(shape), s
    qt, st = ref_quantize_2d(np.ascontiguousarray(x2.T), elem, rounding)
    return np.ascontiguousarray(qt.T).reshape(shape), np.ascontiguousarray(st.T)


def ref_decode(q: np.ndarray, e: np.ndarray, elem: str) -> np.ndarray:
    """float32 value of FP8 bytes ``q`` times 2**(E-127) (E broadcast already to q's shape)."""
    dt = ELEM[elem][0]
    vals = q.view(dt).astype(np.float32)
    scale = np.array([np.float32(math.ldexp(1.0, int(b) - 127)) if b != 255 else np.float32("nan")
                      for b in e.reshape(-1)], dtype=np.float32).reshape(e.shape)
    return (vals * scale).astype(np.float32)


def ref_values(q: np.ndarray, elem: str) -> np.ndarray:
    """float32 values of FP8 bytes ``q`` (no scale)."""
    return q.view(ELEM[elem][0]).astype(np.float32)
