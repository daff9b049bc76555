"""Refit plan, buckets, in-process refits and the model consumers (single process; the two-process gloo tests
are in test_refit_dist.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport.refit import (
    InProcessChannel,
    RefitError,
    RefitPlan,
    RefitReceiver,
    RefitSender,
    Status,
    TrainerSource,
    allocate_targets,
    checkpoint_tensors,
    receiver_plan,
)
from mxport.refit.arena import stream_arena
from mxport.refit.buckets import CHUNK_BYTES, BucketLayout, byte_view, checksum, pack_bucket
from mxport.refit.plan import ALIGN, diff_canonical
from mxport.testing import FaultyTransport

DTYPES = [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32]


def _items(shapes_dtypes):
    return [(f"t{i}", "kept", dt, shape) for i, (shape, dt) in enumerate(shapes_dtypes)]


def _random(dtype, shape, g):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def _refit_in_process(plan, sources_per_version, targets, *, bucket_bytes=64, receiver_kw=None, fault=None,
                      prepare=None, after_receive=None, **sender_kw):
    """Run one receiver in a thread against a sender here (both cutting the stream into ``bucket_bytes``
    buckets); returns (sender stats list, receiver results list).
    ``fault(refit, bucket, wire)``: tampers with a copy of each outgoing broadcast (:class:`FaultyTransport`);
    ``prepare(receiver)``: called before any refit; ``after_receive()``: called right after each receive
    returns or raises."""
    ch = InProcessChannel(1, timeout_s=30)
    recv_out = []
    receiver = RefitReceiver(ch.endpoint(1), plan, targets, bucket_bytes=bucket_bytes, **(receiver_kw or {}))
    if prepare is not None:
        prepare(receiver)

    def rx():
        for _ in sources_per_version:
            try:
                recv_out.append(receiver.receive())
            except RefitError as exc:
                recv_out.append(exc)
            if after_receive is not None:
                after_receive()

    th = threading.Thread(target=rx)
    th.start()
    layout = receiver.layout
    ep = ch.endpoint(0) if fault is None else FaultyTransport(ch.endpoint(0), layout.num_buckets, fault)
    sender = RefitSender(ep, plan, bucket_bytes=layout.bucket_bytes, **sender_kw)
    sent = []
    for src in sources_per_version:
        try:
            sent.append(sender.send(src))
        except Exception as exc:  # noqa: BLE001 - the test looks at what send raised
            sent.append(exc)
    th.join(timeout=60)
    assert not th.is_alive()
    return sent, recv_out, receiver


# ---- plan --------------------------------------------------------------------------------------------------
def test_plan_offsets_buckets_and_digest():
    plan = RefitPlan(_items([((3,), torch.uint8), ((5, 7), torch.float32), ((100,), torch.bfloat16)]))
    e = plan.entries
    assert [x.offset for x in e] == [0, 16, 16 + 144]  # 3 -> aligned 16; 140 bytes -> aligned 144
    assert [x.nbytes for x in e] == [3, 140, 200]
    layout = BucketLayout(plan, 64)
    assert [layout.bucket_of(i) for i in range(3)] == [0, 0, 2]
    assert plan.total_bytes == 160 + 208 and layout.num_buckets == 6 and layout.sizes[5] == 368 - 320
    assert plan.digest == RefitPlan(_items([((3,), torch.uint8), ((5, 7), torch.float32),
                                            ((100,), torch.bfloat16)])).digest
    assert plan.digest != RefitPlan(_items([((3,), torch.uint8), ((5, 7), torch.float32),
                                            ((100,), torch.float16)])).digest


def test_plan_is_the_manifest_bucket_size_is_the_streams():
    """The plan (format 2) holds no bucket size: its canonical form and digest are the same whatever the
    streams cut it into; a format-1 plan (with ``bucket_bytes``) is refused by name."""
    plan = RefitPlan(_items([((3,), torch.uint8), ((5, 7), torch.float32)]))
    canon = plan.canonical()
    assert canon["format"] == "mxport-refit-plan/2" and set(canon) == {"format", "align", "entries"}
    assert canon["entries"][1] == ["t1", "kept", "float32", [5, 7], 140, 16]
    assert BucketLayout(plan, 16).num_buckets == 10 and BucketLayout(plan, 4096).num_buckets == 1
    old = {**canon, "format": "mxport-refit-plan/1", "bucket_bytes": 64}
    with pytest.raises(ValueError, match="format must be 'mxport-refit-plan/2', got 'mxport-refit-plan/1'"):
        RefitPlan.from_canonical(old)


@pytest.mark.parametrize("bad", [0, -16, 10, 16.0, True, 1 << 63])
def test_layout_rejects_bad_bucket_bytes(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketLayout(RefitPlan(_items([((3,), torch.uint8)])), bad)


def test_a_bucket_size_beyond_the_plan_allocates_only_the_plans_bytes():
    """A bucket size far beyond the plan's bytes (1 TiB, the largest int64 multiple of 16) is one bucket of
    the plan's bytes: the sender's pack buffers are that large, not ``bucket_bytes``."""
    plan = RefitPlan(_items([((3,), torch.uint8), ((5, 7), torch.float32)]))
    g = torch.Generator().manual_seed(1)
    sent = [_random(getattr(torch, e.dtype), e.shape, g) for e in plan.entries]
    for bucket in (1 << 40, (1 << 63) - 16):
        targets = [torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in plan.entries]
        stats, got, receiver = _refit_in_process(plan, [sent], targets, bucket_bytes=bucket,
                                                 stream_crc32=True)
        assert not isinstance(stats[0], Exception), stats[0]
        assert stats[0].buckets == 1 and got[0].version == 1 and not receiver.direct
        assert all(torch.equal(a, b) for a, b in zip(sent, targets, strict=True))
        assert receiver.live_crc32() == stats[0].stream_crc32  # re-packed into one scratch bucket


def test_plan_rejects_bad_items():
    with pytest.raises(ValueError, match="role"):
        RefitPlan([("a", "weights", torch.uint8, (1,))])
    with pytest.raises(ValueError, match="twice"):
        RefitPlan([("a", "kept", torch.uint8, (1,)), ("a", "kept", torch.uint8, (1,))])
    with pytest.raises(ValueError, match="unknown dtype"):
        RefitPlan([("a", "kept", "float7", (1,))])
    with pytest.raises(ValueError, match="at least one"):
        RefitPlan([])


def test_diff_lists_missing_extra_reordered_shape_dtype():
    a = RefitPlan([("x", "kept", torch.float32, (4,)), ("y", "kept", torch.float32, (4,)),
                   ("z", "kept", torch.float32, (4,)), ("w", "kept", torch.uint8, (2,))]).canonical()
    b = RefitPlan([("y", "kept", torch.float32, (4,)), ("x", "kept", torch.float32, (4,)),
                   ("z", "kept", torch.float32, (5,)), ("v", "kept", torch.uint8, (2,))]).canonical()
    d = " | ".join(diff_canonical(a, b))
    assert "missing: 'v'" in d and "extra: 'w'" in d
    assert "reordered: position 0 holds 'x' locally but 'y' remotely" in d
    assert "shape: 'z' local (4,) vs remote (5,)" in d
    c = RefitPlan([("x", "kept", torch.bfloat16, (4,)), ("y", "kept", torch.float32, (4,)),
                   ("z", "kept", torch.float32, (4,)), ("w", "kept", torch.uint8, (2,))]).canonical()
    assert diff_canonical(a, c) == ["dtype: 'x' local float32 vs remote bfloat16"]


# ---- buckets -----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=40),
       bucket=st.sampled_from([16, 32, 48, 64, 256, 4096]))
def test_bucket_layout_covers_every_byte_once(sizes, bucket):
    plan = RefitPlan(_items([((n,), torch.uint8) for n in sizes]))
    layout = BucketLayout(plan, bucket)
    seen = [torch.zeros(n, dtype=torch.int32) for n in sizes]
    for b in range(layout.num_buckets):
        cover = torch.zeros(layout.sizes[b], dtype=torch.int32)
        for s in layout.segments[b]:
            seen[s.entry][s.src:s.src + s.length] += 1
            cover[s.dst:s.dst + s.length] += 1
            assert b * bucket + s.dst == plan.entries[s.entry].offset + s.src  # stream position is consistent
        for start, n in layout.gaps[b]:
            cover[start:start + n] += 1
        assert torch.equal(cover, torch.ones_like(cover))  # segments + gaps partition the bucket
        assert layout.sizes[b] == min(bucket, plan.total_bytes - b * bucket)
    assert all(bool((x == 1).all()) for x in seen)
    assert plan.total_bytes % ALIGN == 0


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * CHUNK_BYTES), min_size=1, max_size=6),
       bucket=st.sampled_from([4096, CHUNK_BYTES, 3 * CHUNK_BYTES + 4096, 5 * CHUNK_BYTES]))
def test_pack_with_checksum_equals_pack_then_checksum(sizes, bucket):
    """Packing chunk by chunk and summing each chunk in cache gives the same bytes and checksum as packing
    first; chunk edges fall inside tensors, inside gaps and between them."""
    g = torch.Generator().manual_seed(sum(sizes) + bucket)
    plan = RefitPlan(_items([((n,), torch.uint8) for n in sizes]))
    layout = BucketLayout(plan, bucket)
    sources = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    for b in range(layout.num_buckets):
        a = torch.full((layout.sizes[b],), 0x5A, dtype=torch.uint8)
        c = torch.full((layout.sizes[b],), 0xC3, dtype=torch.uint8)
        assert pack_bucket(layout, b, sources, a) is None
        crc = pack_bucket(layout, b, sources, c, with_checksum=True)
        assert torch.equal(a, c) and crc == checksum(a)
    if c.numel():
        c[0] ^= 1
        assert checksum(c) != crc  # one changed byte changes it


def test_checksum_sees_swapped_chunks():
    x = torch.randint(0, 256, (3 * CHUNK_BYTES + 64,), generator=torch.Generator().manual_seed(0),
                      dtype=torch.uint8)
    y = torch.cat([x[CHUNK_BYTES:2 * CHUNK_BYTES], x[:CHUNK_BYTES], x[2 * CHUNK_BYTES:]])
    assert checksum(x) != checksum(y)


@settings(max_examples=15, deadline=None)
@given(specs=st.lists(st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3),
                                st.sampled_from(DTYPES)), min_size=1, max_size=12),
       bucket=st.sampled_from([16, 64, 512]))
def test_in_process_refit_overwrites_sentinels_with_sent_bytes(specs, bucket):
    g = torch.Generator().manual_seed(len(specs) * 1000 + bucket)
    items = _items([(tuple(shape), dt) for shape, dt in specs])
    plan = RefitPlan(items)
    sent = [_random(dt, shape, g) for _, _, dt, shape in items]
    targets = [torch.empty(shape, dtype=dt) for _, _, dt, shape in items]
    for t in targets:
        t.view(torch.uint8).fill_(0xA5)
    ptrs = [t.data_ptr() for t in targets]
    stats, got, receiver = _refit_in_process(plan, [sent], targets, bucket_bytes=bucket, stream_crc32=True)
    assert got[0]["version"] == 1 == stats[0]["version"]
    assert receiver.live_crc32() == stats[0]["stream_crc32"]
    for t, s in zip(targets, sent, strict=True):
        assert torch.equal(byte_view(t), byte_view(s))
    assert [t.data_ptr() for t in targets] == ptrs and receiver.pointers_stable()
    assert receiver.verify_live()
    targets[0].view(torch.uint8).reshape(-1)[0] ^= 1  # a changed live byte is detected
    assert not receiver.verify_live()
    assert receiver.live_crc32() != stats[0]["stream_crc32"]


def test_sender_abort_on_wrong_dtype_keeps_live_weights_and_next_refit_succeeds():
    items = _items([((40,), torch.float32), ((8, 8), torch.bfloat16), ((5,), torch.uint8)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(1)
    v1 = [_random(dt, shape, g) for _, _, dt, shape in items]
    bad = [_random(dt, shape, g) for _, _, dt, shape in items]
    bad[1] = bad[1].to(torch.float16)  # wrong dtype in the middle of the stream
    v3 = [_random(dt, shape, g) for _, _, dt, shape in items]
    short = v3[:2]  # one tensor missing
    targets = [torch.zeros(shape, dtype=dt) for _, _, dt, shape in items]
    sent, got, receiver = _refit_in_process(plan, [v1, bad, short, v3], targets)
    assert isinstance(sent[1], ValueError) and "'t1'" in str(sent[1]) and "float16" in str(sent[1])
    assert isinstance(got[1], RefitError) and "aborted" in str(got[1]) and "'t1'" in str(got[1])
    assert isinstance(sent[2], ValueError) and "got 2 tensors" in str(sent[2])
    assert isinstance(got[2], RefitError) and got[2].kept_version == 1
    assert got[3]["version"] == 4 and receiver.version == 4
    for t, s in zip(targets, v3, strict=True):
        assert torch.equal(byte_view(t), byte_view(s))


def test_receiver_rejects_bad_targets():
    plan = RefitPlan(_items([((4,), torch.float32)]))
    ep = InProcessChannel(1).endpoint(1)
    with pytest.raises(ValueError, match="'t0' is float16"):
        RefitReceiver(ep, plan, [torch.zeros(4, dtype=torch.float16)])
    with pytest.raises(ValueError, match="got 2 tensors"):
        RefitReceiver(ep, plan, [torch.zeros(4), torch.zeros(4)])
    with pytest.raises(TypeError, match="RefitPlan"):
        RefitReceiver(ep, "plan", [torch.zeros(4)])
    with pytest.raises(ValueError, match="is the sender"):
        RefitReceiver(InProcessChannel(1).endpoint(0), plan, [torch.zeros(4)])


# ---- consumers: a tiny Llama trainer -> an MXFP8Linear inference model -------------------------------------
@pytest.mark.parametrize("arena", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_trainer_and_inference_plans_agree_and_refit_lands_quantized_bytes(tmp_path, tied, arena):
    """Both sides' plans agree; a refit lands the trainer's quantized bytes in the inference model. With
    arena=True on both sides the trainer sends every bucket without packing and the receiver takes them in
    direct mode, into the model's own tensors, moved into one arena without changing what the model
    computes."""
    from mxport import quantize
    from mxport.models import load_causal_lm
    from mxport.nn import MXFP8Linear, quantize_model
    from mxport.testing import make_tiny_llama

    path = make_tiny_llama(tmp_path / "m", tie_word_embeddings=tied, hidden=64, intermediate=80)
    trainer, _ = load_causal_lm(path, dtype=torch.float32)
    infer, _ = load_causal_lm(path, dtype=torch.float32)
    quantize_model(infer)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before = infer(ids).logits
    src = TrainerSource(trainer, arena=arena)
    plan, targets = receiver_plan(infer, arena=arena)
    assert plan.digest == src.plan.digest
    assert (stream_arena(plan, targets) is not None) is arena
    with torch.no_grad():
        assert torch.equal(infer(ids).logits, before)  # moving into the arena changes no value
    names = [e.name for e in plan.entries]
    assert ("lm_head.weight" in names) is (not tied)  # a tied head is sent once, as the embedding
    q = "model.layers.0.self_attn.q_proj.weight"
    assert names[names.index(q) + 1] == q + "_scale"
    with torch.no_grad():  # the trainer moves away from the initial weights
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sent, got, receiver = _refit_in_process(src.plan, [src.tensors()], targets, bucket_bytes=4096)
    assert got[0]["version"] == 1 and receiver.pointers_stable() and receiver.direct is arena
    assert (sent[0]["zero_copy_buckets"] == receiver.layout.num_buckets) is arena
    lin = infer.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(lin, MXFP8Linear)
    assert lin.weight.data_ptr() == targets[plan.index(q)].data_ptr()  # the module's own buffer was written
    expect = quantize(trainer.get_submodule("model.layers.0.self_attn.q_proj").weight.detach())
    assert torch.equal(lin.weight.view(torch.uint8), expect.data.view(torch.uint8))
    assert torch.equal(lin.weight_scale, expect.scale_inv)
    assert torch.equal(infer.model.norm.weight, trainer.model.norm.weight)
    x = torch.randn(3, 64)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, expect.dequantize()))  # cache followed the refit


def test_trainer_arena_sends_the_same_bytes_without_packing(tmp_path):
    """TrainerSource(arena=True) quantizes into one stream-ordered send buffer: the same bytes as the default
    source, tensors that stay put from refit to refit, and buckets inside the arena sent without packing."""
    from mxport.models import load_causal_lm
    from mxport.refit.buckets import byte_view
    from mxport.testing import make_tiny_llama

    path = make_tiny_llama(tmp_path / "m", hidden=64, intermediate=80)
    trainer, _ = load_causal_lm(path, dtype=torch.float32)
    plain = TrainerSource(trainer)
    arena = TrainerSource(trainer, arena=True)
    assert arena.plan.digest == plain.plan.digest
    first = list(arena.tensors())
    want = list(plain.tensors())
    assert all(torch.equal(byte_view(a), byte_view(b)) for a, b in zip(first, want, strict=True))
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    second = list(arena.tensors())
    quantized = [i for i, e in enumerate(arena.plan.entries) if e.role != "kept"]
    assert [second[i].data_ptr() for i in quantized] == [first[i].data_ptr() for i in quantized]
    want2 = list(plain.tensors())
    assert all(torch.equal(byte_view(a), byte_view(b)) for a, b in zip(second, want2, strict=True))
    targets = [torch.zeros(e.shape, dtype=t.dtype) for e, t in zip(arena.plan.entries, want2, strict=True)]
    sent, got, _ = _refit_in_process(arena.plan, [arena.tensors(), plain.tensors()], targets,
                                     bucket_bytes=4096)
    assert [g["version"] for g in got] == [1, 2]
    assert sent[0]["zero_copy_buckets"] > sent[1]["zero_copy_buckets"]
    assert all(torch.equal(byte_view(t), byte_view(w)) for t, w in zip(targets, want2, strict=True))


def test_trainer_arena_adopts_kept_tensors_so_every_bucket_is_zero_copy(tmp_path):
    """With arena=True the kept tensors that own their storage (the tied embedding, the norms) are adopted:
    their .data becomes their view of the send buffer, so the model still computes the same, the optimizer
    updates them in place there, and every bucket of every refit goes out without packing, with the right
    bytes."""
    from mxport.models import load_causal_lm
    from mxport.testing import make_tiny_llama

    path = make_tiny_llama(tmp_path / "m", hidden=64, intermediate=80)
    trainer, _ = load_causal_lm(path, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        before = trainer(ids).logits
    embed = trainer.get_submodule("model.embed_tokens").weight
    src = TrainerSource(trainer, arena=True)
    first = list(src.tensors())
    kept = [i for i, e in enumerate(src.plan.entries) if e.role == "kept"]
    assert kept and all(first[i].data_ptr() == src._slots[i].data_ptr() for i in kept)
    i_embed = src.plan.index("model.embed_tokens.weight")
    # the Parameter object itself now lives in the buffer
    assert embed.data_ptr() == first[i_embed].data_ptr()
    with torch.no_grad():
        assert torch.equal(trainer(ids).logits, before)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    trainer(ids, labels=ids).loss.backward()
    opt.step()
    assert embed.data_ptr() == first[i_embed].data_ptr()  # updated in place, still adopted
    want = [t.clone() for t in TrainerSource(trainer).tensors()]
    targets = [torch.zeros(e.shape, dtype=t.dtype) for e, t in zip(src.plan.entries, want, strict=True)]
    sent, got, receiver = _refit_in_process(src.plan, [src.tensors()], targets, bucket_bytes=4096,
                                            stream_crc32=True)
    assert got[0]["version"] == 1
    assert sent[0]["zero_copy_buckets"] == receiver.layout.num_buckets  # nothing packed
    assert src.stream_crc32() == sent[0]["stream_crc32"] == receiver.live_crc32()
    with pytest.raises(ValueError, match="arena=True"):
        TrainerSource(trainer).stream_crc32()
    assert all(torch.equal(byte_view(t), byte_view(w)) for t, w in zip(targets, want, strict=True))


def test_trainer_arena_copies_what_it_cannot_adopt():
    """Kept tensors that are views of a larger storage, or need a cast to the planned dtype, stay where they
    are and are copied into the buffer at every refit (so later updates still reach the wire); a tensor whose
    .data is replaced after adoption is copied in from its new storage."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(64, 32, bias=False)
    shared = torch.randn(2, 16)
    model.a = torch.nn.Parameter(shared[0])  # two views of one storage: never adopted
    model.b = torch.nn.Parameter(shared[1])
    model.norm = torch.nn.Parameter(torch.randn(16))  # owns its storage: adopted
    src = TrainerSource(model, kept_dtype=None, arena=True)
    out = dict(zip([e.name for e in src.plan.entries], src.tensors(), strict=True))
    assert model.a.data_ptr() != out["a"].data_ptr() and model.norm.data_ptr() == out["norm"].data_ptr()
    with torch.no_grad():
        model.a.add_(1.0)
        model.norm.data = torch.full((16,), 3.0)  # replaced: no longer the buffer's view
    out = dict(zip([e.name for e in src.plan.entries], src.tensors(), strict=True))
    assert torch.equal(out["a"], model.a.detach()) and torch.equal(out["b"], model.b.detach())
    assert (torch.equal(out["norm"], torch.full((16,), 3.0))
            and out["norm"].data_ptr() != model.norm.data_ptr())
    bf = TrainerSource(model, kept_dtype=torch.bfloat16, arena=True)
    out = dict(zip([e.name for e in bf.plan.entries], bf.tensors(), strict=True))
    assert out["norm"].dtype == torch.bfloat16 and torch.equal(out["norm"], torch.full((16,), 3.0).bfloat16())
    assert model.norm.dtype == torch.float32  # a cast is never adopted


