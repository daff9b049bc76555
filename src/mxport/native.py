"""The native CPU kernel: rowwise MXFP8 quantization in one pass (AVX-512, or AVX2 + F16C).

``mxport/_native/mxfp8_cpu.c`` (no torch headers) is compiled once per machine with the system C compiler
(``$CC``, which may hold arguments such as ``ccache gcc``, else ``cc`` / ``gcc`` / ``clang``; ``-O3
-march=native``) into the mxport cache (``$MXPORT_CACHE/native/<key>/``, written atomically; the key hashes
the source, compiler, flags and CPU flags) and called through :mod:`ctypes`, which releases the GIL, so row
ranges run on ``torch.get_num_threads()`` threads.

Why a C kernel: on CPU, ``torch.compile`` lowers the quantizer to an amax pass, a scale pass and a cast pass
with scalar bit casts; the C kernel reads each block once into registers (sixteen blocks share one
shuffle-tree amax and one vector of scales; float32 rows are cast in 32-bit integer lanes, sixteen blocks at a
time with AVX-512 and eight with AVX2; the AVX2 build takes bfloat16 rows eight blocks at a time, cast in
16-bit integer lanes, and the rest one block at a time, eight float32 lanes wide) and runs several times
faster. It follows the same algorithm as :func:`mxport.quantize._rowwise_kernel` byte for
byte; :mod:`mxport.quantize` checks that on a probe tensor before first use and falls back to the other paths
if it ever differs.

The same library swizzles and unswizzles E8M0 scale grids (cuBLAS 128x4 tiles, :mod:`mxport.layouts`) in one
pass over the bytes, where a torch permute of 4-byte words takes about three times a copy.

This module only builds, loads and calls the library; which kernel ``quantize`` uses is decided in
:mod:`mxport.quantize`. ``MXPORT_DISABLE_NATIVE=1`` turns it off (the swizzle then runs on torch ops).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ._env import cache_dir
from .pages import fresh_bytes

ENV_DISABLE = "MXPORT_DISABLE_NATIVE"
ENV_COMPILE_TIMEOUT = "MXPORT_COMPILE_TIMEOUT"
#: seconds a compiler run may take before the native kernel is given up (quantize then takes another path);
#: ``$MXPORT_COMPILE_TIMEOUT`` sets it, 0 waits as long as the compiler takes (the test suite's setting: a
#: check must not depend on the machine's load)
COMPILE_TIMEOUT_S = 300.0
#: compiler flags (``-march=native``: the library is built for, and cached per, this machine's CPU)
CFLAGS = ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC")
#: the ABI number the C source reports when it was built with a kernel (AVX-512, or AVX2 + F16C); 3 added
#: ``mxport_quantize_many`` (several tensors per call), 4 its stream word sums (``struct mxport_sums``), 5 the
#: scale swizzle (``mxport_swizzle`` / ``mxport_unswizzle``), 6 the attestation digest's word sums
#: (``mxport_word_digest``), 7 delta refit's word diff and apply (``mxport_delta_diff`` /
#: ``mxport_delta_apply``), 8 the 4-bit rows of mxport.fp4 (``mxport_fp4_rows``)
ABI = 8
#: input dtype codes of ``mxport_quantize_rows``
INPUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: elements per thread below which a call stays on one thread (thread hand-off costs ~20 us)
MIN_NUMEL_PER_THREAD = 1 << 17
LIB_NAME = "libmxport_mxfp8_cpu.so"


class NativeUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why."""


def source_text() -> str:
    """The C source shipped in the package."""
    return resources.files("mxport").joinpath("_native/mxfp8_cpu.c").read_text()


