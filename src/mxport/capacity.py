"""A capacity model of refit: bytes per link and predicted refit time, MXFP8 against BF16, for any model
config, trainer layout and engine layout — for machines bigger than the one at hand.

What it counts (per refit, every tensor of the model once per engine replica):

* **MXFP8** (what mxport sends): quantized weights as FP8 values + one E8M0 byte per block of 32, kept tensors
  (embeddings, norms, routers, ``lm_head``) in ``kept_bytes`` per element (BF16 on engines: 2); the trainer
  ranks quantize their share of the weights.
* **BF16** (the default path today: gather the full tensors on the trainer, broadcast them in BF16,
  quantize on the engine): every tensor at 2 bytes per element; sharded trainers first gather
  (``full_tensor()``: every rank of a pipeline stage receives the stage's whole model over its link); the
  full tensors are broadcast to every engine rank of the stage (NeMo-RL's and SGLang's
  ``update_weights_from_distributed``, vLLM's collective weight update: each worker's loader slices what it
  holds), and every engine rank quantizes its slice.

**BF16 sharded** (what systems at scale run: vLLM's RDT weight transfer, NeMo-RL's ``nccl_reshard``): each
engine rank receives only its slice, in BF16, straight from the trainer ranks that hold it (the routing of the
MXFP8 path, two bytes an element), then quantizes it; no gather, no broadcast of full tensors.

MXFP8: each engine rank receives only the slice it holds (:func:`mxport.parallel.engine_shard`, vLLM's
tensor / expert parallel slicing); the trainer ranks share the sending equally. Every rank has one link of
``link_gbps``; the wire time is the busier side's bytes over it: ``t_wire = max(wire_bytes / trainer_ranks,
max bytes of one engine rank) / link``. BF16: a pipelined broadcast (NCCL's ring) carries each byte once per
link, ``t_wire = max(model bytes x replicas / trainer_ranks, stage bytes) / link``. With ``shared_gbps`` every
phase also takes at least its total bytes (every rank's transfers together) over that shared bandwidth: ranks
that share one host's memory (loopback), a NIC, or an oversubscribed fabric. Quantizing and sending overlap
(the sender quantizes bucket ``b + 1`` while bucket ``b`` is on the wire) unless ``overlap=False``:
``t = max(t_quantize, t_wire)`` or their sum.

The protocol's own passes over the bytes in host memory (:class:`HostPasses`, counted per tensor; only with
``host_copy_gbps``, off by default: on GPUs they run at HBM bandwidth, far above any link): the sender
packs each bucket (its checksum summed while packing; a bucket that lies inside one piece goes out zero-copy
and is only read for its checksum, the expected ``max(0, piece - bucket_bytes)`` bytes of each piece) and
first copies a piece that is not contiguous in its shard (``route_tensors``); the engine rank (staging mode)
reads each bucket for its checksum, then at commit copies staging into the live tensors, and a piece not
contiguous in its slice once more (``route_targets``' scatter). Packing and the receiver's checksums run while
buckets are on the wire (with ``overlap``: ``max(t_quantize, t_wire, t_pack, t_checksum)``, else summed); the
commit copy runs after the vote: ``t = ... + t_commit``. Constants it does not know (per-message latency,
stragglers) are left out: it is a lower bound shaped like the measurements, not a simulator.

**MXFP8 delta** (``delta_fraction`` f: the delta payload's bytes over the full stream's, what ``mxport refit
--delta`` reports as ``bytes / full_bytes``): the trainer ranks quantize as for a full refit, then diff every
bucket against the base they keep (reading the base and the new bytes: two passes over their stream at the
checksum rate, or ``host_diff_gbps``; once per trainer rank, replicas share its stream) after packing and
summing each bucket as a full refit does, then send f of the bytes; each engine rank parses and applies the
payload (``host_patch_gbps``) to its copy of the version it holds and sums its whole stream against the new
version's checksums (one read pass), then commits (staging: a copy of the whole stream, and the scatter of
pieces not contiguous in its slice; ``direct``: no copy, the patch lands in the live tensors). Nothing
overlaps: the sender diffs every bucket before the agreement, the engine checks after the payload: ``t =
t_quantize + t_pack + t_diff + t_wire(f) + t_patch + t_check + t_commit``.
Where the link is slow against the quantize (a cluster's NIC against a GPU's HBM) the delta pays; on loopback,
where the quantize dominates, it cannot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .parallel import Layout, engine_shard, mxfp8_bytes
from .policy import PrecisionPolicy

BF16_BYTES = 2


@dataclass(frozen=True)
class Hardware:
    """Link and compute rates.

    Attributes:
        link_gbps: GB/s of one rank's link (each trainer and engine rank has one), e.g. 50 for a 400 Gb/s NIC.
        trainer_quantize_gelems: G elements/s one trainer rank quantizes (BF16 -> MXFP8).
        engine_quantize_gelems: G elements/s one engine rank quantizes (the BF16 path).
        overlap: quantizing overlaps sending (True) or precedes it (False).
        shared_gbps: GB/s that all ranks' transfers share at once (one host's loopback and memory, a NIC
            several ranks use, an oversubscribed fabric); None: every link is independent.
        host_copy_gbps: GB/s one rank copies memory while every rank does (the protocol's pack, cut, commit
            and scatter copies, :class:`HostPasses`); None: those passes are left out (GPUs: HBM bandwidth).
        host_checksum_gbps: GB/s one rank reads memory for checksums while every rank does; None: the same as
            ``host_copy_gbps``.
        host_commit_gbps: GB/s one engine rank copies memory while the engine ranks alone do (the commit runs
            after the vote, the trainers idle); None: the same as ``host_copy_gbps``.
        host_diff_gbps: stream GB/s one trainer rank diffs against its base (a delta refit); None: half the
            checksum rate (it reads two streams).
        host_patch_gbps: delta payload GB/s one engine rank parses and applies; None: the copy rate.
    """

    link_gbps: float = 50.0
    trainer_quantize_gelems: float = 14.0
    engine_quantize_gelems: float = 14.0
    overlap: bool = True
    shared_gbps: float | None = None
    host_copy_gbps: float | None = None
    host_checksum_gbps: float | None = None
    host_commit_gbps: float | None = None
    host_diff_gbps: float | None = None
    host_patch_gbps: float | None = None

    def __post_init__(self) -> None:
        names = ("link_gbps", "trainer_quantize_gelems", "engine_quantize_gelems")
        optional = ("shared_gbps", "host_copy_gbps", "host_checksum_gbps", "host_commit_gbps",
                    "host_diff_gbps", "host_patch_gbps")
        for name in names + tuple(n for n in optional if getattr(self, n) is not None):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")


@dataclass(frozen=True)
class HostPasses:
    """Bytes the refit protocol passes over in host memory besides the wire, per trainer rank (sender) and per
    engine rank (receiver in staging mode), for one refit of the MXFP8 path (module doc)."""

    pack: int             # sender: copied into pack buffers (checksum summed while packing)
    cut: int              # sender: pieces not contiguous in the rank's shard, copied out first
    sender_checksum: int  # sender: zero-copy buckets, read for their checksum
    checksum: int         # engine: every received byte, read for its bucket's checksum
    commit: int           # engine: every byte, copied from staging into the live tensors
    scatter: int          # engine: pieces not contiguous in the rank's slice, copied once more

    def seconds(self, hardware: Hardware) -> tuple[float, float, float]:
        """``(sender, receiver checksum, commit)`` seconds at ``hardware``'s host rates (zeros without
        ``host_copy_gbps``)."""
        if hardware.host_copy_gbps is None:
            return 0.0, 0.0, 0.0
        copy = hardware.host_copy_gbps * 1e9
        read = (hardware.host_checksum_gbps or hardware.host_copy_gbps) * 1e9
        commit = (hardware.host_commit_gbps or hardware.host_copy_gbps) * 1e9
        return ((self.pack + self.cut) / copy + self.sender_checksum / read, self.checksum / read,
                (self.commit + self.scatter) / commit)

    def to_dict(self) -> dict:
        return asdict(self)


def _contiguous(piece: Sequence[int], holder: Sequence[int]) -> bool:
    """Whether a box of shape ``piece`` is one contiguous range of a row-major tensor of shape ``holder``:
    after its first dimension longer than 1, it spans every later dimension whole."""
    dims = [i for i, n in enumerate(piece) if n > 1]
    return not dims or all(piece[j] == holder[j] for j in range(dims[0] + 1, len(piece)))


@dataclass(frozen=True)
class PathEstimate:
    """One way of refitting (MXFP8 or BF16): bytes and predicted seconds."""

    wire_bytes: int              # received by all engine ranks of all replicas together
    bytes_per_trainer_rank: int  # sent by one trainer rank
    bytes_per_engine_rank: int   # received by the busiest engine rank (BF16: the stage's full tensors)
    gather_seconds: float        # trainer-side full_tensor() gathers (BF16 path of a sharded trainer)
    quantize_seconds: float      # trainer ranks (MXFP8) or engine ranks (BF16)
    wire_seconds: float
    seconds: float               # predicted refit time
    host_seconds: float = 0.0    # the protocol's host passes in ``seconds`` (HostPasses; not the bcast)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CapacityReport:
    """The prediction for one model, trainer layout, engine layout and hardware."""

    model: str
    parameters: int
    quantized_parameters: int
    trainer: str
    engine: str
    engine_replicas: int
    hardware: Hardware
    mxfp8: PathEstimate
    bf16: PathEstimate
    problems: tuple[str, ...] = field(default=())
    passes: HostPasses = HostPasses(0, 0, 0, 0, 0, 0)
    bf16_sharded: PathEstimate | None = None
    delta: PathEstimate | None = None  # the MXFP8 delta refit (``delta_fraction`` given)
    delta_fraction: float | None = None

    @property
    def speedup(self) -> float:
        """BF16 (gather + broadcast) time over MXFP8 time."""
        return self.bf16.seconds / self.mxfp8.seconds if self.mxfp8.seconds else math.inf

    @property
    def speedup_sharded(self) -> float:
        """BF16 sharded time over MXFP8 time."""
        s = self.bf16_sharded
        return s.seconds / self.mxfp8.seconds if s is not None and self.mxfp8.seconds else math.inf

    def to_dict(self) -> dict:
        return {"model": self.model, "parameters": self.parameters,
                "quantized_parameters": self.quantized_parameters, "trainer": self.trainer,
                "engine": self.engine, "engine_replicas": self.engine_replicas,
                "hardware": asdict(self.hardware), "mxfp8": self.mxfp8.to_dict(), "bf16": self.bf16.to_dict(),
                "speedup": self.speedup, "problems": list(self.problems), "passes": self.passes.to_dict(),
                "bf16_sharded": self.bf16_sharded.to_dict() if self.bf16_sharded else None,
                "speedup_vs_bf16_sharded": self.speedup_sharded, "delta_fraction": self.delta_fraction,
                "delta": self.delta.to_dict() if self.delta else None,
                "delta_vs_full": self.delta.seconds / self.mxfp8.seconds
                if self.delta and self.mxfp8.seconds else None}


def _kv_heads(config: dict) -> int | None:
    v = config.get("num_key_value_heads") or config.get("num_attention_heads")
    return int(v) if isinstance(v, int) and v > 0 else None


def _piece_passes(name: str, shape: tuple[int, ...], held: tuple[int, ...], nbytes: int, value_bytes: int,
                  trainer: Layout, kv: int | None, quantized: bool,
                  bucket_bytes: int) -> tuple[int, int, int]:
    """``(cut, zero-copy, scatter)`` bytes of one engine rank's slice ``held`` (``nbytes`` on the wire,
    ``value_bytes`` per element) of tensor ``name``: the pieces one trainer rank sends it are the overlap of
    the trainer's shard (its tp / ep slice, rows split over fsdp) and the slice."""
    t_shape = engine_shard(name, shape, Layout(tp=trainer.tp, ep=trainer.ep), kv_heads=kv,
                           quantized=quantized).shape
    if t_shape:
        t_shape = (-(-t_shape[0] // trainer.fsdp), *t_shape[1:])
    piece = tuple(min(a, b) for a, b in zip(t_shape, held, strict=True))
    cut = 0 if _contiguous(piece, t_shape) else nbytes
    scatter = 0 if _contiguous(piece, held) else nbytes
    piece_bytes = math.prod(piece) * value_bytes  # a bucket inside one piece goes out zero-copy
    values = math.prod(held) * value_bytes
    zero = values * max(0, piece_bytes - bucket_bytes) // piece_bytes if piece_bytes else 0
    return cut, zero, scatter


def predict(entries: Sequence[tuple[str, Sequence[int], torch.dtype]], trainer: Layout, engine: Layout,
            hardware: Hardware = Hardware(), *, engine_replicas: int = 1, kept_bytes: int = BF16_BYTES,
            config: dict | None = None, policy: PrecisionPolicy | None = None,
            model: str = "model", bucket_bytes: int = 32 << 20, delta_fraction: float | None = None,
            direct: bool = False) -> CapacityReport:
    """Predict the refit of the tensors ``entries`` (``(name, shape, dtype)`` in model order) from a
    ``trainer`` layout into ``engine_replicas`` engines of layout ``engine`` (module doc for the model);
    ``bucket_bytes``: the refit plan's bucket size (the host passes' zero-copy buckets); ``delta_fraction``:
    also predict a delta refit sending that fraction of the bytes (``report.delta``); ``direct``: the engine
    ranks receive straight into their live tensors (no commit copy; the mxport engine's arena).

    Raises:
        ValueError: ``engine_replicas``, ``kept_bytes`` or ``bucket_bytes`` below 1; ``delta_fraction``
            outside [0, 1].
    """
    if engine_replicas < 1 or kept_bytes < 1 or bucket_bytes < 1:
        raise ValueError(f"engine_replicas, kept_bytes and bucket_bytes must be >= 1, got {engine_replicas}, "
                         f"{kept_bytes}, {bucket_bytes}")
    if delta_fraction is not None:
        delta_fraction = _fraction(delta_fraction)
    decisions = (policy or PrecisionPolicy()).decide_all(entries)
    kv = _kv_heads(config or {})
    mx_rank = cut = zero = scatter = bf_slice = 0
    params = quant_params = quant_rank = 0
    problems: list[str] = _attention_problems(config or {}, engine)
    for d in decisions:
        numel = math.prod(d.shape)
        params += numel
        shard = engine_shard(d.name, d.shape, engine, kv_heads=kv, quantized=d.quantize)
        held = math.prod(shard.shape)
        if shard.problem:
            problems.append(shard.problem)
        if d.quantize:
            quant_params += numel
            quant_rank += held
            mx_held = mxfp8_bytes(shard.shape)
        else:
            mx_held = held * kept_bytes
        mx_rank += mx_held
        bf_slice += held * BF16_BYTES
        c, z, sc = _piece_passes(d.name, tuple(d.shape), tuple(shard.shape), mx_held,
                                 1 if d.quantize else kept_bytes, trainer, kv, d.quantize, bucket_bytes)
        cut, zero, scatter = cut + c, zero + z, scatter + sc
    replicas, t_ranks, link = engine_replicas, trainer.ranks, hardware.link_gbps * 1e9
    shared = (hardware.shared_gbps or math.inf) * 1e9
    stage_ranks = engine.tp * engine.ep  # each holds one slice of every tensor of its stage
    mx_wire = mx_rank * stage_ranks * replicas
    # stages hold their layers; BF16: every engine rank receives its stage's full tensors
    mx_all = mx_rank  # one rank of each stage together
    mx_rank, bf_rank = math.ceil(mx_rank / engine.pp), math.ceil(params * BF16_BYTES / engine.pp)
    bf_wire, bf_sent = bf_rank * stage_ranks * engine.pp * replicas, params * BF16_BYTES * replicas
    mx_wire_s = max(mx_wire / t_ranks / link, mx_rank / link, mx_wire / shared)
    bf_wire_s = max(max(bf_sent / t_ranks, bf_rank) / link, bf_wire / shared)
    mx_quant_s = quant_params / t_ranks / (hardware.trainer_quantize_gelems * 1e9)
    bf_quant_s = quant_rank / engine.pp / (hardware.engine_quantize_gelems * 1e9)
    group = trainer.fsdp * trainer.tp  # the ranks a stage's full_tensor() gathers from
    gather_bytes = params * BF16_BYTES * (group - 1)  # every rank receives (group - 1) / group of its stage
    gather_s = max(gather_bytes / trainer.pp / group / link, gather_bytes / shared)
    per_trainer = stage_ranks * replicas / t_ranks  # the senders share every engine rank's pieces equally
    passes = HostPasses(pack=math.ceil((mx_all - zero) * per_trainer),
                        cut=math.ceil(cut * per_trainer), sender_checksum=math.ceil(zero * per_trainer),
                        checksum=mx_rank, commit=0 if direct else mx_rank,
                        scatter=math.ceil(scatter / engine.pp))
    send_s, check_s, commit_s = passes.seconds(hardware)
    combine = max if hardware.overlap else (lambda *a: sum(a))
    mx = PathEstimate(mx_wire, math.ceil(mx_wire / t_ranks), mx_rank, 0.0, mx_quant_s, mx_wire_s,
                      combine(mx_quant_s, mx_wire_s, send_s, check_s) + commit_s,
                      send_s + check_s + commit_s)
    bf = PathEstimate(bf_wire, math.ceil(bf_sent / t_ranks), bf_rank, gather_s, bf_quant_s, bf_wire_s,
                      gather_s + bf_wire_s + bf_quant_s)
    sharded = _bf16_sharded(bf_slice, mx_all, stage_ranks, replicas, trainer, engine, hardware, bf_quant_s,
                            (send_s, check_s, commit_s))
    # a trainer rank diffs its stream once (replicas take the same bytes, multicast)
    delta = None if delta_fraction is None else _delta(mx, mx_all * stage_ranks / t_ranks, delta_fraction,
                                                       hardware, shared, (send_s, check_s, commit_s))
    return CapacityReport(model, params, quant_params, str(trainer), str(engine), replicas, hardware, mx, bf,
                          tuple(dict.fromkeys(problems)), passes, sharded, delta, delta_fraction)


def _fraction(f) -> float:
    """``f`` as a float in [0, 1] (ValueError otherwise; a bool is not a fraction)."""
    try:
        value = float(f) if not isinstance(f, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not 0 <= value <= 1:
        raise ValueError(f"delta_fraction must be a number in [0, 1], got {f!r}")
    return value + 0.0  # -0.0 -> 0.0


def _delta(full: PathEstimate, diffed: float, f: float, hardware: Hardware, shared: float,
           passes: tuple[float, float, float]) -> PathEstimate:
    """The MXFP8 delta refit (module doc) from the full refit's estimate ``full``; ``diffed``: the stream
    bytes one trainer rank diffs; ``passes``: the full refit's host seconds ``(send, check, commit)``, which a
    delta refit pays too (it packs and sums every bucket before diffing it; the engine sums its whole stream
    and commits, staging's copy and the scatter of pieces not contiguous in its slice)."""
    link = hardware.link_gbps * 1e9
    wire, per_trainer, per_engine = (math.ceil(f * x) for x in (full.wire_bytes, full.bytes_per_trainer_rank,
                                                                 full.bytes_per_engine_rank))
    wire_s = max(per_trainer / link, per_engine / link, wire / shared)
    host, hw = 0.0, hardware
    if hw.host_copy_gbps is not None:
        read = (hw.host_checksum_gbps or hw.host_copy_gbps) * 1e9
        diff = hw.host_diff_gbps * 1e9 if hw.host_diff_gbps else read / 2
        patch = (hw.host_patch_gbps or hw.host_copy_gbps) * 1e9
        host = sum(passes) + diffed / diff + per_engine / patch
    seconds = full.quantize_seconds + wire_s + host
    return PathEstimate(wire, per_trainer, per_engine, 0.0, full.quantize_seconds, wire_s, seconds, host)


def _bf16_sharded(bf_slice: int, mx_all: int, stage_ranks: int, replicas: int, trainer: Layout,
                  engine: Layout, hardware: Hardware, quant_s: float, host: tuple[float, float, float]
                  ) -> PathEstimate:
    """The BF16 sharded path (module doc): the MXFP8 path's routing and host passes at BF16's bytes
    (``bf_slice``: one rank of each stage together), then the engine ranks quantize their slices."""
    link, shared = hardware.link_gbps * 1e9, (hardware.shared_gbps or math.inf) * 1e9
    wire = bf_slice * stage_ranks * replicas
    rank = math.ceil(bf_slice / engine.pp)
    wire_s = max(wire / trainer.ranks / link, rank / link, wire / shared)
    ratio = bf_slice / mx_all if mx_all else 1.0
    send_s, check_s, commit_s = (x * ratio for x in host)
    combine = max if hardware.overlap else (lambda *a: sum(a))
    seconds = combine(wire_s, send_s, check_s) + commit_s + quant_s
    return PathEstimate(wire, math.ceil(wire / trainer.ranks), rank, 0.0, quant_s, wire_s, seconds,
                        send_s + check_s + commit_s)


#: the config fields that size a causal LM's tensors (those its config class has; some are aliases of others)
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
               "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts")


def _check_sizes_given(model_type: str, config: dict, defaults) -> None:
    """Raise ValueError naming the :data:`SIZE_FIELDS` the ``defaults`` config (the class's own) has and
    ``config`` does not give (under the name or an alias): ``transformers`` would fill them with its default
    sizes, which are not this model's."""
    aliases = getattr(defaults, "attribute_map", {}) or {}
    missing: dict[str, str] = {}  # real attribute -> the name to tell the user
    for name in SIZE_FIELDS:
        real = aliases.get(name, name)
        if getattr(defaults, name, None) is None or real in missing:
            continue
        if not ({name, real} | {k for k, v in aliases.items() if v == real}) & config.keys():
            missing[real] = name
    if missing:
        raise ValueError(f"config gives no {', '.join(missing.values())}: the model's sizes are needed "
                         f"(transformers would use its defaults for a {model_type!r} model)")


def config_entries(config: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The ``(name, shape, dtype)`` of every tensor of the causal LM a ``config.json`` describes, built on the
    meta device (no memory, a second even for a 1T-parameter MoE), with ``transformers``.

    Raises:
        ValueError: a config ``transformers`` cannot build a causal LM from, or one that leaves out sizes
            (:data:`SIZE_FIELDS`) ``transformers`` would fill with its defaults.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("config has no model_type (e.g. \"llama\", \"qwen3_moe\", \"deepseek_v3\")")
    try:
        defaults = AutoConfig.for_model(model_type)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot build a {model_type!r} causal LM from this config: {exc}") from None
    _check_sizes_given(model_type, cfg_dict, defaults)
    try:
        cfg = AutoConfig.for_model(model_type, **cfg_dict)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot build a {model_type!r} causal LM from this config: {exc}") from None
    params = dict(model.named_parameters())  # tied weights (lm_head = embed_tokens) once, as refit sends them
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    return [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items() if n not in tied]


def _attention_problems(config: dict, engine: Layout) -> list[str]:
    """The attention or KV heads of ``config`` that do not divide by the engine's tp, as vLLM refuses them
    (:func:`mxport.parallel.attention_problem`), or nothing."""
    from .parallel import attention_problem

    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    problem = attention_problem(engine.tp, heads if type(heads) is int else None,
                                kv if type(kv) is int else None)
    return [problem] if problem else []


def read_config(path: str | Path) -> dict:
    """A ``config.json`` file, or the one in a model directory, as a dict.

    Raises:
        FileNotFoundError / ValueError: no such file, not a regular file, or not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {str(path)!r}")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} holds a JSON {type(data).__name__}, expected an object")
    return data


def predict_config(config: dict, trainer: Layout, engine: Layout, hardware: Hardware = Hardware(),
                   **kwargs) -> CapacityReport:
    """:func:`predict` for the model a ``config.json`` dict describes."""
    name = kwargs.pop("model", None) or str(config.get("_name_or_path") or config.get("model_type", "model"))
    return predict(config_entries(config), trainer, engine, hardware, config=config, model=name, **kwargs)


def scan(config: dict, trainers: Iterable[Layout], engines: Iterable[Layout], hardware: Hardware = Hardware(),
         **kwargs) -> list[CapacityReport]:
    """:func:`predict_config` for every trainer x engine layout pair (the model is built once)."""
    entries = config_entries(config)
    name = kwargs.pop("model", None) or str(config.get("model_type", "model"))
    return [predict(entries, t, e, hardware, config=config, model=name, **kwargs)
            for t in trainers for e in engines]