def test_trainer_arena_adopts_at_construction_and_respects_the_plan():
    """Review findings, each with the right behaviour: adoption happens when the source is built (before a
    CUDA graph of the training step would be captured), not at the first refit; a parameter that a
    non-persistent buffer aliases is not adopted (the module would compute with a stale copy); a kept tensor
    whose dtype drifted from the plan is refused like without an arena (not cast back silently); kept_dtype
    never casts integer buffers; stream_crc32() refuses a half-consumed tensors() call and is 0 for a plan of
    empty tensors."""
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(64, 32, bias=False)
    model.norm = torch.nn.Parameter(torch.randn(16))
    model.scale = torch.nn.Parameter(torch.randn(16))
    model.register_buffer("scale_alias", model.scale.data, persistent=False)  # the module's own alias
    model.register_buffer("step", torch.tensor([7], dtype=torch.int64))
    src = TrainerSource(model, kept_dtype=torch.bfloat16, arena=True)
    by_name = {e.name: i for i, e in enumerate(src.plan.entries)}
    assert src.plan.entries[by_name["step"]].dtype == "int64"  # not cast to bfloat16
    assert src.plan.entries[by_name["norm"]].dtype == "bfloat16"
    f32 = TrainerSource(model, arena=True)  # built, not yet used: already adopted
    assert model.norm.data_ptr() == f32._slots[f32.plan.index("norm")].data_ptr()
    assert model.scale.data_ptr() == model.scale_alias.data_ptr()  # not adopted: the alias still follows
    assert model.scale.data_ptr() != f32._slots[f32.plan.index("scale")].data_ptr()
    out = dict(zip([e.name for e in src.plan.entries], src.tensors(), strict=True))
    assert out["step"].dtype == torch.int64 and int(out["step"]) == 7
    gen = f32.tensors()
    next(gen)
    with pytest.raises(ValueError, match="ran to its end"):
        f32.stream_crc32()
    list(gen)
    assert isinstance(f32.stream_crc32(), int)
    model.half()
    drifted = list(f32.tensors())
    norm = drifted[f32.plan.index("norm")]
    assert norm.dtype == torch.float16  # as the plain source does: the sender refuses it
    with pytest.raises(ValueError, match="norm"):
        f32.plan.check_tensor(f32.plan.index("norm"), norm)
    empty = torch.nn.Module()
    empty.w = torch.nn.Parameter(torch.zeros(0))
    e_src = TrainerSource(empty, arena=True)
    list(e_src.tensors())
    assert e_src.stream_crc32() == 0