def find_compiler() -> list[str]:
    """The C compiler command.

    ``$CC`` if set (split like a shell word list, so ``CC="ccache gcc"`` works), else the first of ``cc``,
    ``gcc``, ``clang`` on PATH.

    Raises NativeUnavailable when there is none.
    """
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            return shlex.split(cc)
        except ValueError as exc:
            raise NativeUnavailable(f"CC={cc!r} is not a valid command: {exc}") from exc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise NativeUnavailable("no C compiler found (set CC or install gcc / clang)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def compile_timeout() -> float | None:
    """Seconds a compiler run may take: ``$MXPORT_COMPILE_TIMEOUT`` (0 or less: no limit, None) or
    :data:`COMPILE_TIMEOUT_S`.

    Raises NativeUnavailable when the variable is not a number."""
    raw = os.environ.get(ENV_COMPILE_TIMEOUT, "").strip()
    if not raw:
        return COMPILE_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        raise NativeUnavailable(f"{ENV_COMPILE_TIMEOUT}={raw!r} is not a number of seconds") from None
    return seconds if seconds > 0 else None


def run_compiler(args: list[str]) -> subprocess.CompletedProcess:
    """Run a compiler command line (``[*find_compiler(), ...]``), its output captured as text, for at most
    :func:`compile_timeout` seconds (``subprocess.TimeoutExpired`` past it)."""
    return subprocess.run(args, capture_output=True, text=True, timeout=compile_timeout())


def build_key(source: str, cc: list[str]) -> str:
    """Cache key of a build: source, compiler command (and its version line), flags, machine and CPU flags."""
    try:
        version = run_compiler([*cc, "--version"]).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"C compiler {' '.join(cc)!r} does not run: {exc}") from exc
    h = hashlib.sha256()
    for part in (source, " ".join(cc), version.splitlines()[0] if version else "", " ".join(CFLAGS),
                 platform.machine(), _cpu_flags()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def build(target: Path | None = None) -> Path:
    """Compile the C source into ``target`` (default: the cache path for this machine) unless it is already
    there; return the library's path. The file is written to a temporary name and renamed (atomic).

    Raises:
        NativeUnavailable: no compiler, or the compiler failed (the message holds its last output lines).
    """
    source = source_text()
    cc = find_compiler()
    if target is None:
        target = cache_dir() / "native" / build_key(source, cc) / LIB_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    src = target.parent / "mxfp8_cpu.c"
    tmp_src = target.parent / f".mxfp8_cpu.{os.getpid()}.{threading.get_ident()}.c"
    tmp_lib = target.parent / f".{LIB_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        tmp_src.write_text(source)
        os.replace(tmp_src, src)
        proc = run_compiler([*cc, *CFLAGS, "-o", str(tmp_lib), str(src)])
        if proc.returncode != 0 or not tmp_lib.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]) or "(no output)"
            raise NativeUnavailable(f"compiling {src} with {' '.join(cc)} failed "
                                    f"(exit {proc.returncode}): {tail}")
        os.replace(tmp_lib, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"compiling the native kernel failed: {type(exc).__name__}: {exc}") from exc
    finally:
        for p in (tmp_src, tmp_lib):
            p.unlink(missing_ok=True)
    return target


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and check that it has a kernel (AVX-512 or AVX2) and that this CPU can run it.

    Raises NativeUnavailable otherwise.
    """
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {path}: {exc}") from exc
    abi = lib.mxport_native_abi()
    if abi != ABI:
        raise NativeUnavailable("this CPU or compiler has neither AVX-512 (F, BW, VL, DQ) nor AVX2 + F16C: "
                                "the native kernel is not built" if abi == 0
                                else f"{path} reports ABI {abi}, expected {ABI}")
    if not lib.mxport_native_cpu_ok():
        raise NativeUnavailable(f"this CPU lacks the instructions the kernel was built for ({isa(lib)})")
    fn = lib.mxport_quantize_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    if lib.mxport_job_size() != ctypes.sizeof(Job):
        raise NativeUnavailable(f"{path}: struct mxport_job is {lib.mxport_job_size()} bytes, "
                                f"expected {ctypes.sizeof(Job)}")
    many = lib.mxport_quantize_many
    many.restype = ctypes.c_int
    many.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                     ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    declare_swizzle(lib)
    lib.mxport_word_digest.restype = None
    lib.mxport_word_digest.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mxport_delta_diff.restype = i64
    lib.mxport_delta_diff.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.mxport_delta_apply.restype = None
    lib.mxport_delta_apply.argtypes = [ptr, ptr, ptr, ptr, i64]
    lib.mxport_fp4_rows.restype = ctypes.c_int
    lib.mxport_fp4_rows.argtypes = [ptr, i64, i64, ctypes.c_int, ctypes.c_float, ptr, ptr]
    return lib


def declare_swizzle(lib: ctypes.CDLL) -> None:
    """Set the ctypes signatures of the library's ``mxport_swizzle`` / ``mxport_unswizzle``."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mxport_swizzle.restype = lib.mxport_unswizzle.restype = ctypes.c_int
    lib.mxport_swizzle.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.mxport_unswizzle.argtypes = [ptr, i64, i64, ptr]


