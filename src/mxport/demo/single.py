"""The processes of ``mxport refit``: one trainer and R inference processes on loopback gloo.

The trainer keeps float32 master weights, takes a real AdamW step on a text batch, quantizes with the
precision policy and sends the refit (kept tensors cast to BF16); each inference process (a model loaded in
BF16, as engines run it, and converted once with :func:`mxport.nn.quantize_model`: MXFP8 linears, BF16
embeddings and norms) receives in place, checks its bytes and pointers, generates a few tokens
greedily and returns its log-probs; the trainer computes ``gen_kl_error`` against its own log-probs on the
same tokens. Results stream to the parent through a pipe per process (one message per step), so the parent
can show progress and write JSON.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .procs import free_port, redirect_output, spawn_and_collect
from .report import StepReport
from .words import Words

#: the dtype the inference processes hold kept tensors (embeddings, norms) in and compute in, as engines do;
#: the trainer sends kept tensors in it (2 bytes per element)
ENGINE_DTYPE = torch.bfloat16

#: runs of at least this many steps use the torch.compile'd quantize kernel
COMPILE_MIN_STEPS = 10

@dataclass(frozen=True)
class DemoConfig:
    """Settings of one ``mxport refit`` run (see the CLI for meanings)."""

    source: str  # resolved model directory
    steps: int = 3
    bucket_bytes: int = 64 << 20
    receivers: int = 1
    max_new_tokens: int = 16
    lr: float = 1e-5
    delta: bool = False  # refit only what changed since the engines' version
    quant: str = "mxfp8"  # the weights' format on the wire and in the engines (mxport.quants)
    timeout_s: float = 120.0
    seq_len: int = 64
    log_dir: str | None = None  # per-process stdout/stderr logs (rank<i>.log); None = inherit the terminal


def _threads(world: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


@torch.no_grad()
def logits_on(model, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """float32 logits [T, V] predicting the tokens after the prompt."""
    logits = model(seq).logits[0].float()
    return logits[prompt_len - 1:seq.shape[1] - 1]


def trainer_kernel(steps: int) -> str | None:
    """The trainer's quantize kernel.

    Where the native CPU kernel is unavailable, compiling the fast kernel costs 6-30 s of CPU and saves ~0.8 s
    per step on the embedded model: runs under :data:`COMPILE_MIN_STEPS` steps stay eager, longer ones let
    quantize choose (the bytes are identical)."""
    from ..quantize import NATIVE_PATH

    return None if steps >= COMPILE_MIN_STEPS or NATIVE_PATH.available else "eager"


def _trainer(cfg: DemoConfig, transport, q) -> None:
    from ..models import load_causal_lm
    from ..refit.sender import RefitSender
    from ..refit.trainer import TrainerSource

    model, tok = load_causal_lm(cfg.source, dtype=torch.float32, require_tokenizer=False)
    words = Words.of(model, tok)
    source = TrainerSource(model, arena=True,  # quantize into the send buffer
                           kernel=trainer_kernel(cfg.steps), kept_dtype=ENGINE_DTYPE, quant=cfg.quant)
    sender = RefitSender(transport, source.plan, bucket_bytes=cfg.bucket_bytes, delta=cfg.delta)
    sender.handshake()
    layout = sender.layout
    mxfp8 = source.plan if cfg.quant == "mxfp8" else TrainerSource(model, kept_dtype=ENGINE_DTYPE).plan
    q.put(("plan", 0, {**source.plan.summary(), "buckets": layout.num_buckets, "quant": cfg.quant,
                       "bucket_bytes": layout.bucket_bytes, "mxfp8_bytes": mxfp8.total_bytes}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    batch = words.batch(cfg.seq_len)
    shape = _ReplyShape(int(words.prompt().shape[1]), cfg.max_new_tokens, _vocab(model))
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["input_ids"])
        out.loss.backward()
        loss = float(out.loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t0
        stats = sender.send(source.tensors(), checksums=source.stream_checksum)  # summed by the quantize
        sent_crc32 = source.stream_crc32()  # what was sent, for the bit-exactness check (outside the refit)
        replies = _gather_replies(transport, shape, None)[1:]
        rows = [_receiver_row(model, words, r, sent_crc32) for r in replies]
        q.put(("step", 0, _report(step, loss, train_s, stats, rows, _delta_figures(sender, stats)
                                  if cfg.delta else {}).to_dict()))


def _delta_figures(sender, stats) -> dict:
    """A delta refit's figures: the full stream's bytes beside the ``bytes`` sent, whether it went out as a
    delta, and the fraction of blocks (MXFP8, or the 4-bit format's) whose bytes changed (null: no base to
    compare: the first refit)."""
    from ..refit.stream.delta import streams_block_counts

    hit, total = streams_block_counts(sender.streams)
    return {"full_bytes": stats.bytes, "delta": stats.delta,
            "blocks_changed": hit / total if stats.changed_words >= 0 and total else None,
            "changed_words": stats.changed_words if stats.changed_words >= 0 else None,
            "delta_s": stats.delta_s, "full_for": list(stats.full_for)}


@dataclass(frozen=True)
class _ReceiverNumbers:
    """What an inference process measures of a step: its refit's stats, its checks, its generation."""

    rank: int
    version: int
    seconds: float
    recv_s: float
    commit_s: float
    bit_exact: bool
    live_crc32: int
    pointers_stable: bool
    gen_s: float
    prompt_len: int


