"""The process plumbing behind ``mxport refit``: spawn a world of processes on loopback, collect their
messages through one pipe each, report a failing process by rank, and leave nothing running on any path
(success, error, Ctrl-C)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redirect_output(log_dir: str | None, rank: int) -> None:
    """Send this process's stdout and stderr to ``log_dir/rank<rank>.log`` (keeps the parent's terminal for
    its progress display: library chatter goes to a log file); nothing when ``log_dir`` is None."""
    if log_dir:
        fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


class DemoFailed(RuntimeError):
    """A process of the refit demo failed; the message holds its error."""


def spawn_and_collect(target, world: int, args: tuple, on_event=None, timeout_s: float = 1800.0) -> dict:
    """Spawn ``world`` processes ``target(rank, world, *args, outbox)``, collect their messages until each
    says "done" and return ``{"plan": ..., "steps": [...]}``; raise :class:`DemoFailed` when one reports an
    error or dies, or after ``timeout_s``. Every process is reaped and the resource tracker stopped on every
    path."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    own_tracker = not _tracker_running()  # spawning starts multiprocessing's resource tracker on first use
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]  # one per process: no semaphores to track
    procs = [ctx.Process(target=target, args=(r, world, *args, Outbox(pipes[r][1])), daemon=True)
             for r in range(world)]
    try:
        with _children_ignore_sigint():
            for p, (_, w) in zip(procs, pipes, strict=True):
                p.start()
                w.close()  # the child holds the write end: its exit reads as end of file
        return _collect(procs, [r for r, _ in pipes], on_event, timeout_s)
    finally:
        _reap(procs)
        for r, w in pipes:
            r.close()
            w.close()
        if own_tracker:
            _stop_tracker()


@contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Processes started inside ignore SIGINT (an ignored signal stays ignored across exec). Ctrl-C in a
    terminal signals the whole foreground process group: the parent alone handles it, ending and reaping
    its children (:func:`_reap`), instead of each child printing a KeyboardInterrupt traceback on the
    terminal (while it imports torch, before its output goes to its log). SIGINT is blocked meanwhile, so a
    Ctrl-C in that moment reaches the parent once its handler is back rather than being lost."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed from the main thread
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Outbox:
    """A process's way to the parent (the write end of its pipe): ``put(message)``."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, message: tuple) -> None:
        self.conn.send(message)


def _collect(procs, readers, on_event, timeout_s: float) -> dict:
    """The parent's loop of the runner: the processes' messages until every one is done."""
    from multiprocessing.connection import wait

    result: dict = {"plan": None, "steps": []}
    done: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(done) < len(procs):
        if time.monotonic() > deadline:
            raise DemoFailed(f"refit demo did not finish within {timeout_s:.0f} s")
        for conn in wait([c for r, c in enumerate(readers) if r not in done], timeout=1.0):
            try:
                kind, rank, payload = conn.recv()
            except EOFError:  # the process exited without saying done
                r = readers.index(conn)
                procs[r].join(timeout=5)
                raise DemoFailed(f"process {r} exited with code {procs[r].exitcode}") from None
            if kind == "error":
                raise DemoFailed(f"{'trainer' if rank == 0 else f'inference process {rank}'} failed: "
                                 f"{payload}")
            if kind == "plan":
                result["plan"] = payload
            elif kind == "step":
                result["steps"].append(payload)
            elif kind == "done":
                done.add(rank)
            if on_event is not None:
                on_event(kind, rank, payload)
    for p in procs:
        p.join(timeout=30)
    return result


def _reap(procs) -> None:
    """End and reap every started process (SIGTERM, then SIGKILL after 5 s): nothing the demo started
    outlives it, on success, error or KeyboardInterrupt alike."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _tracker_running() -> bool:
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None) is not None


def _stop_tracker() -> None:
    """Stop multiprocessing's resource tracker process, which starting a spawn child launches and which
    otherwise lives as long as this process (and past it, until it notices the exit): the runner started
    it, its children are reaped, so nothing is registered there any more. The next spawn starts a new one."""
    from multiprocessing import resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is not None:
        try:
            stop()  # closes our end of its pipe and waits for it to exit
        except (OSError, ChildProcessError):
            pass
