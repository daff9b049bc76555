"""The processes of a sharded ``mxport refit``: ``T`` trainer ranks and ``E`` engine ranks on loopback gloo.

Trainer ranks (``--trainer fsdp=N | tp=N | pp=N | ep=N``) share a process group of their own, as trainers
do: ``fsdp`` shards every parameter with FSDP2 ``fully_shard``; ``tp`` applies tensor parallelism with
``parallelize_module`` (column-parallel q/k/v and gate/up, row-parallel o and down; attention stays
replicated when the head counts do not divide, MLPs when
``intermediate_size`` does not); both take real AdamW steps on their DTensors. ``pp`` and
``ep`` ranks each train a full replica (same seed, same batch: the same weights) and hand the refit only
what their stage or their experts hold, through held names (:class:`~mxport.refit.trainer.HeldTensorsSource`),
as pipeline and expert-parallel exporters do; the pipeline schedule itself is not simulated.

Engine ranks (``--engine tp=N``, ``ep=N``) hold only their own shard of each tensor
(:func:`~mxport.refit.engine.engine_holdings`, q/k/v and gate/up in merged buffers as vLLM holds them).
All ranks meet in a separate refit group (:func:`~mxport.refit.transport.open_group`), agree on the global
plan (:func:`~mxport.refit.mesh.agree`) and refit shard to shard (:class:`~mxport.refit.RefitSender`
/ :class:`~mxport.refit.RefitReceiver`: one vote, all engine ranks commit or none).

Checks per step, outside the refit: every rank reports a CRC-32 of its shard bytes; trainer rank 0 gathers
the full trainer weights (``full_tensor()``), quantizes them whole and cuts every engine rank's boxes out of
that: a step is ``bit_exact`` only if every engine rank's bytes equal those (and every trainer rank's
quantized shard). For ``gen_kl_error`` engine rank 0 assembles the engine ranks' shards into a full MXFP8
model and generates; trainer rank 0 scores it against its float32 weights.
"""

from __future__ import annotations

import os
import time
import traceback
import zlib
from dataclasses import asdict, dataclass

import torch

from ..refit.mesh import Holding, agree, local_items, local_part
from .procs import free_port, spawn_and_collect
from .report import StepReport
from .single import ENGINE_DTYPE, logits_on, trainer_kernel
from .words import Words

#: point-to-point tags on the refit group for the checks (the refit's pair streams use their own)
_TAG_SHARDS, _TAG_REPLY = 901, 902
_ROW = ("rank", "version", "crc32", "pointers_stable", "bytes", "seconds_us", "full_bytes", "delta",
        "blocks_hit", "blocks_total")


@dataclass(frozen=True)
class MeshConfig:
    """Settings of one sharded ``mxport refit`` run."""

    source: str
    trainer: str = "fsdp=2"
    engine: str = "tp=1"
    steps: int = 3
    bucket_bytes: int = 32 << 20
    max_new_tokens: int = 16
    lr: float = 1e-5
    delta: bool = False  # refit only what changed since the engines' version
    timeout_s: float = 120.0
    seq_len: int = 64
    log_dir: str | None = None


def _layouts(cfg: MeshConfig):
    from ..parallel import Layout, parse_engine

    return Layout.parse(cfg.trainer), parse_engine(cfg.engine)[1]


# -- trainer ranks -------------------------------------------------------------------------------------------
def _shard_trainer(model, layout, rank: int, kernel: str | None):
    """Apply the trainer layout to ``model`` (in its own default group); returns the source of its shards
    (quantizing with ``kernel``)."""
    from ..refit.trainer import HeldTensorsSource, ShardedTrainerSource

    if layout.fsdp > 1 or layout.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (layout.ranks,))
        if layout.fsdp > 1:
            from torch.distributed.fsdp import fully_shard

            for block in model.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh, _tp_plan(model, layout.tp))
        return ShardedTrainerSource(model, kept_dtype=ENGINE_DTYPE, kernel=kernel)
    return HeldTensorsSource(lambda: _held_items(model, layout, rank),
                             names_and_shapes=_names_and_shapes(model), kept_dtype=ENGINE_DTYPE,
                             kernel=kernel)