@dataclass(frozen=True)
class ReceiverRow(_ReceiverNumbers):
    """One inference process's part of a step row (JSON: ``steps[i].receivers[j]``)."""

    text: str
    gen_kl_error: float
    gen_kl_error_max: float
    greedy_agreement: float

    def to_dict(self) -> dict:
        return asdict(self)


def _report(step: int, loss: float, train_s: float, stats, rows: list[ReceiverRow],
            extra: dict) -> StepReport:
    """One training step and its refit as every engine reports it: end to end (quantize + pack + transfer up
    to every receiver's vote), the worst receiver's gen_kl_error, bit-exact and pointers stable on every
    receiver; then the time split and the per-receiver rows."""
    recv = [r.to_dict() for r in rows]
    return StepReport(
        step=step, bytes=stats.wire_bytes, seconds=stats.seconds, gbps=stats.wire_bytes / stats.seconds / 1e9,
        gen_kl_error=max(r["gen_kl_error"] for r in recv), bit_exact=all(r["bit_exact"] for r in recv),
        pointers_stable=all(r["pointers_stable"] for r in recv),
        details={"version": stats.version, "loss": loss, "buckets": stats.buckets, "train_s": train_s,
                 "quantize_s": stats.produce_s, "pack_s": stats.pack_s, "checksum_s": stats.checksum_s,
                 "send_s": stats.seconds, "commit_s": max(r["commit_s"] for r in recv),
                 "greedy_agreement": min(r["greedy_agreement"] for r in recv), **extra, "receivers": recv})


@dataclass(frozen=True)
class _Reply(_ReceiverNumbers):
    """What an inference process reports after a step (crosses the wire as fixed-size tensors, see
    :func:`_gather_replies`)."""

    seq: torch.Tensor  # [1, prompt + generated] token ids
    logits: torch.Tensor  # [generated, vocab] float32


#: the numbers of a :class:`_Reply`, in wire order (one float64 row), then the sequence length
_REPLY_NUMBERS = tuple(_ReceiverNumbers.__dataclass_fields__)
_INTS = ("rank", "version", "live_crc32", "prompt_len")
_BOOLS = ("bit_exact", "pointers_stable")


def _receiver_row(model, words: Words, r: _Reply, sent_crc32: int) -> ReceiverRow:
    """The trainer's view of a reply: its generation scored against the trainer's own logits."""
    from ..metrics import gen_kl_error, greedy_agreement

    logits_train = logits_on(model, r.seq, r.prompt_len)
    kl = gen_kl_error(r.logits, logits_train)
    numbers = {k: getattr(r, k) for k in _REPLY_NUMBERS}
    return ReceiverRow(
        **{**numbers, "bit_exact": bool(r.bit_exact and r.live_crc32 == sent_crc32)},
        text=words.decode(r.seq[0, r.prompt_len:]), gen_kl_error=kl["mean"],
        gen_kl_error_max=kl["max"], greedy_agreement=greedy_agreement(r.logits, logits_train))