def test_canonical_device_fills_in_the_index(monkeypatch):
    """RefitSender(device="cuda") must recognise tensors on cuda:0 as already there (torch.device("cuda") !=
    torch.device("cuda:0")), or it would pack every bucket (found on an H200)."""
    from mxport.refit.buckets import canonical_device

    assert canonical_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert canonical_device("cuda") == torch.device("cuda", 0)
    assert canonical_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_trainer_arena_takes_native_mxfp8_storage_too():
    """A weight held as native MXFP8 storage (a torchao MXTensor parameter: a wrapper subclass without a plain
    storage) is exported as is and copied into the send buffer, so the buffer is the whole stream: the same
    bytes as without the arena, every bucket zero-copy, and stream_crc32() equals the receiver's live CRC."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(64, 32, bias=False)
    model.lin.weight = torch.nn.Parameter(
        mx_tensor.MXTensor.to_mx(torch.randn(32, 64), torch.float8_e4m3fn, 32), requires_grad=False)
    model.norm = torch.nn.Parameter(torch.randn(16))
    src = TrainerSource(model, arena=True)
    want = [t.clone() for t in TrainerSource(model).tensors()]
    got = list(src.tensors())
    assert all(torch.equal(byte_view(a), byte_view(b)) for a, b in zip(got, want, strict=True))
    assert [g.data_ptr() for g in got] == [s.data_ptr() for s in src._slots]
    targets = [torch.zeros(e.shape, dtype=t.dtype) for e, t in zip(src.plan.entries, want, strict=True)]
    sent, _, receiver = _refit_in_process(src.plan, [src.tensors()], targets, bucket_bytes=256)
    assert sent[0]["zero_copy_buckets"] == receiver.layout.num_buckets
    assert receiver.live_crc32() == src.stream_crc32()
    # its values and scales were summed as they were copied in: the fused checksums are the buckets' own
    assert [e.name for e in src.plan.entries] == ["norm", "lin.weight", "lin.weight_scale"]
    assert src._summed == [False, True, True]  # the norm is adopted: summed when its bucket is sent
    stream = stream_arena(src.plan, src._slots)
    assert [src.stream_checksum(b * 256, n) for b, n in enumerate(receiver.layout.sizes)] == [
        checksum(stream[b * 256:b * 256 + n]) for b, n in enumerate(receiver.layout.sizes)]


def test_checkpoint_tensors_names_per_format():
    plan = RefitPlan([("m.weight", "values", torch.float8_e4m3fn, (2, 32)),
                      ("m.weight_scale", "scales", torch.uint8, (2, 1)),
                      ("n.weight", "kept", torch.float32, (2,))])
    targets = [torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.full((2, 1), 127, dtype=torch.uint8),
               torch.ones(2)]
    sg = list(checkpoint_tensors(plan, targets, "sglang"))
    assert [n for n, _ in sg] == ["m.weight", "m.weight_scale_inv", "n.weight"]
    assert all(a is b for (_, a), b in zip(sg, targets, strict=True))  # no copies
    assert [n for n, _ in checkpoint_tensors(plan, targets, "modelopt")][1] == "m.weight_scale"
    with pytest.raises(ValueError, match="fmt"):
        list(checkpoint_tensors(plan, targets, "vllm"))


@pytest.mark.parametrize("direct", [False, True])
def test_receiver_with_a_moved_buffer_drains_the_refit_and_raises(direct):
    """A live buffer reallocated between refits: the receiver still drains the refit (streams stay in step),
    raises, and (direct mode) the arena holds the previous version."""
    items = _items([((64,), torch.float32), ((40,), torch.uint8)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(3)
    v1, v2 = ([_random(dt, shape, g) for _, _, dt, shape in items] for _ in range(2))
    targets = (allocate_targets(plan) if direct
               else [torch.zeros(shape, dtype=dt) for _, _, dt, shape in items])
    arena = stream_arena(plan, targets) if direct else None
    ch = InProcessChannel(1, timeout_s=30)
    receiver = RefitReceiver(ch.endpoint(1), plan, targets)
    assert receiver.direct is direct
    out = []

    def rx():
        out.append(receiver.receive())
        targets[1].set_(torch.zeros(40, dtype=torch.uint8))  # someone reallocated a live buffer
        try:
            receiver.receive()
        except RefitError as exc:
            out.append(exc)

    th = threading.Thread(target=rx)
    th.start()
    sender = RefitSender(ch.endpoint(0), plan)
    sender.send(v1)
    with pytest.raises(RefitError, match="rejected by 1 of 1 receiver.*live_changed") as info:
        sender.send(v2)  # the receiver's report reaches the sender
    assert [r.status for r in info.value.receivers] == [Status.LIVE_CHANGED]
    th.join(timeout=60)
    assert not th.is_alive()
    # the receiver still drained every bucket and the trailer: streams stay in step
    assert ch._queues[1].empty()
    assert out[0]["version"] == 1 and isinstance(out[1], RefitError) and "moved or reallocated" in str(out[1])
    assert receiver.version == 1
    if direct:
        assert torch.equal(arena, _stream_bytes(plan, v1))


def _stream_bytes(plan, tensors):
    """The plan's byte stream of ``tensors`` (padding zero)."""
    out = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    for e, t in zip(plan.entries, tensors, strict=True):
        out[e.offset:e.offset + e.nbytes] = byte_view(t)
    return out


