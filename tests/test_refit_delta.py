"""Delta refit: only the words that changed since the version the engines hold, exact, versioned, all or
nothing (the codec, then refits between threads of one process)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_refit_coordinator import _refit  # noqa: E402  (a refit between threads: sender and receivers)

from mxport.refit import InProcessChannel, RefitPlan, RefitReceiver, RefitSender, Transport
from mxport.refit.arena import allocate_targets
from mxport.refit.items import tensor_items
from mxport.refit.plan import dtype_from_name
from mxport.refit.stream import delta as dl


def _round_trip(base: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload from ``base`` to ``new`` and ``base`` with it applied (``base`` itself untouched)."""
    sender_base = base.clone()
    d = dl.diff_bucket(sender_base, new)
    assert torch.equal(sender_base, new)  # the sender's base is brought up to the new bytes
    payload = dl.encode([d], base.numel())
    (got,) = dl.parse(payload.clone(), [base.numel()], base.numel())
    out = base.clone()
    dl.apply(got, out)
    return out, payload


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Both diff / apply paths: the native kernel's one pass (where it builds) and torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(dl, "_lib", lambda *ts: None)
    else:
        from mxport.quantize import NATIVE_PATH

        if not NATIVE_PATH.available:
            pytest.skip(f"native kernel unavailable: {NATIVE_PATH.disabled_reason}")
    return request.param


