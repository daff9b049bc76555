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

MXFP8: each engine rank receives only the slice it holds (:func:`mxport.layout.engine_shard`, vLLM's tensor /
expert parallel slicing); the trainer ranks share the sending equally. Every rank has one link of
``link_gbps``; the wire time is the busier side's bytes over it: ``t_wire = max(wire_bytes / trainer_ranks,
max bytes of one engine rank) / link``. BF16: a pipelined broadcast (NCCL's ring) carries each byte once per
link, ``t_wire = max(model bytes x replicas / trainer_ranks, stage bytes) / link``. With ``shared_gbps`` every
phase also takes at least its total bytes (every rank's transfers together) over that shared bandwidth: ranks
that share one host's memory (loopback), a NIC, or an oversubscribed fabric. Quantizing and sending overlap
(the sender quantizes bucket ``b + 1`` while bucket ``b`` is on the wire) unless ``overlap=False``:
``t = max(t_quantize, t_wire)`` or their sum. Constants it
does not know (per-message latency, checksums, stragglers) are left out: it is a lower bound shaped like the
measurements, not a simulator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .layout import Layout, engine_shard, mxfp8_bytes
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
    """

    link_gbps: float = 50.0
    trainer_quantize_gelems: float = 14.0
    engine_quantize_gelems: float = 14.0
    overlap: bool = True
    shared_gbps: float | None = None

    def __post_init__(self) -> None:
        names = ("link_gbps", "trainer_quantize_gelems", "engine_quantize_gelems")
        for name in names + (("shared_gbps",) if self.shared_gbps is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")


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

    @property
    def speedup(self) -> float:
        """BF16 time over MXFP8 time."""
        return self.bf16.seconds / self.mxfp8.seconds if self.mxfp8.seconds else math.inf

    def to_dict(self) -> dict:
        return {"model": self.model, "parameters": self.parameters,
                "quantized_parameters": self.quantized_parameters, "trainer": self.trainer,
                "engine": self.engine, "engine_replicas": self.engine_replicas,
                "hardware": asdict(self.hardware), "mxfp8": self.mxfp8.to_dict(), "bf16": self.bf16.to_dict(),
                "speedup": self.speedup, "problems": list(self.problems)}


def _kv_heads(config: dict) -> int | None:
    v = config.get("num_key_value_heads") or config.get("num_attention_heads")
    return int(v) if isinstance(v, int) and v > 0 else None


def predict(entries: Sequence[tuple[str, Sequence[int], torch.dtype]], trainer: Layout, engine: Layout,
            hardware: Hardware = Hardware(), *, engine_replicas: int = 1, kept_bytes: int = BF16_BYTES,
            config: dict | None = None, policy: PrecisionPolicy | None = None,
            model: str = "model") -> CapacityReport:
    """Predict the refit of the tensors ``entries`` (``(name, shape, dtype)`` in model order) from a
    ``trainer`` layout into ``engine_replicas`` engines of layout ``engine`` (module doc for the model).

    Raises:
        ValueError: ``engine_replicas`` or ``kept_bytes`` below 1.
    """
    if engine_replicas < 1 or kept_bytes < 1:
        raise ValueError(f"engine_replicas and kept_bytes must be >= 1, got {engine_replicas}, {kept_bytes}")
    decisions = (policy or PrecisionPolicy()).decide_all(entries)
    kv = _kv_heads(config or {})
    mx_rank = 0
    params = quant_params = quant_rank = 0
    problems: list[str] = []
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
    replicas, t_ranks, link = engine_replicas, trainer.ranks, hardware.link_gbps * 1e9
    shared = (hardware.shared_gbps or math.inf) * 1e9
    stage_ranks = engine.tp * engine.ep  # each holds one slice of every tensor of its stage
    mx_wire = mx_rank * stage_ranks * replicas
    # stages hold their layers; BF16: every engine rank receives its stage's full tensors
    mx_rank, bf_rank = math.ceil(mx_rank / engine.pp), math.ceil(params * BF16_BYTES / engine.pp)
    bf_wire, bf_sent = bf_rank * stage_ranks * engine.pp * replicas, params * BF16_BYTES * replicas
    mx_wire_s = max(mx_wire / t_ranks / link, mx_rank / link, mx_wire / shared)
    bf_wire_s = max(max(bf_sent / t_ranks, bf_rank) / link, bf_wire / shared)
    mx_quant_s = quant_params / t_ranks / (hardware.trainer_quantize_gelems * 1e9)
    bf_quant_s = quant_rank / engine.pp / (hardware.engine_quantize_gelems * 1e9)
    group = trainer.fsdp * trainer.tp  # the ranks a stage's full_tensor() gathers from
    gather_bytes = params * BF16_BYTES * (group - 1)  # every rank receives (group - 1) / group of its stage
    gather_s = max(gather_bytes / trainer.pp / group / link, gather_bytes / shared)
    combine = max if hardware.overlap else (lambda a, b: a + b)
    mx = PathEstimate(mx_wire, math.ceil(mx_wire / t_ranks), mx_rank, 0.0, mx_quant_s, mx_wire_s,
                      combine(mx_quant_s, mx_wire_s))
    bf = PathEstimate(bf_wire, math.ceil(bf_sent / t_ranks), bf_rank, gather_s, bf_quant_s, bf_wire_s,
                      gather_s + bf_wire_s + bf_quant_s)
    return CapacityReport(model, params, quant_params, str(trainer), str(engine), replicas, hardware, mx, bf,
                          tuple(dict.fromkeys(problems)))


def config_entries(config: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The ``(name, shape, dtype)`` of every tensor of the causal LM a ``config.json`` describes, built on the
    meta device (no memory, a second even for a 1T-parameter MoE), with ``transformers``.

    Raises:
        ValueError: a config ``transformers`` cannot build a causal LM from.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError("config has no model_type (e.g. \"llama\", \"qwen3_moe\", \"deepseek_v3\")")
    try:
        cfg = AutoConfig.for_model(model_type, **cfg_dict)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot build a {model_type!r} causal LM from this config: {exc}") from None
    params = dict(model.named_parameters())  # tied weights (lm_head = embed_tokens) once, as refit sends them
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    return [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items() if n not in tied]


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
