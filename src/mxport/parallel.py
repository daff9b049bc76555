"""Parallel layouts of trainers and engines, and which slice of each tensor an engine rank holds.

A layout is written as comma-separated ``dim=N`` terms: ``tp=2``, ``fsdp=4``, ``tp=2,pp=2``, ``ep=8``
(:meth:`Layout.parse`). Dimensions: ``fsdp`` (FSDP2 / data-parallel sharding), ``tp`` (tensor parallel),
``pp`` (pipeline stages), ``ep`` (expert parallel). A layout's ranks are the product of its dimensions.

Engine tensor parallelism follows vLLM's parallel layers (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``, ``fused_moe/layer.py``), for Hugging Face tensor names:

* column parallel, rows (dim ``-2``) split: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``,
  ``q_b_proj``, ``kv_b_proj``, fused ``experts.gate_up_proj``; the vocabulary of ``embed_tokens`` and
  ``lm_head``; ``k_proj`` / ``v_proj`` rows are split over ``min(tp, kv_heads)`` ranks (vLLM replicates KV
  heads when tp exceeds their count);
* the fused ``experts.gate_up_proj`` ``[E, 2I, K]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``) is two
  blocks of rows, each split over tp: tp rank ``r`` holds gate rows ``[r*I/tp, (r+1)*I/tp)`` followed by up
  rows ``[I + r*I/tp, I + (r+1)*I/tp)``, as vLLM's ``FusedMoE`` ``w13_weight`` ``[E, 2I/tp, K]`` (its
  ``weight_loader`` narrows gate (``w1``) and up (``w3``) separately, ``_load_w13``): :attr:`Shard.blocks`
  is 2 and :meth:`Shard.ranges` gives the two row ranges;
* row parallel, the input dimension K (dim ``-1``) split: ``o_proj``, ``down_proj``, fused
  ``experts.down_proj``; an MXFP8 consumer needs each rank's K to be a multiple of 32 (vLLM ``modelopt.py``
  rejects others), which :func:`engine_shard` reports; for a column-parallel MXFP8 tensor it reports rows
  that do not split evenly, and a fused expert gate_up whose I / tp is not a multiple of 32 (vLLM's MXFP8
  MoE: ``intermediate_size_per_partition`` divisible by 32);
* replicated: everything else (norms, biases, routers, MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa``);
* with expert parallelism (``ep``), fused expert tensors are split by expert (dim 0) over all ``tp * ep``
  ranks instead (vLLM's expert parallel size is its TP x DP size; ``tp=8,ep=16`` is TP 8 attention in 16 data
  parallel groups, and 128 ranks of experts).

Every rank of a pipeline stage holds one slice of each of the stage's tensors, so an engine of ``tp * ep``
ranks per stage receives ``tp * ep`` slices of each tensor (replicated tensors whole, in every rank).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from .formats import BLOCK_SIZE, ceil_div

DIMS = ("fsdp", "tp", "pp", "ep")

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj|w1|w3)\.weight$")
_ROW = re.compile(r"\.(o_proj|down_proj|w2|dense)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head|wte)\.weight$")
_EXPERTS_COLUMN = re.compile(r"\.experts\.gate_up_proj$")
_EXPERTS_ROW = re.compile(r"\.experts\.down_proj$")
_KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
#: a column-parallel layer's bias: split like its rows (a row-parallel bias stays whole on every rank)
_COLUMN_BIAS = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)\.bias$")


@dataclass(frozen=True)
class Layout:
    """A parallel layout: sizes of the fsdp, tp, pp and ep dimensions (each >= 1)."""

    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layout dimension {f.name} must be an int >= 1, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``"tp=2,pp=2"`` -> ``Layout(tp=2, pp=2)``; ``""`` or ``"1"`` -> one rank.

        Raises:
            ValueError: an unknown dimension, a repeated one, or a size that is not a positive integer.
        """
        if not isinstance(text, str):
            raise TypeError(f"a layout is a string like 'tp=2,pp=2', got {type(text).__name__}")
        sizes: dict[str, int] = {}
        for term in (t.strip() for t in text.split(",")):
            if term in ("", "1"):
                continue
            name, sep, value = term.partition("=")
            name = name.strip().lower()
            if not sep or name not in DIMS:
                raise ValueError(f"layout term {term!r}: expected DIM=N with DIM one of {', '.join(DIMS)}")
            if name in sizes:
                raise ValueError(f"layout {text!r} names {name} twice")
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"layout term {term!r}: N must be a positive integer")
            sizes[name] = int(value)
        return cls(**sizes)

    @property
    def ranks(self) -> int:
        """Number of ranks: the product of the dimensions."""
        return self.fsdp * self.tp * self.pp * self.ep

    def __str__(self) -> str:
        terms = [f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) > 1]
        return ",".join(terms) or "1"