class Job(ctypes.Structure):
    """``struct mxport_job`` of the C source: one tensor (or row range) of a ``mxport_quantize_many`` call."""

    _fields_ = [("x", ctypes.c_void_p), ("rows", ctypes.c_int64), ("k", ctypes.c_int64),
                ("q", ctypes.c_void_p), ("e", ctypes.c_void_p), ("in_dtype", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("q_off", ctypes.c_int64), ("e_off", ctypes.c_int64)]


class Sums(ctypes.Structure):
    """``struct mxport_sums`` of the C source: where ``mxport_quantize_many`` adds the word sums of its
    output."""

    _fields_ = [("bucket_bytes", ctypes.c_int64), ("chunk_bytes", ctypes.c_int64), ("n", ctypes.c_int64),
                ("out", ctypes.c_void_p)]


@dataclass(frozen=True)
class StreamSums:
    """What :func:`quantize_rows_many` needs to sum its output as part of a byte stream: per job, the stream
    offsets of its values and scales; the stream's bucket and chunk sizes (multiples of 8); ``out``, a
    contiguous int64 CPU tensor of per-chunk sums (chunk ``c`` of bucket ``b`` at ``b * ceil(bucket_bytes /
    chunk_bytes) + c``) that the word sums of every output byte are added to (wrapping)."""

    offsets: list[tuple[int, int]]
    bucket_bytes: int
    chunk_bytes: int
    out: torch.Tensor

    def check(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """ValueError unless every job's output lies inside the chunks of ``out``."""
        bb, cb = self.bucket_bytes, self.chunk_bytes
        out = self.out
        if bb < 8 or bb % 8 or cb < 8 or cb % 8:
            raise ValueError(f"stream sums: bucket_bytes {bb} and chunk_bytes {cb} must be multiples of 8")
        if out.dtype != torch.int64 or out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("stream sums: out must be a contiguous 1-D int64 CPU tensor")
        if len(self.offsets) != len(jobs):
            raise ValueError(f"stream sums: {len(self.offsets)} offsets for {len(jobs)} jobs")
        per = -(-bb // cb)
        for (qo, eo), (_, q, e) in zip(self.offsets, jobs, strict=True):
            for off, n in ((qo, q.numel()), (eo, e.numel())):
                last = off + n - 1
                if off < 0 or (n and (last // bb) * per + (last % bb) // cb >= out.numel()):
                    raise ValueError(f"stream sums: bytes at stream offset {off} (+{n}) fall outside the "
                                     f"{out.numel()} chunks")


def isa(lib: ctypes.CDLL) -> str:
    """The instruction set a loaded library's kernel was built for: ``"avx512"`` or ``"avx2"``."""
    fn = lib.mxport_native_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


_POOL: ThreadPoolExecutor | None = None
_POOL_WORKERS = 0
_POOL_LOCK = threading.Lock()


def _reset_pool_after_fork() -> None:
    global _POOL, _POOL_WORKERS, _POOL_LOCK
    _POOL, _POOL_WORKERS, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_WORKERS
    with _POOL_LOCK:
        if _POOL is None or _POOL_WORKERS < workers:
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="mxport-native")
            _POOL_WORKERS = workers
        return _POOL


def _run_split(run: Callable[[int], int], n: int) -> list[int]:
    """``run(0)`` in this thread and ``run(1)`` ... ``run(n - 1)`` on the pool: their results, returned or
    raised only once every run has returned, even when this thread's raises (a Ctrl-C as its native call
    returns): until then the other threads still write the outputs, which the caller may free (and
    :mod:`mxport.pages` hand out again) as soon as this returns or raises."""
    futures = []
    try:
        for t in range(1, n):
            futures.append(_pool(n - 1).submit(run, t))
        first = run(0)
    finally:
        wait(futures)
    return [first] + [f.result() for f in futures]


def quantize_rows(lib: ctypes.CDLL, x2: torch.Tensor, elem: int, floor: bool, inv_max_norm: float,
                  emax: int, *, block_2d: bool = False, out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on a 2-D ``(M, K)`` CPU tensor (float32 / bfloat16 / float16, K >= 1).

    Returns FP8 value bytes ``(M, K)`` and E8M0 bytes ``(M, ceil(K/32))``, both uint8 — new tensors, or
    ``out`` (two contiguous uint8 CPU tensors of those shapes, checked by the caller) written in place.
    ``elem``: 0 = E4M3, 1 = E5M2. ``block_2d``: 32×32 blocks (each row stores its 32-row group's scales, as
    the eager kernel). Rows are split over ``torch.get_num_threads()`` threads for large inputs (at multiples
    of 32 rows with ``block_2d``).
    """
    x2 = x2.detach().contiguous()
    m, k = x2.shape
    nb = -(-k // 32)
    if out is None:
        q = fresh_bytes((m, k))
        e = fresh_bytes((m, nb))
    else:
        q, e = out
    if m == 0:
        return q, e
    code = INPUT_CODES[x2.dtype]
    esize = x2.element_size()
    xp, qp, ep = x2.data_ptr(), q.data_ptr(), e.data_ptr()
    fn = lib.mxport_quantize_rows

    def run(r0: int, r1: int) -> int:
        return fn(xp + r0 * k * esize, r1 - r0, k, qp + r0 * k, ep + r0 * nb, code, elem, int(floor),
                  inv_max_norm, emax, int(block_2d))

    threads = max(1, min(torch.get_num_threads(), m, x2.numel() // MIN_NUMEL_PER_THREAD))
    step = 32 if block_2d else 1  # 32x32 blocks: split between row groups
    bounds = [min(m, (m * i // threads + step - 1) // step * step) for i in range(threads + 1)]
    rcs = _run_split(lambda t: run(bounds[t], bounds[t + 1]), threads)
    if any(rcs):
        raise RuntimeError(f"mxport native kernel rejected its arguments (dtype {x2.dtype}, K={k})")
    return q, e


def _pieces(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], threads: int, step: int
            ) -> list[list[tuple[int, int, int]]]:
    """``jobs`` cut into ``threads`` runs of about equal element counts: per thread, ``(job, row0, row1)``
    pieces in job order (a job is cut between rows, at multiples of ``step`` rows)."""
    total = sum(x.numel() for x, _, _ in jobs)
    per, out, filled = -(-total // threads), [[]], 0
    for j, (x, _, _) in enumerate(jobs):
        m, k = x.shape
        r = 0
        while r < m:
            if filled >= per and len(out) < threads:
                out.append([])
                filled = 0
            take = max(1, -(-(per - filled) // k)) if len(out) < threads else m - r
            r1 = min(m, -(-(r + take) // step) * step)
            out[-1].append((j, r, r1))
            filled += (r1 - r) * k
            r = r1
    return [p for p in out if p]


def quantize_rows_many(lib: ctypes.CDLL, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       elem: int, floor: bool, inv_max_norm: float, emax: int, *,
                       block_2d: bool = False, sums: StreamSums | None = None) -> None:
    """:func:`quantize_rows` for several tensors in one native call per thread: ``jobs`` are ``(x2, q, e)``,
    each a contiguous 2-D ``(M, K)`` CPU input (float32 / bfloat16 / float16, K >= 1) and its contiguous uint8
    outputs ``(M, K)`` / ``(M, ceil(K/32))`` (checked by the caller), written in place. Bytes are those of
    :func:`quantize_rows` on each input. The work is cut into ``torch.get_num_threads()`` runs of about equal
    size (between tensors, or between rows of one) for large batches.

    ``sums``: also add the word sums of every output byte, at its stream offset, to ``sums.out`` (see
    :class:`StreamSums`; ValueError when an output falls outside it). The kernel sums each tile of rows
    right after writing it, while it is in cache: no second pass over memory. Each thread adds into a row of
    its own, added to ``sums.out`` at the end."""
    if sums is not None:
        sums.check(jobs)
    offsets = sums.offsets if sums is not None else [(0, 0)] * len(jobs)
    kept = [i for i, (x, _, _) in enumerate(jobs) if x.shape[0] > 0]
    jobs, offsets = [jobs[i] for i in kept], [offsets[i] for i in kept]
    total = sum(x.numel() for x, _, _ in jobs)
    if not jobs:
        return
    threads = max(1, min(torch.get_num_threads(), total // MIN_NUMEL_PER_THREAD))
    fn = lib.mxport_quantize_many
    runs = _pieces(jobs, threads, 32 if block_2d else 1)
    partial = None if sums is None else torch.zeros(len(runs), sums.out.numel(), dtype=torch.int64)

    def run(t: int) -> int:
        pieces = runs[t]
        arr = (Job * len(pieces))()
        for slot, (j, r0, r1) in zip(arr, pieces, strict=True):
            x, q, e = jobs[j]
            k, nb = x.shape[1], e.shape[1]
            slot.x, slot.rows, slot.k = x.data_ptr() + r0 * k * x.element_size(), r1 - r0, k
            slot.q, slot.e = q.data_ptr() + r0 * k, e.data_ptr() + r0 * nb
            slot.in_dtype = INPUT_CODES[x.dtype]
            slot.q_off, slot.e_off = offsets[j][0] + r0 * k, offsets[j][1] + r0 * nb
        spec = None
        if partial is not None:
            spec = ctypes.byref(Sums(sums.bucket_bytes, sums.chunk_bytes, partial.shape[1],
                                     partial[t].data_ptr()))
        return fn(len(pieces), arr, elem, int(floor), inv_max_norm, emax, int(block_2d), spec)

    rcs = _run_split(run, len(runs))
    if any(rcs):
        raise RuntimeError(f"mxport native kernel rejected the arguments of a batch of {len(jobs)} tensors")
    if partial is not None:
        sums.out.add_(partial.sum(dim=0) if len(runs) > 1 else partial[0])


def word_digest(lib: ctypes.CDLL, words: torch.Tensor, first: int, out: torch.Tensor) -> None:
    """Add the wrapping sums of ``words`` (a contiguous int64 CPU tensor) plain and weighted by position
    (``first``, ``first + 1``, ...) to ``out[0]`` and ``out[1]`` (an int64 CPU tensor of 2)."""
    if words.dtype != torch.int64 or not words.is_contiguous() or words.device.type != "cpu":
        raise ValueError("word_digest: words must be a contiguous int64 CPU tensor")
    if out.dtype != torch.int64 or out.numel() != 2 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("word_digest: out must be a contiguous int64 CPU tensor of 2")
    lib.mxport_word_digest(words.data_ptr(), words.numel(), first & ((1 << 64) - 1), out.data_ptr())


def _bytes_arg(t: torch.Tensor, what: str, dtype: torch.dtype = torch.uint8) -> int:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{what} must be a contiguous {dtype} CPU tensor")
    return t.data_ptr()


def delta_diff(lib: ctypes.CDLL, base: torch.Tensor, now: torch.Tensor, idx: torch.Tensor,
               masks: torch.Tensor, vals: torch.Tensor) -> tuple[int, int, int]:
    """The words of ``now`` that differ from ``base`` (1-D uint8 CPU tensors of one size, whole words):
    the first ones into ``idx`` (int32), ``masks`` and ``vals`` (uint8 scratch; ``masks``' and ``vals``'
    sizes cap the words and bytes recorded), ``base`` brought up to ``now``. Returns ``(changed words, words
    recorded, bytes recorded)``."""
    if base.shape != now.shape or base.numel() % 8 or base.numel() // 8 >= 1 << 31:
        raise ValueError("delta_diff: two byte ranges of one size, whole words, under 2**31 words")
    if masks.numel() > idx.numel():
        raise ValueError("delta_diff: masks may not be longer than idx")
    rec = torch.zeros(2, dtype=torch.int64)
    k = lib.mxport_delta_diff(_bytes_arg(base, "base"), _bytes_arg(now, "now"), base.numel() // 8,
                              _bytes_arg(idx, "idx", torch.int32), _bytes_arg(masks, "masks"),
                              _bytes_arg(vals, "vals"), masks.numel(), vals.numel(), rec.data_ptr())
    return int(k), int(rec[0]), int(rec[1])


def delta_apply(lib: ctypes.CDLL, dst: torch.Tensor, idx: torch.Tensor, masks: torch.Tensor,
                vals: torch.Tensor) -> None:
    """Write checked changed words (:func:`mxport.refit.stream.delta.parse`) into ``dst``."""
    if idx.numel() != masks.numel():
        raise ValueError("delta_apply: one mask per word index")
    lib.mxport_delta_apply(_bytes_arg(dst, "dst"), _bytes_arg(idx, "idx", torch.int32),
                           _bytes_arg(masks, "masks"), _bytes_arg(vals, "vals"), idx.numel())


#: ``mxport_fp4_rows``' format codes
FP4_CODES = {("mxfp4", "rceil"): 0, ("mxfp4", "floor"): 1, ("nvfp4", None): 2}


def fp4_rows(lib: ctypes.CDLL, x: torch.Tensor, fmt: str, rounding: str | None = None, g: float = 1.0,
             scale_dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 / NVFP4 (``g``: the float32 global scale) of a contiguous 2-D float32 CPU tensor, K whole blocks,
    finite values: ``(packed uint8 [M, K/2], scale bytes [M, K/block])`` (the scale viewed as
    ``scale_dtype``), the bytes of :mod:`mxport.fp4`'s torch path. Rows are split over
    ``torch.get_num_threads()`` threads for large inputs, as :func:`quantize_rows` splits them."""
    m, k = x.shape
    block = 16 if fmt == "nvfp4" else 32
    q = torch.empty((m, k // 2), dtype=torch.uint8)
    s = torch.empty((m, k // block), dtype=torch.uint8)
    xp, code, nb = _bytes_arg(x, "x", torch.float32), FP4_CODES[(fmt, rounding)], k // block

    def run(r0: int, r1: int) -> int:
        return lib.mxport_fp4_rows(xp + r0 * k * 4, r1 - r0, k, code, g, q.data_ptr() + r0 * (k // 2),
                                   s.data_ptr() + r0 * nb)

    threads = max(1, min(torch.get_num_threads(), m, x.numel() // MIN_NUMEL_PER_THREAD))
    bounds = [m * i // threads for i in range(threads + 1)]  # rows over threads, as quantize_rows
    rcs = _run_split(lambda t: run(bounds[t], bounds[t + 1]), threads) if m else [0]
    if 2 in rcs:
        raise ValueError(f"{fmt}: x holds NaN or Inf, which E2M1 cannot encode")
    if any(rcs):
        raise ValueError(f"mxport native fp4: K={k} is not whole blocks of {block}")
    return q, s.view(scale_dtype)


def swizzle(lib: ctypes.CDLL, grid: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The 128x4-tile swizzle (:func:`mxport.layouts.swizzle`) of a 2-D uint8 CPU ``grid`` (any strides)
    into ``out``, a contiguous uint8 CPU tensor of ``roundup(R,128) * roundup(C,4)`` bytes, padding included,
    in one pass. Returns ``out``."""
    (r, c), (rs, cs) = grid.shape, grid.stride()
    if lib.mxport_swizzle(grid.data_ptr(), r, c, rs, cs, out.data_ptr()) != 0:
        raise RuntimeError(f"mxport native swizzle rejected a ({r}, {c}) grid of strides ({rs}, {cs})")
    return out


def unswizzle(lib: ctypes.CDLL, swizzled: torch.Tensor, rows: int, cols: int, out: torch.Tensor
              ) -> torch.Tensor:
    """The inverse of :func:`swizzle`: a contiguous uint8 CPU tensor of ``roundup(rows,128) *
    roundup(cols,4)`` swizzled bytes into ``out``, a contiguous uint8 ``(rows, cols)`` CPU tensor, in one
    pass. Returns ``out``."""
    if lib.mxport_unswizzle(swizzled.data_ptr(), rows, cols, out.data_ptr()) != 0:
        raise RuntimeError(f"mxport native unswizzle rejected ({rows}, {cols})")
    return out