def _tp_plan(model, tp: int) -> dict:
    """vLLM-like tensor parallelism: MLPs when their intermediate size divides by ``tp``, attention when its
    head counts do (uneven DTensor shards fail in the forward); the rest stays replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cfg = model.config
    attention = cfg.num_attention_heads % tp == 0 and (cfg.num_key_value_heads or 1) % tp == 0
    plan = {}
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        if attention:
            plan.update({p + f"self_attn.{x}_proj": ColwiseParallel() for x in "qkv"})
            plan[p + "self_attn.o_proj"] = RowwiseParallel()
        if hasattr(block.mlp, "gate_proj") and cfg.intermediate_size % tp == 0:  # else replicated
            plan.update({p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                         p + "mlp.down_proj": RowwiseParallel()})
    return plan


def _full_items(model):
    from ..refit.items import model_tensors

    return model_tensors(model)


def _names_and_shapes(model):
    return [(n, tuple(t.shape), t.dtype) for n, t in _full_items(model)]


def _held_items(model, layout, rank: int):
    """What pipeline stage / expert-parallel rank ``rank`` holds, as ``(hf_name, tensor[, dim, start,
    full])`` items: a pipeline stage its layers (the first also the embedding, the last the final norm and
    lm_head); an expert-parallel rank its slice of every fused expert tensor and the rest whole."""
    from ..policy import layer_index

    items = _full_items(model)
    n_layers = model.config.num_hidden_layers
    for name, t in items:
        t = t.detach()
        if layout.pp > 1:
            layer = layer_index(name)
            stage = (layer * layout.pp // n_layers if layer is not None
                     else 0 if "embed" in name else layout.pp - 1)
            if stage == rank:
                yield name, t
        elif layout.ep > 1 and t.dim() == 3 and ".experts." in name:
            step = -(-t.shape[0] // layout.ep)
            lo, hi = min(rank * step, t.shape[0]), min((rank + 1) * step, t.shape[0])
            yield name, t[lo:hi], 0, lo, t.shape[0]
        else:
            yield name, t


def _full_weights(model) -> dict:
    """Every parameter whole (``full_tensor()`` of DTensors: a collective over the trainer group)."""
    from ..sources.dtensor import is_dtensor

    return {n: (p.full_tensor() if is_dtensor(p) else p).detach() for n, p in model.named_parameters()}


def _reference(cfg: MeshConfig, full: dict, reference):
    """Trainer rank 0: the unsharded reference model with the gathered weights, and its refit tensors
    (quantize of every full tensor, the kept ones in the engine's dtype) by name."""
    from ..refit.trainer import TrainerSource

    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(full[n])
    src = TrainerSource(reference, kept_dtype=ENGINE_DTYPE,
                        kernel="eager")  # the reference: the plain torch path, whatever the trainer ranks use
    return {e.name: t for e, t in zip(src.plan.entries, src.tensors(), strict=True)}


def _crc(tensors) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
    return crc


def _expected_crcs(mesh, ref: dict) -> list[int]:
    """Per rank (trainer ranks, then engine ranks): the CRC-32 of quantize(full tensor) cut to the boxes it
    holds, in its holding order."""
    return [_crc(ref[h.tensor.name][h.box.index()] for h in held) for held in (*mesh.trainers, *mesh.engines)]


def _trainer(cfg: MeshConfig, pg, rank: int, q) -> None:
    from ..models import load_causal_lm
    from ..refit import RefitSender
    from ..refit.transport import TorchDistTransport

    t_layout, _ = _layouts(cfg)
    T = t_layout.ranks
    torch.manual_seed(0)
    model, tok = load_causal_lm(cfg.source, dtype=torch.float32, require_tokenizer=False)
    words = Words.of(model, tok)
    reference = None
    if rank == 0:
        reference = load_causal_lm(cfg.source, dtype=torch.float32, require_tokenizer=False)[0]
    world = TorchDistTransport.from_group(pg)
    try:
        source = _shard_trainer(model, t_layout, rank, trainer_kernel(cfg.steps))
        held = source.holdings
    except Exception as exc:  # noqa: BLE001 - every rank learns it in the agreement, naming this rank
        held = exc
    mesh = agree(world, T, held)  # raises on every rank when any rank failed before it
    # replicas' digests join the vote
    sender = RefitSender.from_mesh(world, mesh, bucket_bytes=cfg.bucket_bytes, delta=cfg.delta)
    sender.handshake()
    if rank == 0:
        q.put(("plan", 0, mesh.summary()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    batch = words.batch(cfg.seq_len)
    prompt = words.prompt()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        local = source.local()
        quantize_s = time.perf_counter() - t1
        stats = sender.send_local(local)
        full = _full_weights(model)  # a collective of the trainer group (FSDP2 / TP); outside the refit
        # a trainer rank's refit: quantizing its shards, then sending up to the vote's outcome
        crc = _crc(local_part(local, h.tensor.name, h.box) for h in source.holdings)  # the bytes it quantized
        rows = _rank_rows(world, rank, stats.version, crc, True, stats, quantize_s + stats.seconds,
                          _block_counts(sender, stats))
        if rank == 0:
            ref = _reference(cfg, full, reference)
            reply = _recv_reply(pg, T, prompt, cfg.max_new_tokens, reference)
            q.put(("step", 0, _step_row(step, float(out.loss), train_s, quantize_s, stats, rows, mesh,
                                        _expected_crcs(mesh, ref), reply, reference, words)))


# -- engine ranks --------------------------------------------------------------------------------------------
def _engine(cfg: MeshConfig, pg, rank: int) -> None:
    from ..models import load_causal_lm
    from ..nn import quantize_model
    from ..refit import RefitReceiver
    from ..refit.engine import engine_buffers, engine_holdings
    from ..refit.transport import TorchDistTransport

    t_layout, e_layout = _layouts(cfg)
    T, e = t_layout.ranks, rank - t_layout.ranks
    # kept tensors in BF16, as engines run
    model, tok = load_causal_lm(cfg.source, dtype=ENGINE_DTYPE, require_tokenizer=False)
    words = Words.of(model, tok)
    quantize_model(model)
    kv_heads = getattr(model.config, "num_key_value_heads", None)
    world = TorchDistTransport.from_group(pg)
    try:
        holdings = engine_holdings(model, e_layout, e, kv_heads=kv_heads)
        live = engine_buffers(holdings)
        _load_initial(model, holdings, live)
        held = holdings
    except Exception as exc:  # noqa: BLE001 - every rank learns it in the agreement, naming this rank
        held = exc
    mesh = agree(world, T, held)
    receiver = RefitReceiver.from_mesh(world, mesh, live, bucket_bytes=cfg.bucket_bytes, delta=cfg.delta)
    receiver.handshake()
    ptrs = _pointers(live)
    prompt = words.prompt()
    for _step in range(1, cfg.steps + 1):
        stats = receiver.receive()
        stable = _pointers(live) == ptrs
        crc = _crc(local_part(live, h.tensor.name, h.box) for h in holdings)
        _rank_rows(world, rank, stats.version, crc, stable, stats, stats.seconds)
        _assemble(pg, mesh, e, model, holdings, live)
        if e == 0:
            _send_reply(pg, model, words, prompt, cfg.max_new_tokens, stats.version)


def _pointers(live: dict) -> list[int]:
    """The data pointers of every live tensor (every box of a name held as several)."""
    return [t.data_ptr() for _, _, t in local_items(live)]


def _load_initial(model, holdings: list[Holding], live: dict) -> None:
    """The engine rank's shard of the model it loaded (its first weights, kept until the first refit)."""
    from ..refit.engine import receiver_plan

    plan, targets = receiver_plan(model)
    full = {en.name: t for en, t in zip(plan.entries, targets, strict=True)}
    with torch.no_grad():
        for h in holdings:
            local_part(live, h.tensor.name, h.box).copy_(full[h.tensor.name][h.box.index()])


def _assemble(pg, mesh, e: int, model, holdings, live) -> None:
    """Engine rank 0 gathers every engine rank's shards into its full model (for generation only)."""
    from ..refit.engine import receiver_plan

    if e != 0:
        for h in holdings:
            pg.send([_bytes(local_part(live, h.tensor.name, h.box))], 0 + mesh.num_trainers,
                    _TAG_SHARDS).wait()
        return
    plan, targets = receiver_plan(model)
    full = {en.name: t for en, t in zip(plan.entries, targets, strict=True)}
    with torch.no_grad():
        for h in holdings:
            full[h.tensor.name][h.box.index()].copy_(local_part(live, h.tensor.name, h.box))
        for other in range(1, mesh.num_engines):
            for h in mesh.engines[other]:
                dst = full[h.tensor.name][h.box.index()]
                buf = torch.empty(h.box.shape, dtype=dst.dtype)
                pg.recv([_bytes(buf)], mesh.engine_rank(other), _TAG_SHARDS).wait()
                dst.copy_(buf)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (gloo moves bytes; it has no float8 types)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _send_reply(pg, model, words: Words, prompt, max_new: int, version: int) -> None:
    """Engine rank 0: generate greedily and send (sizes, tokens, float32 logits) to trainer rank 0 as
    fixed-size tensors (no pickle)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new,
                             do_sample=False, **words.generate_kwargs(model))
    logits = logits_on(model, seq, prompt.shape[1])
    n_seq = prompt.shape[1] + max_new
    row = torch.tensor([version, time.perf_counter() - t0, seq.shape[1]], dtype=torch.float64)
    seq_buf = torch.zeros(n_seq, dtype=torch.int64)
    seq_buf[:seq.shape[1]] = seq[0]
    log_buf = torch.zeros(max_new, _vocab(model), dtype=torch.float32)
    log_buf[:logits.shape[0]] = logits
    for t in (row, seq_buf, log_buf):
        pg.send([t], 0, _TAG_REPLY).wait()


def _recv_reply(pg, engine0: int, prompt, max_new: int, reference) -> dict:
    """Trainer rank 0: engine rank 0's generation, checked for range."""
    n_seq = prompt.shape[1] + max_new
    row = torch.zeros(3, dtype=torch.float64)
    seq = torch.zeros(n_seq, dtype=torch.int64)
    logits = torch.zeros(max_new, _vocab(reference), dtype=torch.float32)
    for t in (row, seq, logits):
        pg.recv([t], engine0, _TAG_REPLY).wait()
    n = int(row[2])
    if not prompt.shape[1] < n <= n_seq or not bool(((seq >= 0) & (seq < logits.shape[1])).all()):
        raise RuntimeError(f"engine rank 0 sent a reply out of range ({n} tokens)")
    return {"version": int(row[0]), "gen_s": float(row[1]), "seq": seq[:n].view(1, n),
            "logits": logits[:n - prompt.shape[1]], "prompt_len": int(prompt.shape[1])}


def _block_counts(sender, stats) -> tuple[int, int]:
    """This trainer rank's changed and total MXFP8 blocks of its streams' last refit ((-1, 0): no base)."""
    from ..refit.stream.delta import streams_block_counts

    return streams_block_counts(sender.streams) if stats.changed_words >= 0 else (-1, 0)


def _rank_rows(world, rank: int, version: int, crc: int, stable: bool, stats, seconds: float,
               blocks: tuple[int, int] = (0, 0)) -> list:
    """Every rank's row (:data:`_ROW`: bytes on the wire, the full stream's, whether it went as a delta,
    changed / total MXFP8 blocks on trainer ranks), one int64 row each."""
    row = torch.tensor([rank, version, crc, int(stable), stats.wire_bytes, int(seconds * 1e6), stats.bytes,
                        int(stats.delta), *blocks], dtype=torch.int64)
    return [dict(zip(_ROW, (int(x) for x in r), strict=True)) for r in world.all_gather(row)]


def rank_entries(rows: list[dict], trainers: int, expected: list[int]) -> list[dict]:
    """The JSON ``ranks`` of a step from every rank's reported row: role, bytes, seconds, version, and
    ``bit_exact`` (its CRC-32 equals ``expected[rank]``, that of quantize of the full tensors cut to its
    boxes); engine ranks add ``pointers_stable``."""
    out = []
    for r in rows:
        is_engine = r["rank"] >= trainers
        entry = {"rank": r["rank"], "role": "engine" if is_engine else "trainer", "bytes": r["bytes"],
                 "seconds": r["seconds_us"] / 1e6, "version": r["version"],
                 "bit_exact": r["crc32"] == expected[r["rank"]]}
        if is_engine:
            entry["pointers_stable"] = bool(r["pointers_stable"])
        out.append(entry)
    return out


def _step_row(step, loss, train_s, quantize_s, stats, rows, mesh, expected, reply, reference, words) -> dict:
    """One step as ``mxport refit`` reports it: the single-rank keys, plus ``ranks`` (per rank: role, bytes,
    seconds, bit_exact — its shard's bytes against quantize of the full tensor — and for engine ranks
    pointers_stable)."""
    from ..metrics import gen_kl_error, greedy_agreement

    logits_train = logits_on(reference, reply["seq"], reply["prompt_len"])
    kl = gen_kl_error(reply["logits"], logits_train)
    ranks = rank_entries(rows, mesh.num_trainers, expected)
    engines = [r for r in ranks if r["role"] == "engine"]
    seconds = max(r["seconds"] for r in ranks if r["role"] == "trainer")
    nbytes = sum(r["bytes"] for r in engines)
    gbps = nbytes / seconds / 1e9 if seconds else 0.0
    trainers = [r for r in rows if r["rank"] < mesh.num_trainers]
    hit, total = sum(r["blocks_hit"] for r in trainers), sum(r["blocks_total"] for r in trainers)
    delta = {"full_bytes": sum(r["full_bytes"] for r in rows if r["rank"] >= mesh.num_trainers),
             "delta": all(r["delta"] for r in rows if r["full_bytes"]),
             "blocks_changed": hit / total if total and min(r["blocks_hit"] for r in trainers) >= 0 else None}
    return StepReport(
        step=step, bytes=nbytes, seconds=seconds, gbps=gbps, gen_kl_error=kl["mean"],
        bit_exact=all(r["bit_exact"] for r in ranks),
        pointers_stable=all(r["pointers_stable"] for r in engines),
        details={"version": stats.version, "loss": loss, "train_s": train_s, "quantize_s": quantize_s,
                 "gen_kl_error_max": kl["max"],
                 "greedy_agreement": greedy_agreement(reply["logits"], logits_train),
                 "text": words.decode(reply["seq"][0, reply["prompt_len"]:]), **delta,
                 "ranks": ranks}).to_dict()


# -- processes -----------------------------------------------------------------------------------------------
def worker(rank: int, world_size: int, ports: tuple[int, int], cfg_dict: dict, q) -> None:
    """One spawned process: trainer ranks ``0 .. T-1`` (their own gloo group for FSDP2 / TP), engine ranks
    after them; all in the refit group."""
    import torch.distributed as dist

    from .._env import quiet_third_party_logs
    from ..refit.transport import open_group
    from .procs import redirect_output

    quiet_third_party_logs()
    cfg = MeshConfig(**cfg_dict)
    redirect_output(cfg.log_dir, rank)
    T = _layouts(cfg)[0].ranks
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    pg = None
    try:
        if rank < T:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                                    world_size=T)
        pg = open_group("127.0.0.1", ports[1], rank, world_size, timeout_s=cfg.timeout_s)
        if rank < T:
            _trainer(cfg, pg, rank, q)
        else:
            _engine(cfg, pg, rank)
        q.put(("done", rank, None))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent, then exit non-zero
        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_mesh_demo(cfg: MeshConfig, on_event=None, timeout_s: float = 1800.0) -> dict:
    """Start the trainer and engine ranks, collect their messages: ``{"plan": {...}, "steps": [...]}`` (see
    :func:`~mxport.refit.demo.run_demo` for events, errors and clean-up)."""
    t_layout, e_layout = _layouts(cfg)
    world = t_layout.ranks + e_layout.ranks
    ports = (free_port(), free_port())
    return spawn_and_collect(worker, world, (ports, asdict(cfg)), on_event, timeout_s)


