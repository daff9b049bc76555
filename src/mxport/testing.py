"""Test helpers: tiny random models (saved with ``save_pretrained`` into a folder, nothing downloaded) and a
refit transport wrapper that injects faults on the wire (:class:`FaultyTransport`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .refit.transport import Transport


def _save(model, path: Path, dtype: torch.dtype, max_shard_size: str | None) -> Path:
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return path


def make_tiny_llama(path: str | os.PathLike, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                    intermediate: int = 96, vocab: int = 256, heads: int = 4, kv_heads: int = 2,
                    tie_word_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16,
                    max_shard_size: str | None = None, with_tokenizer: bool = True,
                    max_positions: int = 256) -> Path:
    """Write a random Llama-architecture causal LM (``LlamaForCausalLM``) to ``path`` and return ``path``.

    Shapes: q/o [hidden, hidden], k/v [hidden*kv_heads/heads, hidden], gate/up [intermediate, hidden],
    down [hidden, intermediate]. ``max_shard_size`` (e.g. "50KB") writes several shards with an index. With
    ``with_tokenizer`` a small byte-level tokenizer (vocab 256 + specials) is saved too. ``max_positions``:
    the context length (``max_position_embeddings``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie_word_embeddings,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    _save(model, path, dtype, max_shard_size)
    if with_tokenizer:
        save_byte_tokenizer(path, vocab)
    return path


def make_tiny_mixtral(path: str | os.PathLike, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                      intermediate: int = 96, experts: int = 4, vocab: int = 256, fused_experts: bool = False,
                      dtype: torch.dtype = torch.bfloat16, with_tokenizer: bool = True) -> Path:
    """Write a random Mixtral-architecture MoE model to ``path``.

    ``save_pretrained`` stores per-expert 2-D weights (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``) and
    the router ``block_sparse_moe.gate.weight``. With ``fused_experts=True`` the state dict is written as the
    module holds it: 3-D ``mlp.experts.gate_up_proj`` [E, 2*intermediate, hidden] and
    ``mlp.experts.down_proj`` [E, hidden, intermediate] (the [E, N, K] layout of fused-expert checkpoints),
    router ``mlp.gate.weight``.
    """
    from safetensors.torch import save_file
    from transformers import MixtralConfig, MixtralForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=256,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = MixtralForCausalLM(cfg)
    if fused_experts:
        path.mkdir(parents=True, exist_ok=True)
        model.to(dtype)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg_dict = {**model.config.to_dict(), "architectures": ["MixtralForCausalLM"]}  # as save_pretrained
        (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
    else:
        _save(model, path, dtype, None)
    if with_tokenizer:
        save_byte_tokenizer(path, vocab)
    return path


def save_byte_tokenizer(path: str | os.PathLike, vocab: int = 256) -> None:
    """Save a tiny word-level ``PreTrainedTokenizerFast`` over printable bytes (ids < ``vocab``) with a chat
    template, so that generation code paths run on tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)]
    vocab_map = {tok: i for i, tok in enumerate(specials + chars) if i < vocab}
    tk = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(path))


class _WrappedTransport(Transport):
    """A transport endpoint passing everything through to ``inner``; the faulty wrappers below build on it.
    ``_next()`` counts this endpoint's broadcasts: ``(refit, bucket)``, refits from 1, the trailer as bucket
    ``buckets``."""

    def __init__(self, inner, buckets: int, fault):
        self.inner, self.buckets, self.fault = inner, buckets, fault
        self.rank, self.world_size, self.src = inner.rank, inner.world_size, inner.src
        self.ranks = getattr(inner, "ranks", None)
        self._count = 0

    def _next(self) -> tuple[int, int]:
        refit, bucket = divmod(self._count, self.buckets + 1)
        self._count += 1
        return refit + 1, bucket

    @property
    def device(self):
        return self.inner.device

    def all_gather(self, t):
        return self.inner.all_gather(t)

    def broadcast(self, buf, async_op: bool = False):
        return self.inner.broadcast(buf, async_op)

    def close(self) -> None:
        self.inner.close()


class FaultyTransport(_WrappedTransport):
    """A refit transport wrapper that tampers with what the sender puts on the wire, for tests: each outgoing
    broadcast is handed to ``fault(refit, bucket, wire)`` as a *copy* of the bytes (the sender's own memory
    and its checksums stay untouched, as on a real faulty link); ``fault`` may change ``wire`` in place, or
    stop the process. ``refit`` counts refits through this transport from 1; ``bucket`` is the bucket index,
    ``buckets`` (the stream's ``layout.num_buckets``) for the trailer. Everything else passes through to
    ``inner``.
    """

    def broadcast(self, buf, async_op: bool = False):
        if self.is_sender:
            refit, bucket = self._next()
            buf = buf.clone()
            self.fault(refit, bucket, buf)
        return self.inner.broadcast(buf, async_op)


def make_tiny_qwen2(path: str | os.PathLike, *, seed: int = 0, hidden: int = 128, layers: int = 2,
                    intermediate: int = 256, vocab: int = 256, heads: int = 2, kv_heads: int = 1,
                    dtype: torch.dtype = torch.bfloat16, with_tokenizer: bool = True) -> Path:
    """Write a random Qwen2 causal LM (``Qwen2ForCausalLM``: q / k / v projections with biases) to ``path``
    with ``save_pretrained``; shapes as :func:`make_tiny_llama`'s."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # nonzero biases, so that a refit that skipped them would show
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    _save(model, path, dtype, None)
    if with_tokenizer:
        save_byte_tokenizer(path, vocab)
    return path


def make_tiny_qwen3_moe(path: str | os.PathLike, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                        moe_intermediate: int = 48, experts: int = 4, vocab: int = 256,
                        dtype: torch.dtype = torch.bfloat16, with_tokenizer: bool = True) -> Path:
    """Write a random Qwen3-MoE causal LM (``Qwen3MoeForCausalLM``) to ``path`` with ``save_pretrained``.

    In memory (transformers 5.x) each layer's ``mlp.experts`` holds fused 3-D ``gate_up_proj``
    [E, 2*moe_intermediate, hidden] and ``down_proj`` [E, hidden, moe_intermediate]; router
    ``mlp.gate.weight``.
    The default ``moe_intermediate`` 48 makes the down projection's K a partial block (48 = 32 + 16).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         moe_intermediate_size=moe_intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=experts,
                         num_experts_per_tok=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    _save(Qwen3MoeForCausalLM(cfg), path, dtype, None)
    if with_tokenizer:
        save_byte_tokenizer(path, vocab)
    return path


class _AfterWait:
    """A broadcast handle that runs ``after()`` once, right after the inner handle's ``wait()`` returns."""

    def __init__(self, work, after):
        self.work, self.after, self.done = work, after, False

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as torch Work.wait
        self.work.wait()
        if not self.done:
            self.done = True
            self.after()
        return True


class FaultyReceiverTransport(_WrappedTransport):
    """A receiving endpoint wrapper that tampers with what *this* receiver receives, for tests (other
    receivers get the sender's bytes untouched): once each broadcast has landed (its handle's ``wait()``
    returned), ``fault(refit, bucket, buf)`` gets the receiving buffer itself — staging, or the live arena in
    direct mode — and may change it in place, or stop the process (``os._exit``: a receiver dying mid-refit).
    ``refit`` counts refits through this endpoint from 1; ``bucket`` is the bucket index, ``buckets`` (the
    stream's ``layout.num_buckets``) for the trailer. Every broadcast counts: wrap after any ``share_plan``.
    Everything else passes through to ``inner``.
    """

    def __init__(self, inner, buckets: int, fault):
        if inner.rank == inner.src:
            raise ValueError("FaultyReceiverTransport wraps a receiving endpoint (use FaultyTransport for "
                             "the sender)")
        super().__init__(inner, buckets, fault)

    def broadcast(self, buf, async_op: bool = False):
        refit, bucket = self._next()
        handle = _AfterWait(self.inner.broadcast(buf, async_op=True), lambda: self.fault(refit, bucket, buf))
        if async_op:
            return handle
        handle.wait()
        return None


def child_entry(fn, args, q, tag, watchdog_s: float | None = None) -> None:
    """A spawned test process's body: ``q.put((tag, "ok", fn(*args)))`` (or ``(tag, "error", traceback)``),
    then exit at once, without the interpreter's teardown: gloo's process groups, destroyed there, aborted a
    process now and then ("terminate called without an active exception", exit code -6) after a run whose
    every step had passed. ``watchdog_s``: a stuck child dumps its threads and exits after that long."""
    import faulthandler
    import traceback

    if watchdog_s:
        faulthandler.dump_traceback_later(watchdog_s, exit=True)
    try:
        q.put((tag, "ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put((tag, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    q.close()
    q.join_thread()
    os._exit(0)


def _world_entry(fn, rank: int, init: str, q) -> None:
    child_entry(fn, (rank, init), q, rank)


def spawn_world(fn, world: int, store_dir: str | os.PathLike, *, wait_s: float = 120.0,
                env: dict[str, str] | None = None) -> dict[int, object]:
    """Run ``fn(rank, init)`` in ``world`` spawned processes and return their results by rank; ``init`` is a
    ``file://`` init method under ``store_dir`` for ``torch.distributed.init_process_group``. ``fn`` must be
    importable (a module-level function) and its result picklable (it comes back on a multiprocessing queue
    from processes the caller started). ``env`` is set in the children (OMP_NUM_THREADS=1 by default).

    Raises:
        RuntimeError: a rank raised (its traceback in the message), or no result within ``wait_s`` seconds.
    """
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{Path(store_dir).resolve()}/store"
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    procs = [ctx.Process(target=_world_entry, args=(fn, r, init, q), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        while len(results) < world:
            try:
                rank, status, val = q.get(timeout=wait_s)
            except queue.Empty:
                missing = set(range(world)) - set(results)
                raise RuntimeError(f"timed out waiting for ranks {missing}") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed: {val}")
            results[rank] = val
        return results
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def flip_live_byte(worker, param: str) -> None:
    """``collective_rpc`` target for tests: flip the low bit of the first byte of parameter ``param`` of a
    vLLM worker's model (a live weight altered behind the refit's back)."""
    p = worker.weight_transfer_engine.model.get_parameter(param)
    p.data.view(-1)[:1].view(torch.uint8).bitwise_xor_(1)
