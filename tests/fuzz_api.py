"""A seeded fuzzer of mxport's public API (design.md §5): quantize, dequantize, export_components,
MXFP8Components(...), layouts.swizzle / unswizzle / pad / unpad, fed wrong dtypes (every FP8
variant, float8_e8m0fnu, ints, bool, complex), 0-d / empty / huge (declared by expand(), never
allocated) / non-contiguous / flipped / overlapping (as_strided) tensors, meta tensors, mismatched
scales and bogus objects.

Each call's outcome is classified:

- ``correct``: a result, checked exactly against an independent reference (``mx_reference``: values, scales,
  decoded values; layouts against the design.md §3 byte formula);
- ``clear``: a TypeError / ValueError whose message names one of the call's arguments;
- ``wrong``: a result that differs from the reference;
- ``unclear``: a TypeError / ValueError that names no argument;
- ``raw``: any other exception (RuntimeError, IndexError, AttributeError, ...).

Used by ``tests/test_fuzz_api.py`` (a bounded budget) and ``scripts/fuzz_api.py`` (a
bigger one, prints counts).
"""

from __future__ import annotations

import random
import re
import traceback
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

import mxport
from mxport import layouts
from mxport.formats import FLOAT8_E8M0FNU

FP8_VARIANTS = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                             "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
OTHER = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool, torch.complex64]
ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
HUGE = 1 << 52  # x 64 elements: far beyond any address space, so an allocation fails at once


@dataclass
class Stats:
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        if kind in ("wrong", "unclear", "raw") and len(self.failures) < 50:
            self.failures.append(f"{kind}: {what}")


# -- inputs --------------------------------------------------------------------------------------------------