def test_allocate_targets_is_one_arena_in_stream_order():
    items = _items([((3,), torch.uint8), ((0, 5), torch.float32), ((5, 7), torch.float32),
                    ((9,), torch.bfloat16), ((2, 32), torch.float8_e4m3fn)])
    plan = RefitPlan(items)
    targets = allocate_targets(plan)
    base = targets[0].data_ptr()
    for e, t in zip(plan.entries, targets, strict=True):
        assert str(t.dtype).removeprefix("torch.") == e.dtype and tuple(t.shape) == e.shape
        assert t.is_contiguous() and t.untyped_storage().data_ptr() == targets[0].untyped_storage().data_ptr()
        if e.nbytes:
            assert t.data_ptr() == base + e.offset
    arena = stream_arena(plan, targets)
    assert arena is not None and arena.data_ptr() == base and arena.numel() == plan.total_bytes
    assert bool((arena == 0).all())
    # not an arena: separate tensors, two targets swapped, a stream that would run past the storage
    assert stream_arena(plan, [torch.zeros(e.shape, dtype=t.dtype) for e, t in zip(plan.entries, targets,
                                                                                      strict=True)]) is None
    two = RefitPlan(_items([((4,), torch.float32), ((4,), torch.float32)]))
    a, b = allocate_targets(two)
    assert stream_arena(two, [a, b]) is not None and stream_arena(two, [b, a]) is None
    big = torch.zeros(8)
    assert stream_arena(two, [big[4:], big[8:]]) is None


def test_receiver_picks_direct_mode_from_the_targets():
    plan = RefitPlan(_items([((40,), torch.float32), ((5,), torch.uint8)]))
    ep = InProcessChannel(1).endpoint(1)
    assert RefitReceiver(ep, plan, allocate_targets(plan)).direct is True
    assert RefitReceiver(ep, plan, allocate_targets(plan), direct=False).direct is False
    separate = [torch.zeros(40), torch.zeros(5, dtype=torch.uint8)]
    assert RefitReceiver(ep, plan, separate).direct is False
    with pytest.raises(ValueError, match="direct=True"):
        RefitReceiver(ep, plan, separate, direct=True)


