"""Attestation: each engine rank's checksums of the bytes it holds against the trainer's of what it sent,
one all-gather per refit, every mismatch named by its (trainer, engine) route."""

import threading

import torch

from mxport.refit import Box, Holding, InProcessChannel, MeshPlan
from mxport.refit.attest import PieceDigests, attest_round
from mxport.refit.mesh import TensorInfo, local_part

W = TensorInfo("w", "kept", "float32", (4, 8))


def _run(tamper_engine: int | None) -> list:
    full = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    halves = [Box.along((4, 8), 0, 0, 2), Box.along((4, 8), 0, 2, 4)]
    mesh = MeshPlan([[Holding(W, Box.full((4, 8)))]], [[Holding(W, b)] for b in halves])
    held = [{"w": (Box.full((4, 8)), full)}]
    for e, b in enumerate(halves):  # what each engine holds after the refit (one of them altered)
        t = full[b.index()].clone()
        if e + 1 == tamper_engine:
            t[0, 0] += 1
        held.append({"w": (b, t)})
    ch, out = InProcessChannel(2, timeout_s=30), [None] * 3

    def rank(r: int) -> None:
        out[r] = attest_round(ch.endpoint(r), mesh, PieceDigests(lambda n, box: local_part(held[r], n, box)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_learns_the_route_whose_engine_holds_other_bytes():
    assert _run(None) == [[], [], []]
    assert _run(2) == [[(0, 2)]] * 3
    assert _run(1) == [[(0, 1)]] * 3


def test_the_digest_sees_order_every_byte_and_length():
    from mxport.refit.attest import bytes_digest

    t = torch.arange(4 * 64, dtype=torch.int32).reshape(4, 64).to(torch.uint8)
    base = bytes_digest(t)
    assert bytes_digest(t.clone()) == base
    assert bytes_digest(t[[1, 0, 2, 3]]) != base  # two rows swapped: a word sum alone would not see it
    flipped = t.clone()
    flipped.view(-1)[77] ^= 1
    assert bytes_digest(flipped) != base
    odd = torch.arange(13, dtype=torch.uint8)
    assert bytes_digest(odd) != bytes_digest(torch.cat([odd, torch.zeros(3, dtype=torch.uint8)]))
    assert bytes_digest(t.view(-1)[3:20]) == bytes_digest(t.view(-1)[3:20].clone())  # unaligned view


def test_native_and_torch_word_sums_are_the_same_digest(monkeypatch):
    """The native one-pass sums (CPU) and the torch ops (any device) give the same digest, for every length
    class: empty, a partial word, one word, odd tails, more than one torch chunk."""
    from mxport.quantize import NATIVE_PATH
    from mxport.refit import attest

    if not NATIVE_PATH.available:
        import pytest

        pytest.skip(f"native kernel unavailable: {NATIVE_PATH.disabled_reason}")
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 8, 9, 1001, 8 * attest._CHUNK + 24):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        native = attest.bytes_digest(t)
        with monkeypatch.context() as m:
            m.setattr(NATIVE_PATH, "lib_for", lambda _t: None)
            assert attest.bytes_digest(t) == native, n


def test_the_digest_of_data_at_any_address_and_of_a_scalar():
    """Bytes that start off an 8-byte boundary (``frombuffer`` at an odd offset: storage offset 0, the address
    odd) are copied to an aligned buffer first (the native kernel reads whole words), and digest as the same
    bytes anywhere else do; a 0-d tensor digests its bytes."""
    from mxport.refit.attest import bytes_digest

    buf = bytearray(range(256)) * 4
    odd = torch.frombuffer(buf, dtype=torch.uint8, offset=1, count=800)
    assert odd.storage_offset() == 0 and odd.data_ptr() % 8 == 1
    assert bytes_digest(odd) == bytes_digest(odd.clone())
    assert bytes_digest(torch.tensor(1.5)) == bytes_digest(torch.tensor([1.5]))