@dataclass(frozen=True)
class _ReplyShape:
    """Sizes of one reply, known to every process: the prompt, at most ``max_new`` generated tokens, the
    vocab."""

    prompt_len: int
    max_new: int
    vocab: int


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _gather_replies(transport, shape: _ReplyShape, mine: _Reply | None) -> list[_Reply | None]:
    """Every process's reply (``mine``: this process's, None on the trainer) through fixed-size tensors: a
    float64 row of :data:`_REPLY_NUMBERS` and the sequence length, the token ids padded to ``prompt_len +
    max_new``, the log-probs padded to ``[max_new, vocab]``. Nothing is unpickled; a reply whose sizes or
    token ids are out of range is refused."""
    n_seq = shape.prompt_len + shape.max_new
    row = torch.zeros(len(_REPLY_NUMBERS) + 1, dtype=torch.float64)
    seq = torch.zeros(n_seq, dtype=torch.int64)
    logits = torch.zeros(shape.max_new, shape.vocab, dtype=torch.float32)
    if mine is not None:
        row[:] = torch.tensor([float(getattr(mine, k)) for k in _REPLY_NUMBERS] + [mine.seq.shape[1]],
                              dtype=torch.float64)  # exact for every int below 2**53 (the CRC-32 too)
        seq[:mine.seq.shape[1]] = mine.seq[0]
        logits[:mine.logits.shape[0]] = mine.logits
    rows, seqs, logs = (transport.all_gather(t) for t in (row, seq, logits))
    out: list[_Reply | None] = [None]
    for r in range(1, len(rows)):
        *vals, n = rows[r].tolist()
        n = int(n)
        if not shape.prompt_len < n <= n_seq or not bool(((seqs[r] >= 0) & (seqs[r] < shape.vocab)).all()):
            raise RuntimeError(f"inference process {r} sent a reply out of range ({n} tokens)")
        fields = {k: int(v) if k in _INTS else bool(v) if k in _BOOLS else v
                  for k, v in zip(_REPLY_NUMBERS, vals, strict=True)}
        out.append(_Reply(**fields, seq=seqs[r][:n].view(1, n), logits=logs[r][:n - shape.prompt_len]))
    return out


def _inference(cfg: DemoConfig, transport, q, rank: int) -> None:
    from ..models import load_causal_lm
    from ..nn import quantize_model
    from ..refit.engine import receiver_plan
    from ..refit.receiver import RefitReceiver

    # kept tensors in BF16, as engines run
    model, tok = load_causal_lm(cfg.source, dtype=ENGINE_DTYPE, require_tokenizer=False)
    words = Words.of(model, tok)
    if cfg.quant == "mxfp8":
        quantize_model(model)
    else:  # FP4Linear layers holding the 4-bit bytes
        from ..fp4_linear import quantize_model_fp4

        quantize_model_fp4(model, cfg.quant)
    plan, targets = receiver_plan(model, arena=True)  # weights in one arena: direct receive
    receiver = RefitReceiver(transport, plan, targets, bucket_bytes=cfg.bucket_bytes, delta=cfg.delta)
    ptrs0 = [t.data_ptr() for t in targets]
    receiver.handshake()
    prompt = words.prompt()
    for _step in range(1, cfg.steps + 1):
        stats = receiver.receive()
        bit_exact = receiver.verify_live()  # per-bucket checksums of the re-packed live bytes
        live_crc = receiver.live_crc32()  # the trainer compares it with the CRC-32 of what it sent
        # the model's own tensors (looked up again, not the receiver's references) still sit where they were
        stable = (receiver.pointers_stable()
                  and [t.data_ptr() for t in receiver_plan(model)[1]] == ptrs0)
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                 **words.generate_kwargs(model))
        logits = logits_on(model, seq, prompt.shape[1])
        gen_s = time.perf_counter() - t0
        shape = _ReplyShape(int(prompt.shape[1]), cfg.max_new_tokens, _vocab(model))
        _gather_replies(transport, shape, _Reply(
            rank=rank, version=stats.version, seconds=stats.seconds, recv_s=stats.recv_s,
            commit_s=stats.commit_s, bit_exact=bit_exact, live_crc32=live_crc, pointers_stable=stable,
            gen_s=gen_s, prompt_len=int(prompt.shape[1]), seq=seq, logits=logits))


def worker(rank: int, world: int, port: int, cfg_dict: dict, q) -> None:
    """Entry point of one spawned process: rank 0 trains and sends, ranks >= 1 receive and generate."""
    from .._env import quiet_third_party_logs
    from ..refit.transport import TorchDistTransport

    quiet_third_party_logs()
    cfg = DemoConfig(**cfg_dict)
    redirect_output(cfg.log_dir, rank)
    transport = None
    try:
        _threads(world)
        transport = TorchDistTransport.init(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                            backend="gloo", timeout_s=cfg.timeout_s)
        if rank == 0:
            _trainer(cfg, transport, q)
        else:
            _inference(cfg, transport, q, rank)
        q.put(("done", rank, None))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent, then exit non-zero
        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))
        raise SystemExit(1) from None
    finally:
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001
                pass


def run_demo(cfg: DemoConfig, on_event: Callable[[str, int, object], None] | None = None,
             timeout_s: float = 1800.0) -> dict:
    """Start the trainer and ``cfg.receivers`` inference processes, collect their messages, and return
    ``{"plan": {...}, "steps": [...]}``. ``on_event(kind, rank, payload)`` sees every message ("plan", "step",
    "done"). Raises DemoFailed when a process reports an error or dies, or after ``timeout_s``; the remaining
    processes are terminated."""
    return spawn_and_collect(worker, cfg.receivers + 1, (free_port(), asdict(cfg)), on_event, timeout_s)