def test_direct_refits_land_in_the_arena_and_every_failure_restores_the_previous_version():
    """v1 ok; v2 corrupted on the wire; v3 ok; v4 aborted (wrong dtype); v5 short; v6 ok. After every failure
    the arena equals the last good version byte for byte; pointers never move; the rollback copy follows."""
    items = _items([((40,), torch.float32), ((8, 8), torch.bfloat16), ((5,), torch.uint8),
                    ((300,), torch.uint8), ((3, 32), torch.float8_e4m3fn)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(11)
    vs = [[_random(dt, shape, g) for _, _, dt, shape in items] for _ in range(6)]
    bad = list(vs[3])
    bad[1] = bad[1].to(torch.float16)
    short = vs[4][:3]
    targets = allocate_targets(plan)
    for t in targets:
        t.view(torch.uint8).fill_(0xA5)
    arena = stream_arena(plan, targets)
    arena.fill_(0xA5)  # padding too: the whole stream is overwritten
    initial = arena.clone()
    ptrs = [t.data_ptr() for t in targets]

    def corrupt(refit, b, wire):
        if refit == 2 and b == 3:
            wire[-1] ^= 0xFF

    sent, got, receiver = _refit_in_process(plan, [vs[0], vs[1], vs[2], bad, short, vs[5]], targets,
                                            fault=corrupt, stream_crc32=True)
    assert receiver.direct and isinstance(sent[3], ValueError) and isinstance(sent[4], ValueError)
    assert got[0]["version"] == 1 and got[0]["direct"] is True and got[0]["commit_s"] < 0.05
    assert (isinstance(got[1], RefitError) and got[1].bucket == 3
            and "restored from the rollback copy" in str(got[1]))
    assert isinstance(got[3], RefitError) and "aborted" in str(got[3]) and got[3].kept_version == 3
    assert isinstance(got[4], RefitError) and got[4].kept_version == 3
    assert got[5]["version"] == 6 and receiver.version == 6
    assert all(got[i]["backup_s"] > 0 for i in (0, 2, 5))
    assert not torch.equal(initial, _stream_bytes(plan, vs[5]))
    assert torch.equal(arena, _stream_bytes(plan, vs[5]))  # bytes equal the sent bytes, padding included
    assert receiver.live_crc32() == sent[5]["stream_crc32"] and receiver.verify_live()
    assert [t.data_ptr() for t in targets] == ptrs and receiver.pointers_stable()
    receiver.wait_backup()
    assert torch.equal(receiver.streams[0]._staging, arena)  # the rollback copy holds the live version



def test_eager_refits_write_live_tensors_bucket_by_bucket_and_every_failure_restores_them():
    """Eager mode (scattered live tensors, the vLLM workers' mode): buckets land in a ring of inflight + 1
    bucket buffers and go into the live tensors as they come; v2 corrupted on the wire, v4 aborted, v5 short:
    after each failure every live tensor equals the last good version byte for byte, from the host rollback
    copy; no commit copy; pointers never move."""
    items = _items([((40,), torch.float32), ((8, 8), torch.bfloat16), ((5,), torch.uint8),
                    ((300,), torch.uint8), ((3, 32), torch.float8_e4m3fn)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(12)
    vs = [[_random(dt, shape, g) for _, _, dt, shape in items] for _ in range(6)]
    bad = list(vs[3])
    bad[1] = bad[1].to(torch.float16)
    targets = [torch.full(shape, 0, dtype=dt) for _, _, dt, shape in items]  # separate tensors: no arena
    ptrs = [t.data_ptr() for t in targets]
    snaps = []

    def corrupt(refit, b, wire):
        if refit == 2 and b == 3:
            wire[-1] ^= 0xFF

    def live():
        return [t.clone() for t in targets]

    sent, got, receiver = _refit_in_process(plan, [vs[0], vs[1], vs[2], bad, vs[4][:3], vs[5]], targets,
                                            fault=corrupt, receiver_kw={"eager": True, "inflight": 1},
                                            after_receive=lambda: snaps.append(live()))
    stream = receiver.streams[0]
    assert stream.eager and not receiver.direct
    assert len({v.untyped_storage().data_ptr() for v in stream._landing}) == 2  # a ring of two buckets
    assert stream._staging.device.type == "cpu" and stream._staging is stream._rollback_copy.copy
    assert [o["version"] if not isinstance(o, RefitError) else "error" for o in got] == [1, "error", 3,
                                                                                          "error", "error", 6]
    assert "restored from the rollback copy" in str(got[1]) and got[1].bucket == 3
    for i, want in ((0, vs[0]), (1, vs[0]), (2, vs[2]), (3, vs[2]), (4, vs[2]), (5, vs[5])):
        pairs = zip(snaps[i], want, strict=True)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs), i
    assert receiver.verify_live() and [t.data_ptr() for t in targets] == ptrs
    receiver.wait_backup()
    assert torch.equal(stream._rollback_copy.copy, _stream_bytes(plan, vs[5]))  # the copy follows the live



@pytest.mark.parametrize("start_backup", [True, False])
@pytest.mark.parametrize("versions", [True, False])
def test_deferred_backup_runs_when_asked_or_before_the_next_refit(start_backup, versions, monkeypatch):
    """``defer_backup``: a commit leaves the rollback copy on the previous version until the owner calls
    start_backup (the vLLM worker: after re-deriving and attesting); if it never does, the next receive copies
    first, so a refit that fails right after still restores the last committed version; also for tensors
    without version counters (inference tensors), where only the receiver's own mark says the copy is old."""
    import mxport.refit.arena as arena_mod
    import mxport.refit.stream.receiver as stream_mod

    if not versions:
        monkeypatch.setattr(arena_mod, "target_versions", lambda targets: None)
        monkeypatch.setattr(stream_mod, "target_versions", lambda targets: None)
    items = _items([((64,), torch.float32), ((100,), torch.uint8)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(6)
    vs = [[_random(dt, shape, g) for _, _, dt, shape in items] for _ in range(3)]
    targets = [torch.zeros(64), torch.zeros(100, dtype=torch.uint8)]
    copies, snaps = [], []

    def after():
        stream = receiver_box[0].streams[0]
        copies.append(stream._rollback_copy.copy.clone())
        if start_backup:
            receiver_box[0].start_backup()
        snaps.append([t.clone() for t in targets])

    receiver_box = []

    def corrupt(refit, b, wire):
        if refit == 3 and b == 0:
            wire[0] ^= 0x01

    _, outs, receiver = _refit_in_process(plan, vs, targets, fault=corrupt,
                                          receiver_kw={"eager": True, "defer_backup": True},
                                          prepare=receiver_box.append, after_receive=after)
    assert [o["version"] if not isinstance(o, RefitError) else "error" for o in outs] == [1, 2, "error"]
    assert torch.equal(copies[1], _stream_bytes(plan, vs[0]))  # not refreshed at commit
    for got, want in zip(snaps[2], vs[1], strict=True):  # rolled back to v2, the last committed
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    receiver.wait_backup()
    assert torch.equal(receiver.streams[0]._rollback_copy.copy, _stream_bytes(plan, vs[1]))


def test_eager_needs_scattered_targets():
    """An arena takes direct mode (eager asks nothing more of it); a delta stream is eager too (its patch
    reads the live version from the live tensors)."""
    plan = RefitPlan(_items([((40,), torch.float32), ((5,), torch.uint8)]))
    ep = InProcessChannel(1).endpoint(1)
    separate = [torch.zeros(40), torch.zeros(5, dtype=torch.uint8)]
    assert RefitReceiver(ep, plan, separate, eager=True).streams[0].eager
    arena = RefitReceiver(ep, plan, allocate_targets(plan), eager=True)
    assert arena.direct and not arena.streams[0].eager
    assert RefitReceiver(ep, plan, separate, eager=True, delta=True).streams[0].eager


def _direct_run(plan, versions, targets, fault, slow_backup_s=0.0):
    """:func:`_refit_in_process` recording the live stream after every receive (right after it returns or
    raises, without waiting for the background backup), with the backup copy slowed down by
    ``slow_backup_s``."""
    arena = stream_arena(plan, targets)
    snaps = []

    def prepare(receiver):
        assert receiver.direct
        if slow_backup_s:
            run_backup = receiver.streams[0]._rollback_copy._run

            def slow():
                import time

                time.sleep(slow_backup_s)
                run_backup()

            receiver.streams[0]._rollback_copy._run = slow

    _, outs, receiver = _refit_in_process(plan, versions, targets, fault=fault, prepare=prepare,
                                          after_receive=lambda: snaps.append(arena.clone()))
    return receiver, outs, snaps


def test_direct_failure_right_after_a_success_rolls_back_to_that_success():
    """The background backup of v2 is slowed down; v3 fails at once: receive() must wait for the backup, so
    the rollback restores v2 (not v1, which a stale rollback copy would still hold)."""
    items = _items([((64,), torch.float32), ((100,), torch.uint8)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(5)
    vs = [[_random(dt, shape, g) for _, _, dt, shape in items] for _ in range(4)]

    def corrupt(refit, b, wire):
        if refit == 3 and b == 0:
            wire[0] ^= 0x01

    receiver, outs, snaps = _direct_run(plan, vs, allocate_targets(plan), corrupt, slow_backup_s=0.3)
    assert [o["version"] if not isinstance(o, RefitError) else "error" for o in outs] == [1, 2, "error", 4]
    assert torch.equal(snaps[1], _stream_bytes(plan, vs[1]))
    assert torch.equal(snaps[2], _stream_bytes(plan, vs[1]))  # rolled back to v2 exactly
    assert torch.equal(snaps[3], _stream_bytes(plan, vs[3]))


def test_direct_mode_mxfp8linear_cache_follows_the_broadcast_writes():
    """A broadcast writes memory without bumping ``_version``; the receiver bumps it, so the decoded cache of
    an MXFP8Linear whose buffers are arena views follows (scale byte 127 -> 128 doubles the output)."""
    from mxport import quantize
    from mxport.nn import MXFP8Linear

    lin = MXFP8Linear(64, 8)
    plan, live = receiver_plan(lin)
    targets = allocate_targets(plan)
    lin.weight, lin.weight_scale = targets  # the module's buffers are now the arena views
    w = quantize(torch.randn(8, 64))
    v1 = [w.data, w.scale_inv]
    v2 = [w.data, w.scale_inv + 1]
    x = torch.randn(3, 64)
    outs_y = []
    assert live[0].shape == targets[0].shape
    _, got, receiver = _refit_in_process(plan, [v1, v2], targets, after_receive=lambda: outs_y.append(lin(x)))
    assert receiver.direct and [g["version"] for g in got] == [1, 2]
    assert torch.equal(outs_y[0], torch.nn.functional.linear(x, w.dequantize()))
    assert torch.equal(outs_y[1], 2 * outs_y[0])


def test_sender_sends_an_arena_without_packing():
    """Tensors that are views of one stream-ordered arena (allocate_targets on the sender) go out bucket by
    bucket straight from the arena, whether they come as a list or from a generator; scattered copies of them
    are packed; the receiver gets the same bytes."""
    items = _items([((40,), torch.float32), ((8, 8), torch.bfloat16), ((5,), torch.uint8),
                    ((300,), torch.uint8)])
    plan = RefitPlan(items)
    g = torch.Generator().manual_seed(2)
    src = allocate_targets(plan)
    for t in src:
        t.copy_(_random(t.dtype, tuple(t.shape), g))
    targets = [torch.zeros(e.shape, dtype=t.dtype) for e, t in zip(plan.entries, src, strict=True)]
    scattered = [t.clone() for t in src]
    sent, got, _ = _refit_in_process(plan, [src, iter(src), scattered], targets)
    assert sent[0]["zero_copy_buckets"] == BucketLayout(plan, 64).num_buckets == sent[1]["zero_copy_buckets"]
    assert sent[2]["zero_copy_buckets"] < BucketLayout(plan, 64).num_buckets  # separate allocations: packed
    assert [x["version"] for x in got] == [1, 2, 3]
    for t, s in zip(targets, src, strict=True):
        assert torch.equal(byte_view(t), byte_view(s))


@pytest.mark.parametrize("arena", [False, True])
def test_receiver_plan_targets_share_version_counters_so_the_decoded_cache_follows(arena):
    """A forward before the refit builds the decoded cache; the refit must make it stale (receiver_plan's
    targets are detach() aliases sharing the buffers' version counters, not .data aliases with counters of
    their own) — also when the buffers were moved into an arena (after a first forward, so a cache of the old
    storage exists)."""
    from mxport import quantize
    from mxport.nn import MXFP8Linear

    model = torch.nn.Sequential(MXFP8Linear(64, 8))
    x = torch.randn(3, 64)
    w0 = quantize(torch.randn(8, 64))
    model[0].weight.copy_(w0.data)
    model[0].weight_scale.copy_(w0.scale_inv)
    assert torch.equal(model(x), torch.nn.functional.linear(x, w0.dequantize()))  # cache of the first weights
    plan, targets = receiver_plan(model, arena=arena)
    assert torch.equal(model(x), torch.nn.functional.linear(x, w0.dequantize()))  # cache built (again) here
    w = quantize(torch.randn(8, 64))
    _, got, receiver = _refit_in_process(plan, [[w.data, w.scale_inv]], targets)
    assert got[0]["version"] == 1 and receiver.direct is arena
    assert torch.equal(model(x), torch.nn.functional.linear(x, w.dequantize()))


def test_receiver_plan_arena_refuses_tensors_it_cannot_move():
    """Two parameters sharing one storage cannot each own a slot of the arena: ValueError naming the tensor,
    and nothing was moved."""
    model = torch.nn.Module()
    model.norm = torch.nn.Parameter(torch.randn(16))
    shared = torch.randn(2, 16)
    model.a, model.b = torch.nn.Parameter(shared[0]), torch.nn.Parameter(shared[1])
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="'a' cannot move into the refit arena"):
        receiver_plan(model, arena=True)
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_direct_rollback_restores_what_was_live_when_the_refit_started():
    """Direct mode: values written into the arena after the receiver was built (a checkpoint load, say) are
    what a failed refit restores, as in staging mode (the rollback copy is retaken when the targets' versions
    moved)."""
    items = _items([((16,), torch.float32), ((8,), torch.bfloat16)])
    plan = RefitPlan(items)
    targets = allocate_targets(plan)
    ch = InProcessChannel(1, timeout_s=30)
    receiver = RefitReceiver(ch.endpoint(1), plan, targets, bucket_bytes=64)
    assert receiver.direct
    for t in targets:
        t.fill_(7.0)  # loaded after the receiver was built
    out = []
    th = threading.Thread(target=lambda: out.append(_catch(receiver.receive)))
    th.start()
    sender = RefitSender(FaultyTransport(ch.endpoint(0), receiver.layout.num_buckets,
                                         lambda refit, b, wire: wire.fill_(1) if b == 0 else None), plan,
                         bucket_bytes=64)
    sent = _catch(lambda: sender.send([torch.full((16,), 3.0), torch.full((8,), 3.0, dtype=torch.bfloat16)]))
    th.join(timeout=30)
    assert isinstance(out[0], RefitError) and isinstance(sent, RefitError)
    assert all(bool((t == 7.0).all()) for t in targets)


def _catch(fn):
    try:
        return fn()
    except RefitError as exc:
        return exc


def test_empty_plan_refits():
    """A plan whose tensors are all empty (0 bytes, one empty bucket) refits cleanly."""
    plan = RefitPlan([("e", "kept", torch.float32, (0, 4))])
    targets = [torch.zeros(0, 4)]
    sent, got, _ = _refit_in_process(plan, [[torch.zeros(0, 4)], [torch.zeros(0, 4)]], targets)
    assert [g["version"] for g in got] == [1, 2] and sent[0]["bytes"] == 0


def test_zero_copy_never_sends_foreign_padding():
    """A source that is a view into a larger storage (a flat parameter buffer) must not send its neighbours'
    bytes as padding: the bucket is packed, and a staging receiver's verification holds."""
    flat = torch.arange(100, dtype=torch.float32) + 1
    plan = RefitPlan([("w", "kept", torch.float32, (3,))])  # 12 bytes -> 16 in the stream
    targets = [torch.zeros(3)]
    sent, got, receiver = _refit_in_process(plan, [[flat[:3]]], targets, stream_crc32=True)
    assert sent[0]["zero_copy_buckets"] == 0
    assert torch.equal(targets[0], flat[:3]) and receiver.verify_live()
    assert receiver.live_crc32() == sent[0]["stream_crc32"]
    arena = allocate_targets(plan)  # zero padding: sent in place
    arena[0].copy_(flat[:3])
    sent, _, receiver = _refit_in_process(plan, [arena], [torch.zeros(3)])
    assert sent[0]["zero_copy_buckets"] == 1 and receiver.verify_live()


def test_a_failing_producer_aborts_the_refit():
    """A tensors() generator that raises something else than ValueError / TypeError (an OOM while quantizing)
    still aborts the refit: the receiver keeps its weights, the error reaches the caller, the next refit
    works."""
    items = _items([((64,), torch.float32)] * 4)
    plan = RefitPlan(items)

    def gen(fail):
        for i in range(4):
            if fail and i == 2:
                raise RuntimeError("simulated OOM while quantizing")
            yield torch.full((64,), float(i + 10 * fail))

    targets = [torch.zeros(64) for _ in range(4)]
    sent, got, _ = _refit_in_process(plan, [gen(False), gen(True), gen(False)], targets)
    assert isinstance(sent[1], RuntimeError) and "simulated OOM" in str(sent[1])
    assert isinstance(got[1], RefitError) and "aborted" in str(got[1])
    assert [g["version"] for g in (got[0], got[2])] == [1, 3]
    assert [float(t[0]) for t in targets] == [0.0, 1.0, 2.0, 3.0]


def test_the_sender_drops_each_produced_tensor_once_its_bytes_are_on_the_wire():
    """A generator's tensors are freed bucket by bucket: when the sender asks for a tensor of a later bucket,
    every tensor whose bytes all lie in buckets already posted is gone (the sender keeps no view of its
    memory), and those still needed are alive."""
    import weakref

    import numpy as np

    items = _items([((100,), torch.float32)] * 12)  # 400 bytes each, 3-4 to a 1024-byte bucket
    plan = RefitPlan(items)
    refs: list = []
    leaks: list = []

    def gen():
        for i, e in enumerate(plan.entries):
            posted_end = e.offset // 1024 * 1024  # buckets before e's are posted
            for j, r in enumerate(refs):
                ended = plan.entries[j].offset + plan.entries[j].nbytes
                if ended <= posted_end and r() is not None:
                    leaks.append((i, j))
                if ended > posted_end + 1024:  # reaches past e's bucket: still to be packed
                    assert r() is not None
            arr = np.full(100, float(i), dtype=np.float32)  # lives as long as any view of its storage
            refs.append(weakref.ref(arr))
            t = torch.from_numpy(arr)
            del arr
            yield t
            del t

    targets = [torch.zeros(100) for _ in range(12)]
    sent, got, _ = _refit_in_process(plan, [gen()], targets, bucket_bytes=1024)
    assert not isinstance(sent[0], Exception) and not isinstance(got[0], Exception)
    assert [float(t[0]) for t in targets] == [float(i) for i in range(12)]
    assert not leaks


# ---- the canonical form: what a peer's plan is rebuilt from ------------------------------------------------
def test_from_canonical_round_trips_with_the_same_digest():
    plan = RefitPlan([("w", "values", torch.float8_e4m3fn, (4, 64)),
                      ("w_scale", "scales", torch.uint8, (4, 2)),
                      ("e", "kept", torch.bfloat16, (0, 3)), ("n", "kept", torch.float32, (5,))])
    import json

    again = RefitPlan.from_canonical(json.loads(json.dumps(plan.canonical())))
    assert again.digest == plan.digest and again.entries == plan.entries
    assert again.total_bytes == plan.total_bytes


def _canon():
    return RefitPlan([("a", "kept", torch.float32, (3, 4)), ("b", "scales", torch.uint8, (7,))]).canonical()


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c.update(extra=1), "exactly the keys"),
    (lambda c: c.pop("align"), "exactly the keys"),
    (lambda c: c.update(format="mxport-refit-plan/0"), "plan format"),
    (lambda c: c.update(align=8), "align"),
    (lambda c: c.update(bucket_bytes=64), "exactly the keys"),
    (lambda c: c.update(entries={}), "entries must be a list"),
    (lambda c: c["entries"].append(["c", "kept", "float32", [1]]), "6 fields"),
    (lambda c: c["entries"][0].__setitem__(0, 5), "name"),
    (lambda c: c["entries"][0].__setitem__(1, "weights"), "role"),
    (lambda c: c["entries"][0].__setitem__(2, "float"), "dtype must be one of"),
    (lambda c: c["entries"][0].__setitem__(2, "complex64"), "dtype must be one of"),
    (lambda c: c["entries"][0].__setitem__(3, [3, -4]), "shape"),
    (lambda c: c["entries"][0].__setitem__(3, [3, 4.0]), "shape"),
    (lambda c: c["entries"][0].__setitem__(3, [True, 4]), "shape"),
    (lambda c: c["entries"][0].__setitem__(4, -48), "non-negative"),
    (lambda c: c["entries"][1].__setitem__(5, 0), "do not follow"),
    (lambda c: c["entries"][1].__setitem__(0, "a"), "twice"),
])
def test_from_canonical_refuses_every_bad_field(mutate, needle):
    c = _canon()
    mutate(c)
    with pytest.raises(ValueError, match=needle):
        RefitPlan.from_canonical(c)


def test_from_canonical_refuses_non_dicts():
    for bad in (None, [], "plan", 3):
        with pytest.raises(ValueError, match="exactly the keys"):
            RefitPlan.from_canonical(bad)


def _both(fn0, fn1):
    """Run ``fn0(endpoint 0)`` and ``fn1(endpoint 1)`` of one in-process channel, each in a thread."""
    ch = InProcessChannel(1, timeout_s=30)
    out = [None, None]

    def run(i, fn):
        try:
            out[i] = fn(ch.endpoint(i))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[i] = exc

    ths = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((fn0, fn1))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=30)
    return out


def test_handshake_mismatch_diff_travels_as_validated_json():
    from mxport.refit import RefitPlanMismatch
    from mxport.refit.handshake import exchange_plans

    a = RefitPlan(_items([((4,), torch.float32), ((3,), torch.uint8)]))
    b = RefitPlan(_items([((4,), torch.float32), ((5,), torch.uint8)]))
    out = _both(lambda ep: exchange_plans(ep, a, 3, 64), lambda ep: exchange_plans(ep, b, 7, 64))
    assert all(isinstance(x, RefitPlanMismatch) for x in out)
    assert "receiver 1: shape: 't1' local (3,) vs remote (5,)" in str(out[0])
    assert "shape: 't1' local (5,) vs remote (3,)" in str(out[1])
    same = _both(lambda ep: exchange_plans(ep, a, 3, 64), lambda ep: exchange_plans(ep, a, 7, 64))
    assert same == [(7, False), (7, False)]


def test_handshake_agrees_on_delta_only_when_every_endpoint_takes_it():
    from mxport.refit.handshake import exchange_plans

    a = RefitPlan(_items([((4,), torch.float32)]))
    both = _both(lambda ep: exchange_plans(ep, a, 0, 64, delta=True),
                 lambda ep: exchange_plans(ep, a, 0, 64, delta=True))
    assert [x.delta for x in both] == [True, True]
    one = _both(lambda ep: exchange_plans(ep, a, 0, 64, delta=True), lambda ep: exchange_plans(ep, a, 0, 64))
    assert [x.delta for x in one] == [False, False]


def test_handshake_refuses_streams_cut_into_other_buckets():
    """The bucket size is the stream's: the same plan with another bucket size on a receiver is refused on
    both ends before any payload, naming both sizes (each end would post other broadcast sizes)."""
    from mxport.refit import RefitPlanMismatch
    from mxport.refit.handshake import exchange_plans

    a = RefitPlan(_items([((40,), torch.float32), ((3,), torch.uint8)]))
    out = _both(lambda ep: exchange_plans(ep, a, 0, 64), lambda ep: exchange_plans(ep, a, 0, 128))
    assert all(isinstance(x, RefitPlanMismatch) for x in out)
    assert "receiver 1: bucket_bytes: local 64 vs remote 128" in str(out[0])
    assert "bucket_bytes: local 128 vs remote 64" in str(out[1])


def test_handshake_refuses_a_peer_of_version_1_before_rows_of_two_sizes_meet():
    """A peer of the handshake's version 1 (an mxport before the bucket size left the plan) sends its hello,
    then a digest row of 5 words ([digest, version], no bucket size): it is refused by its hello on both
    ends, before the 6-word rows of this version meet its row in one all_gather (gloo then reads past what a
    rank posted)."""
    from mxport.refit import RefitError
    from mxport.refit.handshake import exchange_plans

    plan = RefitPlan(_items([((40,), torch.float32)]))
    v1 = 0x4D58524654485301  # "MXRFTHS", version 1

    def old_peer(ep):
        words = [int(w) for w in ep.all_gather(torch.tensor([v1], dtype=torch.int64))]
        if any(w != v1 for w in words):
            raise RefitError("stranger")
        return ep.all_gather(torch.zeros(5, dtype=torch.int64))

    for new_end, old_end in ((0, 1), (1, 0)):
        fns = [None, None]
        fns[new_end], fns[old_end] = (lambda ep: exchange_plans(ep, plan, 0, 64)), old_peer
        out = _both(*fns)
        assert isinstance(out[new_end], RefitError), out[new_end]
        assert f"rank {old_end} does not speak the mxport refit handshake (it sent {v1:#x}" in str(
            out[new_end])
        assert isinstance(out[old_end], RefitError)


def test_share_plan_gives_receivers_the_senders_plan():
    from mxport.refit.handshake import share_plan

    plan = RefitPlan(_items([((4, 3), torch.bfloat16), ((3,), torch.uint8)]))
    out = _both(lambda ep: share_plan(ep, plan), share_plan)
    assert out[0] is plan and out[1].digest == plan.digest


@pytest.mark.parametrize("bad", ["none", "np", "meta", "strided"])
def test_a_bad_item_aborts_in_process_and_the_sender_reports_every_receiver(bad):
    """Each bad item is refused before packing, the receivers get the abort trailer, keep their weights, and
    the next refit succeeds; a successful send lists every receiver's result."""
    import numpy as np

    plan = RefitPlan(_items([((8, 4), torch.float32), ((6,), torch.uint8)]))
    good = [torch.full((8, 4), 2.0), torch.arange(6, dtype=torch.uint8)]
    item = {"none": None, "np": np.zeros((8, 4), dtype=np.float32), "meta": torch.empty(8, 4, device="meta"),
            "strided": torch.zeros(4, 8).t()}[bad]
    targets = [torch.zeros(8, 4), torch.zeros(6, dtype=torch.uint8)]
    sent, got, _ = _refit_in_process(plan, [[item, good[1]], good], targets)
    assert isinstance(sent[0], (TypeError, ValueError)) and "'t0'" in str(sent[0])
    assert isinstance(got[0], RefitError) and "the sender aborted refit v1 at tensor 't0'" in str(got[0])
    assert got[0].status == Status.ABORTED and got[1]["version"] == 2
    assert sent[1]["receivers"] == [{"rank": 1, "status": "ok", "bucket": -1, "entry": -1, "version": 2}]
    assert torch.equal(targets[0], good[0]) and torch.equal(targets[1], good[1])


def test_demo_replies_cross_the_wire_exactly_and_out_of_range_ones_are_refused():
    """The demo's per-step replies travel as fixed-size tensors (no pickle): numbers exact (a CRC-32 near
    2**32 included), the sequence and log-probs cut back to their length; a reply with a token id outside
    the vocab is refused."""
    from mxport.demo.single import _gather_replies, _Reply, _ReplyShape

    shape = _ReplyShape(prompt_len=3, max_new=4, vocab=10)
    seq = torch.tensor([[1, 2, 3, 9, 0]])
    logits = torch.randn(2, 10)
    mine = _Reply(rank=1, version=7, seconds=0.25, recv_s=0.125, commit_s=0.0625, bit_exact=True,
                  live_crc32=2**32 - 5, pointers_stable=False, gen_s=1.5, prompt_len=3, seq=seq,
                  logits=logits)
    out = _both(lambda ep: _gather_replies(ep, shape, None), lambda ep: _gather_replies(ep, shape, mine))
    got = out[0][1]
    assert got.live_crc32 == 2**32 - 5 and got.version == 7 and got.rank == 1 and got.prompt_len == 3
    assert got.bit_exact is True and got.pointers_stable is False and got.seconds == 0.25
    assert torch.equal(got.seq, seq) and torch.equal(got.logits, logits)
    bad = _Reply(**{**mine.__dict__, "seq": torch.tensor([[1, 2, 3, 10]]), "logits": logits[:1]})
    out = _both(lambda ep: _gather_replies(ep, shape, None), lambda ep: _gather_replies(ep, shape, bad))
    assert isinstance(out[0], RuntimeError) and "out of range" in str(out[0])


def test_from_group_refits_over_a_group_torch_distributed_does_not_know():
    """``TorchDistTransport.from_group`` on a ``ProcessGroupGloo`` built on its own store (as engines
    make them, outside torch.distributed's registry): handshake, a refit, and the receivers' reports
    all go through it."""
    import datetime

    import torch.distributed as dist

    from mxport.refit import TorchDistTransport

    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=20)
    plan = RefitPlan(_items([((40,), torch.float32), ((8, 4), torch.bfloat16)]))
    sent = [torch.arange(40, dtype=torch.float32), torch.full((8, 4), 1.5, dtype=torch.bfloat16)]
    targets = [torch.zeros(40), torch.zeros(8, 4, dtype=torch.bfloat16)]
    out = [None, None]

    def run(rank):
        try:
            tr = TorchDistTransport.from_group(dist.ProcessGroupGloo(store, rank, 2, timeout))
            assert (tr.rank, tr.world_size, tr.device.type) == (rank, 2, "cpu")
            end = (RefitSender(tr, plan, bucket_bytes=64) if rank == 0
                   else RefitReceiver(tr, plan, targets, bucket_bytes=64))
            out[rank] = end.send(sent) if rank == 0 else end.receive()
            tr.close()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[rank] = exc

    ths = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=60)
    assert out[1]["version"] == 1 and out[0]["receivers"][0]["status"] == "ok", out
    assert all(torch.equal(byte_view(t), byte_view(s)) for t, s in zip(targets, sent, strict=True))


