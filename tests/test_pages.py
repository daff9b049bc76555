"""Fresh output buffers (mxport.pages): huge-page mappings for large outputs, reused once freed, never while
any view of them is alive, and the bytes of every quantize the same on a reused (dirty) buffer."""

import ctypes
import gc
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mxport import pages
from mxport.quantize import NATIVE_PATH, quantize, quantize_many

BIG = (1024, 8192)  # 8 MiB: above HUGE_PAGE_MIN_BYTES


@pytest.fixture(autouse=True)
def _empty_pool(monkeypatch):
    monkeypatch.delenv(pages.ENV_SPARE_MIB, raising=False)
    pages.release_spares()
    yield
    gc.collect()
    pages.release_spares()


def _vma_fields(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding address ``ptr``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= ptr < hi:
                fields = {}
                for f in lines[i + 1:]:
                    if ":" not in f.split()[0]:
                        break
                    key, _, val = f.partition(":")
                    fields[key] = val.strip()
                return fields
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_small_outputs_come_from_torch():
    t = pages.fresh_bytes((pages.HUGE_PAGE_MIN_BYTES // 64 - 1, 64))
    assert t.dtype == torch.uint8 and t.is_contiguous()
    del t
    gc.collect()
    assert pages.spare_bytes() == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_large_outputs_are_aligned_and_advised_onto_huge_pages():
    t = pages.fresh_bytes(BIG)
    assert t.shape == BIG and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % pages.HUGE_PAGE == 0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _vma_fields(t.data_ptr()).get("THPeligible") == "1"


def test_a_freed_output_is_reused():
    t = pages.fresh_bytes(BIG)
    ptr = t.data_ptr()
    del t
    assert pages.spare_bytes() == 8 << 20
    u = pages.fresh_bytes(BIG)
    assert u.data_ptr() == ptr and pages.spare_bytes() == 0
    v = pages.fresh_bytes(BIG)  # the pool is empty again: a new mapping
    assert v.data_ptr() != ptr


def test_never_reused_while_a_view_lives():
    t = pages.fresh_bytes(BIG)
    t.fill_(7)
    view = t[100:].view(torch.float8_e4m3fn)  # another tensor on the same storage
    storage = t.untyped_storage()
    ptr = t.data_ptr()
    del t
    assert pages.spare_bytes() == 0
    u = pages.fresh_bytes(BIG)
    u.fill_(9)
    assert u.data_ptr() != ptr and bool((view.view(torch.uint8) == 7).all())
    del view
    assert pages.spare_bytes() == 0  # the storage still holds it
    del storage
    assert pages.spare_bytes() == 8 << 20


def test_limit_and_release(monkeypatch):
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "0")
    t = pages.fresh_bytes(BIG)
    del t
    assert pages.spare_bytes() == 0
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "12")  # room for one 8 MiB buffer, not two
    a, b = pages.fresh_bytes(BIG), pages.fresh_bytes(BIG)
    del a, b
    assert pages.spare_bytes() == 8 << 20
    assert pages.release_spares() == 8 << 20 and pages.spare_bytes() == 0
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "lots")
    with pytest.raises(ValueError, match="MXPORT_SPARE_MIB"):
        pages.spare_limit()


def test_the_oldest_spare_makes_room(monkeypatch):
    """A buffer freed when the pool is full evicts the oldest spares (a shape that never comes back does not
    keep the pool from the shapes in use)."""
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "12")
    old, new = pages.fresh_bytes(BIG), pages.fresh_bytes((6, 1 << 20))
    new_ptr = new.data_ptr()
    del old
    assert pages.spare_bytes() == 8 << 20
    del new  # 8 + 6 MiB > 12: the 8 MiB spare goes
    assert pages.spare_bytes() == 6 << 20
    again = pages.fresh_bytes((6, 1 << 20))
    assert again.data_ptr() == new_ptr
    del again
    huge = pages.fresh_bytes((16, 1 << 20))  # larger than the whole pool: not kept, evicts nothing
    del huge
    assert pages.spare_bytes() == 6 << 20


def test_a_mapping_that_cannot_be_made_is_a_memory_error(monkeypatch):
    """A large output the system cannot map (after the spares are given back) raises MemoryError, an
    allocation failure as torch.empty's RuntimeError is, so that callers name the argument
    (formats.TooLargeError); it was the mmap's OSError, which layouts.swizzle let through for a huge
    expanded grid."""
    calls = []

    def no_memory(size):
        calls.append(size)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pages, "_new_mapping", no_memory)
    with pytest.raises(MemoryError, match="cannot map"):
        pages.fresh_bytes(BIG)
    assert len(calls) == 2  # once more after releasing the spares