def _densities(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    for frac in (0.0, 0.0005, 0.01, 0.05, 0.2, 1.0):
        new = base.clone()
        pick = torch.rand(4096, generator=g) < frac
        new[pick] = torch.randint(0, 256, (int(pick.sum()),), dtype=torch.uint8, generator=g)
        yield frac, base, new


def test_a_delta_rebuilds_the_new_bytes_exactly_for_every_density(path):
    for frac, base, new in _densities():
        out, payload = _round_trip(base, new)
        assert torch.equal(out, new), frac
        assert payload.numel() <= 8 * 7 + 4096  # never more than the header and the bucket whole


def test_the_native_and_torch_paths_give_the_same_payload(monkeypatch):
    from mxport.quantize import NATIVE_PATH

    if not NATIVE_PATH.available:
        pytest.skip(f"native kernel unavailable: {NATIVE_PATH.disabled_reason}")
    native = [_round_trip(b, n)[1] for _, b, n in _densities(1)]
    monkeypatch.setattr(dl, "_lib", lambda *ts: None)
    plain = [_round_trip(b, n)[1] for _, b, n in _densities(1)]
    assert all(torch.equal(a, b) for a, b in zip(native, plain, strict=True))


def test_a_changed_byte_costs_its_word_index_mask_and_byte(path):
    base = torch.zeros(1024, dtype=torch.uint8)
    new = base.clone()
    new[17] = 5  # word 2, byte 1
    new[900] = 7  # word 112, byte 4
    d = dl.diff_bucket(base.clone(), new)
    assert d.mode == dl.WORDS
    assert d.index.tolist() == [2, 112]
    assert d.masks.tolist() == [0b10, 0b10000]
    assert d.values.tolist() == [5, 7]
    assert dl.encode([d], 1024).numel() == 8 * 7 + 8 + 8 + 8  # header, indices, masks, values (8-padded)
    assert dl.diff_bucket(base.clone(), base).mode == dl.UNCHANGED
    assert dl.diff_bucket(base.clone(), base + 1).mode == dl.WHOLE


def _payload_with(changes) -> torch.Tensor:
    base = torch.zeros(256, dtype=torch.uint8)
    new = base.clone()
    new[3], new[100] = 1, 2
    payload = dl.encode([dl.diff_bucket(base.clone(), new)], 256)
    changes(payload)
    return payload


@pytest.mark.parametrize("change, words", [
    (lambda p: p.view(torch.int64).__setitem__(0, 7), "magic"),
    (lambda p: p.view(torch.int64).__setitem__(5, 40), "do not fit"),  # 40 words in a 32-word bucket
    (lambda p: p[56:64].view(torch.int32).copy_(torch.tensor([12, 0], dtype=torch.int32)), "increasing"),
    (lambda p: p[56:64].view(torch.int32).copy_(torch.tensor([0, 32], dtype=torch.int32)), "increasing"),
    (lambda p: p.__setitem__(64, 0b11), "masks"),
])
def test_a_payload_that_does_not_fit_the_stream_is_refused_before_a_byte_is_written(change, words):
    with pytest.raises(ValueError, match=words):
        dl.parse(_payload_with(change), [256], 256)


def test_a_payload_with_trailing_bytes_or_another_stream_size_is_refused():
    p = _payload_with(lambda p: None)
    with pytest.raises(ValueError):
        dl.parse(torch.cat([p, torch.zeros(8, dtype=torch.uint8)]), [256], 256)
    with pytest.raises(ValueError, match="does not match"):
        dl.parse(p, [256, 256], 512)


# -- refits between threads --------------------------------------------------------------------------------
ITEMS = tensor_items("a.weight", torch.float8_e4m3fn, (64, 64), scales=(torch.uint8, (64, 2))) + \
    tensor_items("norm.weight", torch.bfloat16, (300,))
PLAN = RefitPlan(ITEMS)


class _Weights:
    """The trainer's tensors, a few elements moved per step."""

    def __init__(self):
        self.g = torch.Generator().manual_seed(1)
        self.t = [torch.randn(64, 64, generator=self.g).to(torch.float8_e4m3fn),
                  torch.randint(100, 130, (64, 2), dtype=torch.uint8, generator=self.g),
                  torch.randn(300, generator=self.g).to(torch.bfloat16)]

    def step(self, n: int = 5) -> list[torch.Tensor]:
        for t in self.t:
            flat = t.view(-1).view(torch.uint8)
            pos = torch.randint(0, flat.numel(), (n,), generator=self.g)
            flat[pos] = flat[pos] ^ 1
        return [t.clone() for t in self.t]


class _Corrupting(Transport):
    """An endpoint that flips the middle byte of the next broadcast it receives when ``armed``."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size, self.src = inner, inner.rank, inner.world_size, inner.src
        self.armed = False

    def all_gather(self, t):
        return self.inner.all_gather(t)

    def broadcast(self, buf, async_op=False):
        h = self.inner.broadcast(buf, async_op)
        if self.armed:
            h.wait()
            buf.view(-1)[buf.numel() // 2] ^= 0xFF
            self.armed = False
        return h


def _world(n_receivers=3, *, delta=(True, True, True, True), bucket_bytes=1024, timeout_s=20):
    ch = InProcessChannel(n_receivers, timeout_s=timeout_s)
    sender = RefitSender(ch.endpoint(0), PLAN, bucket_bytes=bucket_bytes, delta=delta[0])
    receivers, eps = [], []
    for r in range(1, n_receivers + 1):
        ep = _Corrupting(ch.endpoint(r))
        eps.append(ep)
        # receiver 1: direct mode (one arena), receiver 2: staging, receiver 3: eager (the vLLM workers')
        targets = allocate_targets(PLAN, "cpu") if r == 1 else \
            [torch.zeros(e.shape, dtype=dtype_from_name(e.dtype)) for e in PLAN.entries]
        receivers.append(RefitReceiver(ep, PLAN, targets, bucket_bytes=bucket_bytes, delta=delta[r],
                                       eager=r == 3, inflight=1, defer_backup=r == 3))
    return sender, receivers, eps


def _live_equal(receivers, tensors) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for r in receivers for a, b in zip(r.targets, tensors, strict=True))


def test_twenty_delta_refits_are_bit_exact_and_move_only_what_changed(path):
    sender, receivers, _ = _world()
    w = _Weights()
    for step in range(20):
        tensors = w.step()
        sent, outs = _refit(sender, receivers, tensors)
        assert not isinstance(sent, Exception), sent
        assert _live_equal(receivers, tensors), step
        direct = receivers[0].streams[0]  # its rollback copy follows the delta (not a whole copy)
        assert direct.direct and direct.wait_backup() >= 0
        assert torch.equal(direct._rollback_copy.copy, direct._arena)
        eager = receivers[2].streams[0]  # patched in the ring: no buffer beside it, a copy that follows
        assert eager.eager and eager.buffer_bytes == (2 * 1024, PLAN.total_bytes)
        eager.wait_backup()
        assert torch.equal(eager._rollback_copy.copy, direct._arena)
        assert sent.delta == (step > 0)  # the first refit goes whole: no engine holds a base yet
        assert all(o.delta == sent.delta and o.wire_bytes == sent.wire_bytes for o in outs)
        if step == 0:
            assert sent.wire_bytes == PLAN.total_bytes and sent.changed_words == -1
        else:
            assert sent.wire_bytes < PLAN.total_bytes // 5
            assert 0 < sent.changed_words <= 15


def test_an_eager_delta_larger_than_a_bucket_lands_beside_the_ring_and_a_failed_patch_votes_no(monkeypatch):
    """A delta payload larger than a ring buffer gets a buffer of its own (counted in ``buffer_bytes``); a
    patch that fails on the eager receiver makes it vote no, and every rank keeps the previous version."""
    sender, receivers, _ = _world()
    w = _Weights()
    for _ in range(2):
        assert not isinstance(_refit(sender, receivers, w.step())[0], Exception)
    w.t[0].view(torch.uint8).view(-1)[:2048] ^= 3  # two buckets whole
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    eager = receivers[2].streams[0]
    assert sent.delta and sent.wire_bytes > 1024 and _live_equal(receivers, tensors)
    assert eager.buffer_bytes[0] == 2 * 1024 + sent.wire_bytes
    before = [t.clone() for t in receivers[0].targets]
    calls = []
    real = dl.apply

    def breaks(d, bucket):  # the eager receiver's third bucket (two patched into its live tensors)
        if bucket.data_ptr() == eager._ring_bufs[1].data_ptr():
            calls.append(bucket.numel())
            if len(calls) == 3:
                raise RuntimeError("patch broke")
        return real(d, bucket)

    monkeypatch.setattr(dl, "apply", breaks)
    sent, outs = _refit(sender, receivers, w.step())
    assert "patch broke" in str(outs[2]) and "receiver 3: bad_delta at bucket 2" in str(sent)
    assert _live_equal(receivers, before)
    monkeypatch.setattr(dl, "apply", real)
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert not sent.delta and _live_equal(receivers, tensors)


def test_a_delta_no_smaller_than_the_stream_goes_whole_and_the_next_step_is_a_delta_again():
    sender, receivers, _ = _world()
    w = _Weights()
    _refit(sender, receivers, w.step())
    for t in w.t:
        t.view(-1).view(torch.uint8).add_(1)  # every byte moves: the payload would outgrow the stream
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert not sent.delta and sent.wire_bytes == PLAN.total_bytes and sent.full_for == ()
    assert _live_equal(receivers, tensors)
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert sent.delta and sent.wire_bytes < PLAN.total_bytes // 5 and _live_equal(receivers, tensors)


@pytest.mark.parametrize("bad", [1, 2])
def test_a_rank_that_rejected_a_refit_gets_the_next_one_whole_then_deltas_again(bad):
    sender, receivers, eps = _world()
    w = _Weights()
    for _ in range(2):
        assert not isinstance(_refit(sender, receivers, w.step())[0], Exception)
    before = [t.clone() for t in receivers[0].targets]
    eps[bad].armed = True  # the staging (1) or the eager receiver (2: it patched its live tensors) gets a
    # corrupt delta
    sent, outs = _refit(sender, receivers, w.step())
    assert isinstance(sent, Exception) and all(isinstance(o, Exception) for o in outs)
    assert _live_equal(receivers, before)  # every rank kept the previous version
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert not sent.delta and sent.wire_bytes == PLAN.total_bytes and sent.full_for
    assert _live_equal(receivers, tensors)
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert sent.delta and sent.full_for == ()
    assert _live_equal(receivers, tensors)


@pytest.mark.parametrize("delta", [(True, True, False, True), (False, True, True, True),
                                   (True, True, True, False)])
def test_a_stream_runs_deltas_only_when_every_endpoint_takes_them(delta):
    sender, receivers, _ = _world(delta=delta)
    w = _Weights()
    for _ in range(3):
        tensors = w.step()
        sent, _ = _refit(sender, receivers, tensors)
        assert not sent.delta and sent.wire_bytes == PLAN.total_bytes
        assert _live_equal(receivers, tensors)


def test_a_producer_failure_in_a_delta_refit_aborts_it_on_every_rank():
    sender, receivers, _ = _world()
    w = _Weights()
    assert not isinstance(_refit(sender, receivers, w.step())[0], Exception)
    before = [t.clone() for t in receivers[1].targets]

    def failing():
        yield w.t[0].clone()
        raise RuntimeError("producer broke")

    sent, outs = _refit(sender, receivers, failing())
    assert isinstance(sent, RuntimeError) and all(isinstance(o, Exception) for o in outs)
    assert _live_equal(receivers[1:], before)
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert not sent.delta and _live_equal(receivers, tensors)


def test_blocks_changed_counts_each_block_once_by_its_values_or_its_scale():
    plan = RefitPlan(tensor_items("a.weight", torch.float8_e4m3fn, (4, 64), scales=(torch.uint8, (4, 2))))
    values, scales = plan.entries[0].offset, plan.entries[1].offset
    # block 0 (values bytes 0 and 31), block 3 (its scale byte), block 5 (a value and its scale)
    offsets = torch.tensor([values, values + 31, values + 5 * 32 + 1, scales + 3, scales + 5])
    assert dl.block_counts(plan, offsets) == (3, 8)


def test_changed_bytes_are_the_masked_bytes_of_the_changed_words():
    base = torch.zeros(64, dtype=torch.uint8)
    new = base.clone()
    new[9], new[15], new[40] = 1, 1, 1
    assert dl.changed_bytes([(128, dl.diff_bucket(base.clone(), new))]).tolist() == [137, 143, 168]


def test_an_engine_that_restarted_gets_the_step_whole_the_others_keep_their_version():
    """Receiver 2 restarts (a fresh process on the trainer's new group: version 0, no base): that refit goes
    whole, naming it; receiver 1 kept its version; the next refit is a delta again."""
    sender, receivers, _ = _world()
    w = _Weights()
    for _ in range(2):
        assert not isinstance(_refit(sender, receivers, w.step())[0], Exception)
    ch = InProcessChannel(2, timeout_s=20)
    fresh = [torch.zeros(e.shape, dtype=dtype_from_name(e.dtype)) for e in PLAN.entries]
    receivers[1] = RefitReceiver(ch.endpoint(2), PLAN, fresh, bucket_bytes=1024, delta=True)
    _regroup(sender, receivers)
    tensors = w.step()
    sent, outs = _refit(sender, receivers, tensors)
    assert not isinstance(sent, Exception), sent
    assert not sent.delta and sent.full_for == (2,) and _live_equal(receivers, tensors)
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert sent.delta and sent.full_for == () and _live_equal(receivers, tensors)


def test_a_receiver_names_the_tensors_a_delta_changed_and_none_for_a_whole_refit():
    sender, receivers, _ = _world()
    w = _Weights()
    _refit(sender, receivers, w.step())
    assert all(r.touched_tensors() is None for r in receivers)  # the first refit went whole
    tensors = [t.clone() for t in w.t]
    tensors[2].view(torch.uint8)[7] ^= 1  # only the norm changes
    sent, _ = _refit(sender, receivers, tensors)
    assert sent.delta and all(r.touched_tensors() == {"norm.weight"} for r in receivers)


def _regroup(sender, receivers):
    """Every end on a new in-process group (the trainer's group re-created), handshaken again."""
    ch = InProcessChannel(len(receivers), timeout_s=20)
    sender.transport = ch.endpoint(0)
    for i, r in enumerate(receivers):
        r.transport = ch.endpoint(i + 1)
    threads = [threading.Thread(target=end.handshake) for end in (sender, *receivers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


def test_refits_sent_whole_while_deltas_were_off_do_not_leave_a_stale_base_trusted():
    """An engine without deltas joins (every refit goes whole, the sender's base is not kept up to date), then
    leaves: the next refit must go whole, not a delta onto the base of two versions ago. A pair of bytes that
    changes and changes back cancels in the word-sum checksum: a stale base would commit wrong bytes."""
    sender, receivers, _ = _world(1)
    w = _Weights()
    flat = w.t[0].view(torch.uint8).view(-1)
    _refit(sender, receivers, w.step())
    flat[0], flat[8] = 9, 21
    assert _refit(sender, receivers, [t.clone() for t in w.t])[0].delta
    plain = RefitReceiver(InProcessChannel(1).endpoint(1), PLAN,
                          [torch.zeros(e.shape, dtype=dtype_from_name(e.dtype)) for e in PLAN.entries],
                          bucket_bytes=1024)
    _regroup(sender, [receivers[0], plain])
    flat[0], flat[8] = 10, 20
    sent, _ = _refit(sender, [receivers[0], plain], [t.clone() for t in w.t])
    assert not sent.delta
    _regroup(sender, receivers)
    flat[0], flat[8] = 9, 21
    tensors = [t.clone() for t in w.t]
    sent, _ = _refit(sender, receivers, tensors)
    assert not isinstance(sent, Exception) and not sent.delta
    assert _live_equal(receivers, tensors)


@pytest.mark.parametrize("which", [0, 2])
def test_a_live_weight_written_in_place_makes_the_next_refit_whole_even_if_its_checksum_holds(which):
    """Direct (0) and eager (2) mode, where the live tensors are the base a delta patches: two live words
    swapped in place keep every word-sum checksum; the receiver knows its live tensors were written (their
    _version moved) and takes the next refit whole."""
    sender, receivers, _ = _world()
    w = _Weights()
    for _ in range(2):
        _refit(sender, receivers, w.step())
    live = receivers[which].targets[0].view(torch.uint8).view(-1)
    a = live[0:8].clone()
    live[0:8] = live[64:72]
    live[64:72] = a
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert not isinstance(sent, Exception) and not sent.delta and sent.full_for == (which + 1,)
    assert _live_equal(receivers, tensors)


# -- eager delta streams sharing one engine tensor (two trainer ranks, real gloo processes) ------------------
_PAIRS = (0, 1)


def _pair_plan(t: int) -> RefitPlan:
    return RefitPlan([(f"X.rows{t}", "kept", torch.float32, (32, 64))])


def _pair_digest() -> str:
    import hashlib

    return hashlib.sha256(";".join(f"{t},2,{_pair_plan(t).digest}" for t in _PAIRS).encode()).hexdigest()


def _rows(t: int, step: int) -> torch.Tensor:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(t))
    for s in range(step):
        w[s, 0] += 1.0  # one more word per step
    return w


def _shared_rows(port: int, rank: int, init: str, steps: int = 5) -> list:  # noqa: ARG001
    from mxport.refit import TorchDistTransport
    from mxport.refit.transport import open_group

    torch.set_num_threads(1)
    world = TorchDistTransport.from_group(open_group("127.0.0.1", port, rank, 3, timeout_s=20))
    kw = {"global_digest": _pair_digest(), "trainers": _PAIRS, "bucket_bytes": 4096, "delta": True}
    if rank in _PAIRS:
        sender = RefitSender.for_pairs(world, [(2, _pair_plan(rank))], **kw)
        return [sender.send({2: [_rows(rank, step)]}).delta for step in range(1, steps + 1)]
    X = torch.zeros(64, 64)  # one engine tensor: rows 0..31 from trainer 0, 32..63 from trainer 1
    receiver = RefitReceiver.for_pairs(world, [(t, _pair_plan(t), [X[32 * t:32 * t + 32]]) for t in _PAIRS],
                                       eager=True, inflight=1, defer_backup=True, **kw)
    out = []
    for step in range(1, steps + 1):
        receiver.receive()
        receiver.start_backup()
        out.append(torch.equal(X, torch.cat([_rows(0, step), _rows(1, step)])))
    rings = {b.data_ptr() for s in receiver.streams for b in s._ring_bufs}
    receiver.wait_backup()  # each stream's rollback copy followed its own deltas: it holds its live rows
    copies = [torch.equal(s._rollback_copy.copy, s.targets[0].reshape(-1).view(torch.uint8))
              for s in receiver.streams]
    return {"exact": out, "rings": len(rings), "buffer_bytes": receiver.buffer_bytes, "copies": copies}


def test_eager_delta_streams_sharing_one_engine_tensor_keep_their_base_and_one_ring(tmp_path):
    """Two trainer ranks each send half the rows of one engine tensor (targets share its version counter):
    one stream's commit must not read as an in-place write to the other (every refit then went whole); the
    engine rank's two streams land in one ring of two buckets (they are received one after another), not
    one each, and the delta payloads parsed from it stay whole until the settle."""
    import functools
    import socket

    from mxport.testing import spawn_world

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = spawn_world(functools.partial(_shared_rows, port), 3, tmp_path, wait_s=120)
    assert out[2]["exact"] == [True] * 5
    assert out[0] == out[1] == [False, True, True, True, True]
    assert out[2]["rings"] == 2 and out[2]["buffer_bytes"] == (2 * 4096, 2 * 32 * 64 * 4)
    assert out[2]["copies"] == [True, True]


def _ctrl_c_world(monkeypatch, where: str):
    """One eager delta receiver after a whole refit; Ctrl-C lands in ``where`` during the next (a delta)."""
    from mxport.refit.stream import receiver as rxmod

    sender, receivers, _ = _world(3, timeout_s=3)  # the vote two receivers never join fails in 3 s
    w = _Weights()
    assert not isinstance(_refit(sender, receivers, w.step())[0], Exception)
    before = [[t.clone() for t in r.targets] for r in receivers]
    real = getattr(rxmod.StreamReceiver, where)

    def ctrl_c(self, *args):
        if self.eager or self.direct:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(rxmod.StreamReceiver, where, ctrl_c)
    return sender, receivers, w, before


@pytest.mark.parametrize("where", ["_touched", "_judge"])
def test_ctrl_c_after_a_delta_was_patched_into_the_live_tensors_restores_them(monkeypatch, where):
    """Direct and eager receivers write a delta into their live tensors before the vote: Ctrl-C after that
    (naming the touched tensors, judging the trailer) restores the previous version, and they take the next
    refit whole."""
    sender, receivers, w, before = _ctrl_c_world(monkeypatch, where)
    outs = []

    def rx(r):
        try:
            outs.append(r.receive())
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outs.append(exc)

    tensors = w.step()
    threads = [threading.Thread(target=rx, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    try:
        sender.send(tensors)
    except Exception:  # noqa: BLE001, S110 - the vote fails: two receivers never vote
        pass
    for t in threads:
        t.join(timeout=30)
    assert sum(isinstance(o, KeyboardInterrupt) for o in outs) == 2  # direct and eager
    for r, old in zip(receivers, before, strict=True):
        if r.streams[0].eager or r.streams[0].direct:
            assert all(torch.equal(a, b) for a, b in zip(r.targets, old, strict=True))
            assert r.version == 1


def test_ctrl_c_in_one_stream_of_a_sharded_refit_rolls_back_the_streams_staged_before_it():
    """A sharded engine rank stages its streams one after another: Ctrl-C in the second (which restores its
    own tensors) must also restore the first, whose eager bytes are already live (it was left unvoted)."""
    from types import SimpleNamespace

    class _Stream:
        def __init__(self, fail):
            self.fail, self.discarded, self.plan = fail, [], PLAN
            self.layout = SimpleNamespace(num_buckets=1)

        def prepare(self):
            pass

        def stage(self):
            if self.fail:
                raise KeyboardInterrupt
            return "staged"

        def discard(self, staged):
            self.discarded.append(staged)

    receiver = RefitReceiver.__new__(RefitReceiver)
    receiver.streams = [_Stream(False), _Stream(True)]
    receiver.ends = [(0, (2,)), (1, (2,))]
    with pytest.raises(KeyboardInterrupt):
        receiver._stage_all()
    assert receiver.streams[0].discarded == ["staged"] and receiver.streams[1].discarded == []


def test_a_distrusted_base_makes_the_next_refit_whole():
    """``distrust_base`` (what the vLLM worker calls when an attestation reads other bytes than were sent):
    the next refit goes whole for that receiver, naming it, then deltas again."""
    sender, receivers, _ = _world()
    w = _Weights()
    for step in range(2):
        sent, _ = _refit(sender, receivers, w.step())
        assert not isinstance(sent, Exception) and sent.delta == (step == 1)
    receivers[2].distrust_base()
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert not sent.delta and sent.full_for == (3,) and _live_equal(receivers, tensors)
    tensors = w.step()
    sent, _ = _refit(sender, receivers, tensors)
    assert sent.delta and _live_equal(receivers, tensors)


def _hook_fails_once(port: int, rank: int, init: str) -> dict:  # noqa: ARG001
    """Trainers 0, 1 each fill a tensor of engine rank 2 (eager, one stream each) with ``10 t + step``; at
    step 2 stream 0's own refresh hook raises (COMMIT_FAILED: every rank committed v2), at step 3 trainer
    1's producer raises (every rank rolls back)."""
    import hashlib

    from mxport.refit import RefitError, TorchDistTransport
    from mxport.refit.transport import open_group

    torch.set_num_threads(1)
    world = TorchDistTransport.from_group(open_group("127.0.0.1", port, rank, 3, timeout_s=20))
    kw = {"global_digest": hashlib.sha256(b"hook").hexdigest(), "trainers": _PAIRS, "bucket_bytes": 1024}
    plan = {t: RefitPlan([(f"w{t}", "kept", torch.float32, (64, 16))]) for t in _PAIRS}
    out: dict = {}
    if rank in _PAIRS:
        sender = RefitSender.for_pairs(world, [(2, plan[rank])], **kw)
        for step in (1, 2, 3):
            def gen(step=step):
                if rank == 1 and step == 3:
                    raise RuntimeError("producer fails")
                yield torch.full((64, 16), float(10 * rank + step))
            try:
                sender.send({2: gen()})
            except Exception:  # noqa: BLE001, S110 - step 3 fails on every rank
                pass
        return out
    live, state = [torch.zeros(64, 16), torch.zeros(64, 16)], {"step": 0}

    def hook():
        if state["step"] == 2:
            raise RuntimeError("refresh hook fails once")

    receiver = RefitReceiver.for_pairs(world, [(0, plan[0], [live[0]], [hook]), (1, plan[1], [live[1]])],
                                       eager=True, **kw)
    for step in (1, 2, 3):
        state["step"] = step
        try:
            receiver.receive()
            out[step] = "ok"
        except RefitError as exc:
            out[step] = exc.status.name
        out[f"live{step}"] = (live[0][0, 0].item(), live[1][0, 0].item())
    return out


def test_a_stream_whose_refresh_hook_failed_retakes_its_rollback_copy(tmp_path):
    """After a refit every rank committed but one stream's hook failed (its rollback copy not refreshed), a
    failed refit must restore that stream to the committed version, not the one before."""
    import functools
    import socket

    from mxport.testing import spawn_world

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = spawn_world(functools.partial(_hook_fails_once, port), 3, tmp_path, wait_s=120)[2]
    assert [out[1], out[2]] == ["ok", "COMMIT_FAILED"] and out[3] != "ok"
    assert out["live2"] == out["live3"] == (2.0, 12.0)