def test_trainer_sends_megatron_mxfp8_attributes_as_they_are():
    """After Megatron-LM's quantize_params_to_mxfp8 a weight is a plain module attribute (an MXFP8Tensor, not
    a parameter): the trainer's plan still holds it (values + scales in its own element format, exported as
    is), and a refit lands its bytes; before, it was invisible and left out of the refit."""
    from test_sources_megatron import megatron_tensor

    import mxport

    torch.manual_seed(3)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(64, 32, bias=False)
    model.norm = torch.nn.Parameter(torch.randn(16))
    mt, _ = megatron_tensor(torch.randn(32, 64), backend="triton")
    del model.lin._parameters["weight"]
    model.lin.weight = mt
    src = TrainerSource(model, arena=True)
    assert [(e.name, e.role) for e in src.plan.entries] == [  # canonical order: the root module's first
        ("norm", "kept"), ("lin.weight", "values"), ("lin.weight_scale", "scales")]
    want = mxport.export_components(mt)
    targets = allocate_targets(src.plan)
    sent, got, _ = _refit_in_process(src.plan, [src.tensors()], targets, bucket_bytes=256)
    assert not isinstance(got[0], Exception), got[0]
    assert torch.equal(targets[0], model.norm.detach())
    assert torch.equal(byte_view(targets[1]), byte_view(want.data.contiguous()))
    assert torch.equal(targets[2], want.scale_inv)