def test_default_limit_is_bounded():
    assert 0 < pages.spare_limit() <= 1 << 30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_into_dirty_reused_buffers_gives_the_same_bytes(dtype):
    """A reused buffer holds the previous output's bytes (here all 0xFF, then a different tensor's): every
    quantize still writes every byte, identical to the eager kernel's fresh output."""
    x = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[3, 64:96] = 0  # a zero block: its bytes are 0 and must overwrite the old ones
    dirty = [pages.fresh_bytes(BIG) for _ in range(4)]
    for d in dirty:
        d.fill_(0xFF)
    del dirty, d
    want = quantize(x, kernel="eager")
    for _ in range(2):
        got = quantize(x)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale_inv, want.scale_inv)
        (many,) = quantize_many([x])
        assert torch.equal(many.data.view(torch.uint8), want.data.view(torch.uint8))
        del got, many


_EXIT_SCRIPT = """
import atexit

def late():  # registered before weakref.finalize's own exit hook, so it runs after it
    y = torch.full((1024, 8192), 3.0, dtype=torch.bfloat16)
    again = quantize(y)
    print(torch.equal(kept.data.view(torch.uint8), want), again.data.data_ptr() == kept.data.data_ptr())

atexit.register(late)
import torch
from mxport.quantize import quantize
torch.set_num_threads(1)  # no worker pool: concurrent.futures refuses new work once exit has begun
x = torch.full((1024, 8192), 1.0, dtype=torch.bfloat16)
kept = quantize(x)
want = kept.data.view(torch.uint8).clone()
"""