@dataclass(frozen=True)
class Shard:
    """How one tensor is held by an engine rank.

    Attributes:
        dim: the split dimension (negative index), or None when every rank holds the whole tensor.
        parts: how many distinct slices the tensor is cut into along ``dim`` (1 when replicated; fewer than
            the ranks when slices are replicated, e.g. KV heads).
        shape: the shape one rank holds.
        problem: why an MXFP8 consumer cannot take this slice (K per rank not a multiple of 32; a fused
            gate_up with an odd row count), or "".
        blocks: along ``dim`` the tensor is this many equal blocks of consecutive rows, each cut in ``parts``;
            a rank holds its part of every block, in block order (2 for the fused ``experts.gate_up_proj``
            at tp > 1: its gate rows, then its up rows; see the module doc), else 1. ``shape`` is the rank's
            whole slice (all its blocks together).
    """

    dim: int | None
    parts: int
    shape: tuple[int, ...]
    problem: str = ""
    blocks: int = 1

    def ranges(self, size: int, part: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges along ``dim`` (of full size ``size``) that part ``part`` holds: one
        per block, in order (one range when ``blocks`` is 1)."""
        if self.dim is None:
            return [(0, size)]
        block, step = size // self.blocks, self.shape[self.dim] // self.blocks
        out = []
        for b in range(self.blocks):
            lo = min(part * step, block)
            out.append((b * block + lo, b * block + min(lo + step, block)))
        return out


ENGINES = ("mxport", "vllm")


def parse_engine(text: str) -> tuple[str, Layout]:
    """``mxport refit --engine``: an engine name, a layout, or both, comma-separated (``vllm``, ``tp=2``,
    ``vllm,tp=2``); the name defaults to ``mxport``, the layout to one rank.

    Raises:
        ValueError: an unknown engine name, two names, or a bad layout term.
    """
    if not isinstance(text, str):
        raise TypeError(f"an engine is a string like 'vllm,tp=2', got {type(text).__name__}")
    layout = [t for t in text.split(",") if "=" in t or t.strip() == "1"]  # "1": one rank, as str(Layout())
    names = [t.strip().lower() for t in text.split(",") if t.strip() and t not in layout]
    terms = ",".join(layout)
    if len(names) > 1 or (names and names[0] not in ENGINES):
        raise ValueError(f"--engine {text!r}: expected an engine name ({', '.join(ENGINES)}), "
                         "a layout (tp=N) or both, comma-separated")
    return (names[0] if names else "mxport"), Layout.parse(terms)


def _split(shape: tuple[int, ...], dim: int, parts: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = ceil_div(out[dim], parts)
    return tuple(out)


def _column_problem(name: str, shape: tuple[int, ...], parts: int, blocks: int = 1) -> str:
    """Why vLLM cannot take an MXFP8 column-parallel tensor cut in ``parts`` slices of each of its
    ``blocks`` row blocks, or "": its rows must split evenly; a fused expert gate_up's slice of I
    (``intermediate_size_per_partition``) must be whole blocks, as the K of the down projection (vLLM
    ``ModelOptMxFp8FusedMoE.create_weights``). A K that is not whole blocks is refused at any tp (export).
    """
    rows = shape[-2] // blocks
    if shape[-2] % blocks or rows % parts:
        return f"{name}: {shape[-2]} rows do not split into {blocks * parts} equal slices (tp={parts})"
    if blocks == 2 and (rows // parts) % BLOCK_SIZE:
        return (f"{name}: I={rows} split over tp={parts} gives {rows // parts} per rank, not a multiple of "
                f"{BLOCK_SIZE} (vLLM's MXFP8 MoE requires intermediate_size_per_partition divisible by 32)")
    return ""


def _row_problem(name: str, shape: tuple[int, ...], tp: int) -> str:
    """Why vLLM cannot take an MXFP8 row-parallel tensor whose K is split over ``tp`` ranks, or ""."""
    if shape[-1] % tp or (shape[-1] // tp) % BLOCK_SIZE:
        return (f"{name}: K={shape[-1]} split over tp={tp} gives {shape[-1] / tp:g} per rank, not a multiple "
                f"of {BLOCK_SIZE} (MXFP8 blocks would straddle ranks)")
    return ""


def engine_shard(name: str, shape: tuple[int, ...], engine: Layout, *, kv_heads: int | None = None,
                 quantized: bool = False) -> Shard:
    """The slice of tensor ``name`` (full ``shape``) that one rank of an ``engine`` layout holds.

    See the module doc. With ``quantized`` (an MXFP8 tensor) and tp > 1, :attr:`Shard.problem` says why
    vLLM would refuse the slice: row parallel, K / tp not a multiple of 32; column parallel, rows that do not
    split evenly, or a fused expert gate_up's I / tp not a multiple of 32. (A whole K that is not a multiple
    of 32 is no slicing matter: ``mxport export`` refuses it, vLLM refuses it at any tp.)
    """
    shape = tuple(int(s) for s in shape)
    tp, ep = engine.tp, engine.ep
    if ep > 1 and len(shape) == 3 and (_EXPERTS_COLUMN.search(name) or _EXPERTS_ROW.search(name)):
        return Shard(0, tp * ep, _split(shape, 0, tp * ep))
    if tp > 1 and len(shape) == 1 and _COLUMN_BIAS.search(name):
        parts = min(tp, kv_heads) if kv_heads and _KV.search(name) else tp
        return Shard(0, parts, _split(shape, 0, parts))
    if tp == 1 or len(shape) < 2:
        return Shard(None, 1, shape)
    if _EXPERTS_COLUMN.search(name) and len(shape) == 3:  # gate | up, each split (vLLM w13)
        problem = "" if shape[-2] % 2 == 0 else f"{name}: {shape[-2]} rows cannot be gate | up halves"
        problem = problem or (_column_problem(name, shape, tp, blocks=2) if quantized else "")
        held = (*shape[:-2], 2 * ceil_div(shape[-2] // 2, tp), shape[-1])
        return Shard(-2, tp, held, problem, blocks=2)
    if _COLUMN.search(name) or _VOCAB.search(name) or _EXPERTS_COLUMN.search(name):
        parts = min(tp, kv_heads) if kv_heads and _KV.search(name) else tp
        problem = _column_problem(name, shape, parts) if quantized else ""
        return Shard(-2, parts, _split(shape, -2, parts), problem)
    if _ROW.search(name) or _EXPERTS_ROW.search(name):
        return Shard(-1, tp, _split(shape, -1, tp), _row_problem(name, shape, tp) if quantized else "")
    return Shard(None, 1, shape)


def attention_problem(tp: int, heads: int | None, kv_heads: int | None) -> str:
    """Why vLLM refuses tensor parallel size ``tp`` for ``heads`` attention heads and ``kv_heads`` KV heads,
    or "": the attention heads must divide by ``tp`` (``ModelConfig.verify_with_parallel_config``); the KV
    heads must divide by ``tp``, or divide it when fewer (each then replicated, ``QKVParallelLinear``)."""
    def refused(t: int) -> bool:
        return bool(t > 1 and ((heads and heads % t)
                               or (kv_heads and (kv_heads % t if kv_heads >= t else t % kv_heads))))

    if not refused(tp):
        return ""
    fits = ", ".join(str(t) for t in range(1, (heads or kv_heads or tp) + 1) if not refused(t))
    if heads and heads % tp:
        why = f"{heads} attention heads do not divide by tp={tp}"
    else:
        why = f"{kv_heads} KV heads and tp={tp}: one must divide the other"
    return f"{why} (vLLM refuses this layout; tp can be {fits})"


def mxfp8_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of a rowwise MXFP8 tensor of ``shape``: one FP8 byte per element plus one E8M0 byte per block."""
    if not shape:
        return 1
    rows = math.prod(shape[:-1])
    return rows * shape[-1] + rows * ceil_div(shape[-1], BLOCK_SIZE)