_EXIT_WHILE_BACKUP_RUNS = """
import sys, time, torch
from mxport.refit.arena import RollbackCopy

arena = torch.zeros(1 << 16, dtype=torch.uint8)
backup = RollbackCopy.of_arena(arena, [arena])
run = backup._run

def slow():
    time.sleep(0.5)
    run()
    open(sys.argv[1], "w").write(str(int(torch.equal(backup.copy, arena))))

backup._run = slow
arena.fill_(7)
backup.start()  # the interpreter exits while the copy is still running
"""


def test_interpreter_exit_waits_for_the_rollback_copy(tmp_path):
    """A process that ends right after a refit (the guide's in-process examples) must not tear down the
    interpreter under the background rollback copy: that aborted (SIGABRT) about one run in ten. Exit now
    waits for the copy, which completes."""
    import subprocess
    import sys

    marker = tmp_path / "done"
    script = tmp_path / "exit_early.py"
    script.write_text(_EXIT_WHILE_BACKUP_RUNS)
    proc = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.read_text() == "1"  # the copy ran to the end and holds what was live


@pytest.mark.parametrize("eager", [True, False])
def test_ctrl_c_while_a_bucket_lands_leaves_the_previous_version(eager):
    """A BaseException (Ctrl-C) raised while bucket 1 of 2 lands: eager mode had written bucket 0 into the
    live tensors and kept it (only Exceptions rolled back); now the live tensors are restored and the
    KeyboardInterrupt goes on, as in staging mode."""
    from mxport.testing import FaultyReceiverTransport

    plan = RefitPlan(_items([((16,), torch.float32), ((16,), torch.float32)]))
    targets = [torch.zeros(16), torch.zeros(16)]
    ch = InProcessChannel(1, timeout_s=2)
    receiver = RefitReceiver(ch.endpoint(1), plan, targets, bucket_bytes=64, eager=eager, inflight=1)
    stream = receiver.streams[0]

    def interrupt(refit, b, buf):
        if b == 1:
            raise KeyboardInterrupt

    stream.transport = FaultyReceiverTransport(stream.transport, stream.layout.num_buckets, interrupt)
    out = []

    def rx():
        try:
            out.append(receiver.receive())
        except BaseException as exc:  # noqa: BLE001 - the test looks at what receive raised
            out.append(exc)

    th = threading.Thread(target=rx)
    th.start()
    with pytest.raises(Exception):  # noqa: B017, PT011 - the receiver stopped answering
        RefitSender(ch.endpoint(0), plan, bucket_bytes=64).send([torch.ones(16), torch.ones(16)])
    th.join(10)
    assert isinstance(out[0], KeyboardInterrupt) and stream.eager is eager
    assert all(torch.equal(t, torch.zeros(16)) for t in targets)


def test_an_abort_at_a_zero_byte_last_tensor_names_the_last_bucket():
    """A zero-byte tensor at the stream's end sits at offset == total bytes: its bucket was one past the last
    (IndexError instead of RefitError when the sender aborted there)."""
    plan = RefitPlan(_items([((16,), torch.float32), ((0,), torch.float32)]))
    targets = [torch.zeros(16), torch.zeros(0)]
    bad = [torch.ones(16), torch.zeros(0, dtype=torch.float16)]  # the wrong dtype: the sender aborts
    sent, got, _ = _refit_in_process(plan, [bad], targets, receiver_kw={"eager": True})
    assert isinstance(sent[0], ValueError) and isinstance(got[0], RefitError)
    assert got[0].bucket == 0 and "aborted" in str(got[0]) and torch.equal(targets[0], torch.zeros(16))