def test_outputs_alive_at_exit_are_not_reused_by_exit_handlers():
    """weakref.finalize runs its callbacks at exit by default (atexit=True): every buffer still in use was
    given to the pool then, and an exit handler's quantize wrote over an output it still held."""
    env = {**os.environ, "PYTHONPATH": str(Path(pages.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"] and proc.stderr == ""


def _wait_child(pid: int, timeout: float) -> int | None:
    """The exit status of child ``pid``, or None (the child killed) when it runs past ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")
def test_fork_while_another_thread_is_in_the_pool():
    """A fork while another thread is inside the pool (its lock held: a tensor freed there) left the child's
    lock owned by a thread the child does not have: its first large output waited forever. The child also
    frees the buffers it inherited and reuses them, without touching the parent's (private mappings)."""
    kept = pages.fresh_bytes(BIG).fill_(1)
    ptr = kept.data_ptr()
    spare = pages.fresh_bytes(BIG).fill_(2)
    del spare  # a spare in the pool at the fork
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with pages._SPARES._lock:
            inside.set()
            leave.wait(0.5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when all went well
        ok = False
        try:
            torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork (as in DataLoader workers)
            a = pages.fresh_bytes(BIG).fill_(7)  # the inherited spare
            del kept  # the child's copy of it goes to the child's pool ...
            b = pages.fresh_bytes(BIG).fill_(7)  # ... and is reused
            ok = b.data_ptr() == ptr and bool((a == 7).all()) and bool((b == 7).all())
        finally:
            os._exit(0 if ok else 1)
    leave.set()
    holder.join()
    assert _wait_child(pid, 20) == 0
    assert bool((kept == 1).all())


class _LateWorkerLib:
    """A stand-in native library: the main thread's share is interrupted (a Ctrl-C delivered as its native
    call returns), the worker thread's share writes 0xAB over its rows once ``proceed`` is set (1 s at
    most), then sets ``wrote``."""

    def __init__(self):
        self.main = threading.get_ident()
        self.proceed, self.wrote = threading.Event(), threading.Event()

    def _share(self, q: int, n: int) -> int:
        if threading.get_ident() == self.main:
            raise KeyboardInterrupt
        self.proceed.wait(1)
        ctypes.memset(q, 0xAB, n)
        self.wrote.set()
        return 0

    def mxport_quantize_rows(self, x, rows, k, q, *args):
        return self._share(q, rows * k)

    def mxport_quantize_many(self, n, jobs, *args):
        return self._share(jobs[0].q, jobs[0].rows * jobs[0].k)


@pytest.mark.parametrize("many", [False, True])
def test_an_interrupted_quantize_lets_go_of_its_outputs_only_once_every_thread_is_done(monkeypatch, many):
    """An exception in the main thread's share of a split quantize (Ctrl-C) left the other threads writing
    into outputs already freed: reused by the next output (here: filled with 0 and then overwritten). The
    batched path was safe already (its worker's closure holds the output tensors): kept as a guard."""
    x = torch.zeros(1024, 8192, dtype=torch.bfloat16)
    assert NATIVE_PATH.available and quantize(x[:1]) is not None  # loaded before the stand-in goes in
    lib = _LateWorkerLib()
    monkeypatch.setattr(NATIVE_PATH, "_lib", lib)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            quantize_many([x]) if many else quantize(x)
    finally:
        torch.set_num_threads(threads)
    gc.collect()
    reused = pages.fresh_bytes(tuple(x.shape)).fill_(0)
    lib.proceed.set()
    assert lib.wrote.wait(5)
    assert bool((reused == 0).all())


def test_a_bad_spare_limit_fails_the_call_not_every_free(monkeypatch):
    """MXPORT_SPARE_MIB=lots raised inside the finalizer of every large output, never to the caller: a
    traceback printed (sys.unraisablehook) at each free and reuse silently off."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "lots")
    with pytest.raises(ValueError, match="MXPORT_SPARE_MIB='lots'"):
        quantize(torch.ones(BIG, dtype=torch.bfloat16))
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "64")
    t = pages.fresh_bytes(BIG)
    monkeypatch.setenv(pages.ENV_SPARE_MIB, "lots")  # changed while a buffer is in use: it is not kept
    del t
    gc.collect()
    assert unraisable == [] and pages.spare_bytes() == 0


def _quantize_over(fill: int, x: torch.Tensor, many: bool, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(x, **kw) (quantize_many([x]) with ``many``) into spares every byte of which is ``fill``:
    the value and scale bytes."""
    shapes = [tuple(x.shape), (x.numel() // x.shape[-1], -(-x.shape[-1] // 32))]
    if kw.get("direction") == "columnwise":
        shapes = [(x.shape[-1], x.numel() // x.shape[-1]), (x.shape[-1], -(-x.numel() // x.shape[-1] // 32))]
    dirty = [pages.fresh_bytes(s).fill_(fill) for s in shapes if math.prod(s) >= pages.HUGE_PAGE_MIN_BYTES]
    assert dirty, "no output is large enough to come from the pool"
    held, used = pages.spare_bytes(), sum(-(-t.numel() // pages.HUGE_PAGE) * pages.HUGE_PAGE for t in dirty)
    del dirty
    assert pages.spare_bytes() == held + used
    c = quantize_many([x], **kw)[0] if many else quantize(x, **kw)
    assert pages.spare_bytes() == held + (used if kw.get("direction") == "columnwise" else 0)  # all reused
    return c.data.view(torch.uint8).clone(), c.scale_inv.clone()


@pytest.mark.parametrize(("shape", "many", "kw"), [
    ((1 << 22, 1), False, {}),  # K=1: one padded block a row; the 4 MiB of scales reused too
    ((2, 1 << 16, 33), True, {"fp8_dtype": torch.float8_e5m2, "rounding": "floor"}),  # 3-D, a partial block
    ((65541, 64), False, {"block_2d": True}),  # a last 32-row group of 5 rows
    ((64, 65541), False, {"direction": "columnwise"}),
])
def test_every_output_byte_is_written_over_a_reused_buffer(shape, many, kw):
    """The same bytes over spares full of 0xFF as over spares full of 0x00: no byte of a value or scale
    output (padded blocks, partial row groups, NaN / Inf / zero blocks) is left as the spare held it."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    flat = x.view(-1)
    flat[:64] = 0
    flat[64:96:3], flat[96:128:5], flat[128:160:7] = float("nan"), float("inf"), -float("inf")
    ones, zeros = _quantize_over(0xFF, x, many, kw), _quantize_over(0x00, x, many, kw)
    assert torch.equal(ones[0], zeros[0]) and torch.equal(ones[1], zeros[1])


def test_threads_quantizing_at_once_never_share_a_buffer():
    """Two threads quantize (and free) at once, their outputs taken from and given to one pool: each result
    is its input's, unchanged until freed."""
    xs = [torch.full(BIG, v, dtype=torch.bfloat16) for v in (1.0, -3.0)]
    wants = [quantize(x).data.view(torch.uint8)[0, 0].item() for x in xs]
    bad = []

    def work(i: int) -> None:
        for _ in range(6):
            c = quantize(xs[i])
            c2 = quantize_many([xs[i]])[0]
            for got in (c.data.view(torch.uint8), c2.data.view(torch.uint8)):
                if not bool((got == wants[i]).all()):
                    bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert bad == [] and wants[0] != wants[1]


def test_share_memory_moves_an_output_off_its_buffer():
    """share_memory_ (as a torch.multiprocessing queue does to what it sends) copies the storage into shared
    memory and releases the buffer: reused at once, the moved tensor keeps its bytes."""
    t = pages.fresh_bytes(BIG).fill_(5)
    ptr = t.data_ptr()
    t.share_memory_()
    assert t.is_shared() and t.data_ptr() != ptr and pages.spare_bytes() == 8 << 20
    u = pages.fresh_bytes(BIG).fill_(6)
    assert u.data_ptr() == ptr and bool((t == 5).all())