def _values(rng: random.Random, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    if x.numel() and rng.random() < 0.3:
        flat = x.view(-1)
        for v in (float("nan"), float("inf"), -float("inf"), 0.0, 480.0, 1e-40):
            flat[rng.randrange(flat.numel())] = v
    if dtype.is_complex:
        return x.to(dtype)
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return x.clamp(-100, 100).to(dtype)
    if dtype in FP8_VARIANTS:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    return x.to(dtype)


def _shape(rng: random.Random) -> tuple[int, ...]:
    kind = rng.random()
    if kind < 0.05:
        return ()
    if kind < 0.15:
        return tuple(rng.choice([0, 1, 3, 33]) for _ in range(rng.randint(1, 3)))
    while True:
        shape = tuple(rng.choice([1, 2, 5, 31, 32, 33, 64, 65, 130]) for _ in range(rng.randint(1, 3)))
        if np.prod(shape) <= 4096:
            return shape


def _layout(rng: random.Random, x: torch.Tensor) -> torch.Tensor:
    """The same logical values in another memory layout: transposed copy,
    flipped, strided slice, as_strided."""
    kind = rng.choice(["plain", "plain", "t", "flip", "slice", "as_strided"])
    if x.dim() < 1 or x.numel() == 0:
        return x
    if x.dtype in FP8_VARIANTS:  # few ops exist for FP8 dtypes: move the bytes
        return _layout(rng, x.view(torch.uint8)).view(x.dtype)
    if kind == "t" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "flip":
        return x.flip(-1).contiguous().flip(-1).flip(0).contiguous().flip(0)
    if kind == "slice":
        big = torch.zeros((*x.shape[:-1], x.shape[-1] * 2), dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if kind == "as_strided":
        return x.contiguous().as_strided(x.shape, x.contiguous().stride())
    return x


def tensor(rng: random.Random, dtypes=None) -> object:
    """A random argument meant as a tensor: mostly tensors of any dtype / shape / layout, sometimes junk."""
    r = rng.random()
    if r < 0.06:
        return rng.choice([None, [1.0, 2.0], "tensor", 3, 2.5, np.ones((2, 32), np.float32), object()])
    dtype = rng.choice(dtypes or (FLOATS * 3 + FP8_VARIANTS + OTHER))
    if r < 0.10:
        return torch.empty((rng.choice([1, HUGE]), 64), dtype=dtype, device="meta")
    if r < 0.14:  # huge, declared: an expand()ed view of one row
        return _values(rng, (1, 64), dtype).expand(HUGE, 64)
    if r < 0.18 and dtype.is_floating_point:  # overlapping rows (stride 1 along dim 0): legal to read
        base = _values(rng, (160,), dtype)
        return base.as_strided((4, 64), (1, 1))
    return _layout(rng, _values(rng, _shape(rng), dtype))


# -- checks against the reference ---------------------------------------------------------------------------


def _ref():
    import mx_reference

    return mx_reference


def check_quantize(x: torch.Tensor, c, fp8_dtype, direction: str, rounding: str,
                   block_2d: bool) -> str | None:
    """None when ``c`` equals the reference quantization of ``x``, else what differs."""
    ref = _ref()
    if x.device.type == "meta":
        return None if c.data.device.type == "meta" and c.data.shape == x.shape else "meta result shape"
    if x.numel() > 1 << 16:
        return None  # huge declared inputs are not quantized (refused); big ones are not referenced here
    xs = x.detach().to(torch.float32).numpy()
    elem = ELEM[torch.float8_e4m3fn if fp8_dtype in ("e4m3", torch.float8_e4m3fn) else torch.float8_e5m2]
    q, e = ref.ref_quantize(xs, elem, rounding, direction, block_2d=block_2d) if block_2d else \
        ref.ref_quantize(xs, elem, rounding, direction)
    got_q = c.data.view(torch.uint8).numpy()
    got_e = c.scale_inv.numpy()
    if got_e.shape != e.shape or not np.array_equal(got_e, e):
        return "scales differ from mx_reference"
    if got_q.shape != q.shape or not np.array_equal(_canonical_nan(got_q, elem), _canonical_nan(q, elem)):
        return "values differ from mx_reference"
    if c.direction != direction:
        return "direction"
    if not _same(mxport.dequantize(c).numpy(), ref_dequantize(q, e, elem, direction)):
        return "dequantize differs from mx_reference"
    return None


def _canonical_nan(q: np.ndarray, elem: str) -> np.ndarray:
    """FP8 bytes with every NaN as 0x7F (mxport's canonical NaN; ml_dtypes keeps the sign: 0xFF)."""
    q = q.view(np.uint8)
    low = q & 0x7F
    nan = low == 0x7F if elem == "e4m3" else low >= 0x7D
    return np.where(nan, np.uint8(0x7F), q)


def ref_dequantize(q: np.ndarray, e: np.ndarray, elem: str, direction: str) -> np.ndarray:
    """float32 decode of values ``q`` (uint8 bytes, logical shape) with compact
    scales ``e`` (mx_reference)."""
    if q.size == 0:
        return np.zeros(q.shape, np.float32)
    k = q.shape[-1]
    q2 = q.reshape(-1, k)
    if direction == "rowwise":
        e2 = np.repeat(e.reshape(q2.shape[0], -1), 32, axis=1)[:, :k]
    else:
        e2 = np.repeat(e, 32, axis=0)[: q2.shape[0]]
    with np.errstate(over="ignore", invalid="ignore"):
        return _ref().ref_decode(q2, e2, elem).reshape(q.shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN where NaN (bit patterns of NaN aside)."""
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def check_swizzle(s: torch.Tensor, out: torch.Tensor) -> str | None:
    r, c = s.shape
    pr, pc = -(-r // 128) * 128, -(-c // 4) * 4
    # E8M0 bytes come back as uint8; NVFP4's E4M3 block scales as E4M3 (the same tiles)
    dtype = torch.float8_e4m3fn if s.dtype == torch.float8_e4m3fn else torch.uint8
    if tuple(out.shape) != (pr, pc) or out.dtype != dtype:
        return f"swizzle shape {tuple(out.shape)} {out.dtype} != {(pr, pc)} {dtype}"
    out = out.view(torch.uint8)
    want = np.zeros(pr * pc, np.uint8)
    sb = s.view(torch.uint8) if s.dtype != torch.uint8 else s
    sn = sb.contiguous().numpy()
    cb = pc // 4
    for i in range(r):
        for j in range(c):
            want[((i // 128) * cb + j // 4) * 512 + (i % 32) * 16
                 + ((i % 128) // 32) * 4 + (j % 4)] = sn[i, j]
    return None if np.array_equal(out.contiguous().numpy().reshape(-1), want) else "swizzle bytes"


# -- calls ---------------------------------------------------------------------------------------------------


def _names_argument(msg: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", msg) for n in names)


def _run(stats: Stats, what: str, names, fn, check) -> None:
    try:
        result = fn()
    except (TypeError, ValueError) as exc:
        kind = "clear" if _names_argument(str(exc), names) else "unclear"
        stats.add(kind, f"{what}: {type(exc).__name__}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 - classifying every outcome is the point
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        stats.add("raw", f"{what}: {tb[:300]}")
        return
    problem = check(result)
    stats.add("wrong" if problem else "correct", f"{what}: {problem}")


def _desc(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)}:{v.dtype}:{v.device.type}:{v.stride()}"
    return repr(v)[:40]


def _pick(rng: random.Random, bad: bool, good: list, wrong: list):
    return rng.choice(wrong if bad else good)


def fuzz_quantize(rng: random.Random, stats: Stats) -> None:
    """One call with every argument valid, or exactly one of them (or x) wrong."""
    bad = rng.choice([None] * 4 + ["x", "x", "fp8_dtype", "direction", "rounding", "block_2d", "fast", "out",
                                   "kernel"])
    x = tensor(rng) if bad == "x" else tensor(rng, FLOATS) if rng.random() < 0.9 else \
        _layout(rng, _values(rng, _shape(rng), rng.choice(FLOATS)))
    fp8 = _pick(rng, bad == "fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, "e4m3", "e5m2"],
                FP8_VARIANTS[2:] + [torch.float32, torch.uint8, None, "e3m4", 3])
    direction = _pick(rng, bad == "direction", ["rowwise", "rowwise", "columnwise"],
                      ["row", None, 0, ["rowwise"]])
    rounding = _pick(rng, bad == "rounding", ["rceil", "rceil", "floor"], ["nearest", None, 1, ("rceil",)])
    block_2d = _pick(rng, bad == "block_2d", [False, False, True],
                     [2, "no", None, 0, 1.0, torch.tensor(True)])
    fast = _pick(rng, bad == "fast", [None, None, False], ["yes", 1, 0.0])
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and rng.random() < 0.1:
        x = torch.nn.Parameter(x, requires_grad=rng.random() < 0.5) if x.dtype in FLOATS else x
    kw = {"direction": direction, "rounding": rounding, "block_2d": block_2d, "fast": fast}
    # "eager" only: the others may be unavailable or slow to compile
    if bad == "kernel" or rng.random() < 0.2:
        kw["kernel"] = _pick(rng, bad == "kernel", [None, "eager"], ["fast", 1, "EAGER", ["eager"]])
    if bad == "out" or (bad is None and direction == "rowwise" and rng.random() < 0.3):
        kw["out"] = _out_arg(rng, x, fp8, bad == "out")
    what = f"quantize({_desc(x)}, {fp8!r}, { {k: _desc(v) for k, v in kw.items()} })"

    def check(c):
        if not isinstance(c, mxport.MXFP8Components):
            return "not components"
        if kw.get("out") is not None and c.data.data_ptr() != kw["out"][0].data_ptr():
            return "result is not a view of out"
        return check_quantize(x, c, fp8, direction, rounding, block_2d)

    _run(stats, what, ["x", "fp8_dtype", "direction", "rounding", "block_2d", "fast", "out", "kernel"],
         lambda: mxport.quantize(x, fp8, **kw), check)


def _out_arg(rng: random.Random, x, fp8, bad: bool):
    """quantize's ``out``: a right (values, scales) pair for ``x``, or (``bad``) a wrong one or junk."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.device.type == "meta" or x.numel() > 1 << 16:
        return rng.choice([None, [1, 2], "out"])
    dt = fp8 if fp8 in (torch.float8_e4m3fn, torch.float8_e5m2) else torch.float8_e4m3fn
    values = torch.empty(x.shape, dtype=rng.choice([dt, torch.uint8] + ([torch.float32] if bad else [])))
    sshape = (*x.shape[:-1], -(-x.shape[-1] // 32))
    scales = torch.empty(sshape,
                         dtype=rng.choice([torch.uint8, FLOAT8_E8M0FNU] + ([torch.int8] if bad else [])))
    kind = rng.choice(["tuple3", "shape", "transposed", "overlap", "input", "good"]) if bad else "good"
    if kind == "tuple3":
        return (values, scales, scales)
    if kind == "shape":
        return (values, torch.empty((1, *sshape), dtype=torch.uint8))
    if kind == "transposed" and values.dim() >= 2:
        return (values.transpose(-1, -2).contiguous().transpose(-1, -2), scales)
    if kind == "overlap":
        return (values, values.view(torch.uint8).reshape(-1)[: scales.numel()].reshape(sshape))
    if kind == "input":
        return (x, scales)
    return [values, scales] if rng.random() < 0.2 else (values, scales)


def _components(rng: random.Random):
    x = _values(rng, rng.choice([(4, 64), (3, 33), (40, 7)]), rng.choice(FLOATS[:3]))
    return mxport.quantize(x, rng.choice([torch.float8_e4m3fn, torch.float8_e5m2]),
                           direction=rng.choice(["rowwise", "columnwise"]))


def fuzz_components(rng: random.Random, stats: Stats) -> None:
    """MXFP8Components(data, scale_inv, direction, block_size) with right or wrong parts."""
    good = _components(rng)
    if rng.random() < 0.1:  # huge, declared: no memory behind it, nothing allocated
        dt = rng.choice([torch.float8_e4m3fn, torch.float8_e5m2])
        good = mxport.MXFP8Components(torch.zeros(1, 64, dtype=torch.uint8).view(dt).expand(HUGE, 64),
                                      torch.full((1, 2), 127, dtype=torch.uint8).expand(HUGE, 2))
    bad = rng.choice([None] * 3 + ["data", "scale_inv", "scale_inv", "direction", "block_size"])
    data = tensor(rng, FP8_VARIANTS + FLOATS) if bad == "data" else good.data
    scale = tensor(rng, [torch.uint8] * 3 + FP8_VARIANTS + OTHER) if bad == "scale_inv" else good.scale_inv
    if bad == "scale_inv" and rng.random() < 0.2 and isinstance(scale, torch.Tensor):
        scale = good.scale_inv.to("meta") if rng.random() < 0.5 else good.scale_inv[:1]
    direction = rng.choice(["rowwise", "columnwise", "x", None]) if bad == "direction" else good.direction
    block = rng.choice([16, 32.0, "32", True, np.int64(32)]) if bad == "block_size" else 32
    what = f"MXFP8Components({_desc(data)}, {_desc(scale)}, {direction!r}, {block!r})"

    def check(c):
        if c.data is not data and not (c.data.data_ptr() == data.data_ptr()):
            return "data not kept as given"
        if c.scale_inv.dtype != torch.uint8:
            return "scale not uint8"
        c.metadata()
        return None

    _run(stats, what, ["data", "scale_inv", "direction", "block_size"],
         lambda: mxport.MXFP8Components(data, scale, direction, block), check)


def fuzz_dequantize(rng: random.Random, stats: Stats) -> None:
    c = _components(rng) if rng.random() < 0.8 else tensor(rng)
    if rng.random() < 0.05:
        c = mxport.MXFP8Components(torch.zeros(1, 64, dtype=torch.float8_e4m3fn).expand(HUGE, 64),
                                   torch.full((1, 2), 127, dtype=torch.uint8).expand(HUGE, 2))
    dtype = rng.choice(FLOATS * 2 + FP8_VARIANTS + OTHER + [None, "float32"])
    what = f"dequantize({_desc(c)}, {dtype!r})"

    def check(out):
        want = ref_dequantize(c.data.view(torch.uint8).numpy(), c.scale_inv.numpy(), ELEM[c.fp8_dtype],
                              c.direction)
        want = torch.from_numpy(want).to(dtype).to(torch.float64).numpy()
        return None if out.dtype == dtype and _same(out.to(torch.float64).numpy(), want) else "decode"

    _run(stats, what, ["components", "dtype"], lambda: mxport.dequantize(c, dtype), check)


def fuzz_export_components(rng: random.Random, stats: Stats) -> None:
    obj = _components(rng) if rng.random() < 0.2 else tensor(rng)
    direction = rng.choice(["rowwise"] * 3 + ["columnwise", "x", None])
    kw = {} if rng.random() < 0.7 else {"fp8_dtype": rng.choice(FP8_VARIANTS + [torch.float32])}
    what = f"export_components({_desc(obj)}, {direction!r}, {kw})"

    def check(c):
        if isinstance(obj, mxport.MXFP8Components):
            return None if c is obj else "components not returned as is"
        return check_quantize(obj, c, kw.get("fp8_dtype", torch.float8_e4m3fn), direction, "rceil", False)

    _run(stats, what, ["obj", "direction", "fp8_dtype", "export_components", "x"],
         lambda: mxport.export_components(obj, direction=direction, **kw), check)


def _grid(rng: random.Random):
    r = rng.random()
    if r < 0.75:
        shape = (rng.choice([0, 1, 5, 128, 130]), rng.choice([0, 1, 3, 4, 7]))
        g = torch.randint(0, 256, shape, dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(rng.randrange(99)))
        if rng.random() < 0.2 and FLOAT8_E8M0FNU is not None:
            g = g.view(FLOAT8_E8M0FNU)
        return _layout(rng, g)
    return tensor(rng, [torch.uint8] * 4 + FP8_VARIANTS + OTHER + FLOATS)


def _int_arg(rng: random.Random, good: int):
    return rng.choice([good] * 6 + [good + 1, -1, 0, float(good), str(good), None, True, np.int64(good),
                                    torch.tensor(good)])


def fuzz_layouts(rng: random.Random, stats: Stats) -> None:
    g = _grid(rng)
    op = rng.choice(["swizzle", "unswizzle", "pad", "unpad"])
    shape = tuple(g.shape) if isinstance(g, torch.Tensor) and g.dim() == 2 else (1, 1)
    if op == "swizzle":
        _run(stats, f"swizzle({_desc(g)})", ["scale_inv_2d"], lambda: layouts.swizzle(g),
             lambda out: None if g.numel() > 1 << 16 or g.device.type == "meta" else check_swizzle(g, out))
        return
    if op == "pad":
        direction = rng.choice(["rowwise"] * 3 + ["columnwise", "x"])

        def check_pad(out):
            if g.device.type == "meta" or g.numel() > 1 << 16:
                return None
            return None if torch.equal(layouts.unpad(out, *g.shape), g.view(torch.uint8)) else "pad/unpad"

        _run(stats, f"pad({_desc(g)}, {direction!r})", ["scale_inv_2d", "direction"],
             lambda: layouts.pad(g, direction), check_pad)
        return
    rows, cols = _int_arg(rng, shape[0]), _int_arg(rng, shape[1])
    if op == "unpad":
        def check_unpad(out):
            if g.device.type == "meta":
                return None
            return None if torch.equal(out, g.view(torch.uint8)[: int(rows), : int(cols)]) else "unpad"

        _run(stats, f"unpad({_desc(g)}, {rows!r}, {cols!r})", ["padded", "rows", "cols"],
             lambda: layouts.unpad(g, rows, cols), check_unpad)
        return
    sw = layouts.swizzle(g) if isinstance(g, torch.Tensor) and g.dim() == 2 and g.dtype == torch.uint8 and \
        g.device.type == "cpu" and g.numel() <= 1 << 16 and rng.random() < 0.8 else g

    def check_unswizzle(out):
        if sw is g or g.device.type == "meta":
            return None
        pr, pc = layouts.swizzled_shape(*g.shape)
        if pr * pc != np.prod(layouts.swizzled_shape(int(rows), int(cols))):
            return "unswizzle took the byte count of another grid"
        if (pr, pc) != layouts.swizzled_shape(int(rows), int(cols)):
            return None  # same byte count, another grid: a reinterpretation, nothing to compare
        padded = torch.zeros((pr, pc), dtype=torch.uint8)
        padded[: g.shape[0], : g.shape[1]] = g
        want = padded[: int(rows), : int(cols)]  # same padded grid: its corner
        return None if torch.equal(out, want) else "unswizzle(swizzle(g)) != g"

    _run(stats, f"unswizzle({_desc(sw)}, {rows!r}, {cols!r})", ["swizzled", "rows", "cols"],
         lambda: layouts.unswizzle(sw, rows, cols), check_unswizzle)


TARGETS = (fuzz_quantize, fuzz_quantize, fuzz_components, fuzz_dequantize, fuzz_export_components,
           fuzz_layouts, fuzz_layouts)


def run(n: int, seed: int = 0) -> Stats:
    """``n`` random calls (seeded); returns the counts and the first failures."""
    rng = random.Random(seed)
    stats = Stats()
    for _ in range(n):
        rng.choice(TARGETS)(rng, stats)
    return stats
