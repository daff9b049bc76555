"""The precision policy: which tensors of a model become MXFP8 and which stay in high precision, and why.

One object used by export, verify and refit alike. Input is the model's tensors in model order as
``(name, shape, dtype)`` entries (a safetensors header, a ``state_dict()``); output is one :class:`Decision`
per entry, each with a one-line reason (what ``mxport export --dry-run`` prints).

Default rules (in this order; the first that applies gives the reason):

1. kept: anything that is not a floating tensor (int buffers, already-FP8 values), or has fewer than 2
   dimensions (norms' weights, biases, 1-D buffers);
2. kept: embeddings (a module name part containing ``embed``, or ``wte`` / ``wpe``), the output head
   (``lm_head``), norms (a part containing ``norm`` or starting ``ln``), MoE routers (last module part
   ``gate`` / ``router`` / ``*_gate`` other than ``gate_proj``, e.g. ``mlp.gate``, ``block_sparse_moe.gate``);
3. quantized candidates: 2-D ``*.weight`` tensors (the weights of linear layers, [N, K] with K the input
   dimension) and fused 3-D expert weights under an ``experts`` module ([E, N, K], e.g.
   ``mlp.experts.gate_up_proj``); any other tensor is kept ("not a linear or expert weight");
4. user rules on candidates: ``exclude`` patterns keep a match; when ``include`` patterns are given, a
   candidate that matches none is kept; ``keep_first`` / ``keep_last`` keep the first / last N decoder layers
   (layer index from a ``.layers.<i>.`` / ``.h.<i>.`` / ``.blocks.<i>.`` part of the name, layer count =
   largest index + 1);
5. all experts of one MoE layer share one precision: if a user rule keeps any expert weight under
   ``<prefix>.experts.``, every expert weight under that prefix is kept (vLLM's FusedMoE takes one quant
   method per layer);
6. likewise ``q_proj`` / ``k_proj`` / ``v_proj`` of one attention and ``gate_proj`` / ``up_proj`` of one MLP
   share one precision (vLLM fuses them into ``qkv_proj`` / ``gate_up_proj`` and rejects mixed shards); see
   :func:`share_group`.

Patterns are shell-style (:func:`fnmatch.fnmatchcase`: ``*``, ``?``, ``[seq]``; ``*`` also matches dots) and
are tried against both the tensor name (``model.layers.0.mlp.down_proj.weight``) and its module name (the name
without a trailing ``.weight``: ``model.layers.0.mlp.down_proj``). Examples: ``--exclude '*.mlp.*'``,
``--exclude 'model.layers.0.*'``, ``--include '*q_proj'``.

Tied embeddings are not a policy matter: the embedding is kept (rule 2) and written once by the writers.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .formats import FLOAT_DTYPES, SAFETENSORS_DTYPES

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
_EXPERTS_RE = re.compile(r"^(.*?\.experts)(?:\.|$)")



def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if dtype.upper() in SAFETENSORS_DTYPES:
            return SAFETENSORS_DTYPES[dtype.upper()]
        if isinstance(getattr(torch, key, None), torch.dtype):
            return getattr(torch, key)
    raise TypeError(f"entry dtype must be a torch.dtype or a safetensors dtype name like 'BF16', "
                    f"got {dtype!r}")


def module_name(name: str) -> str:
    """The module a tensor belongs to: ``name`` without a trailing ``.weight`` (3-D expert tensors such as
    ``mlp.experts.gate_up_proj`` are their own module name)."""
    return name.removesuffix(".weight")


def layer_index(name: str) -> int | None:
    """The decoder layer index in ``name`` (``model.layers.7.mlp...`` -> 7).

    None outside the layer stack."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def experts_prefix(name: str) -> str | None:
    """``model.layers.0.mlp.experts`` for any tensor under an ``experts`` module, else None."""
    m = _EXPERTS_RE.match(name)
    return m.group(1) if m else None


_FUSED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")


def share_group(name: str) -> tuple[str, str] | None:
    """The group of weights that must share one precision, as (key, description), or None.

    * every weight under ``<prefix>.experts`` (one MoE layer: vLLM's FusedMoE takes one quant method);
    * ``q_proj`` / ``k_proj`` / ``v_proj`` of one attention and ``gate_proj`` / ``up_proj`` of one MLP (vLLM
      loads them into one fused ``qkv_proj`` / ``gate_up_proj`` layer and rejects shards of mixed precision).
    """
    prefix = experts_prefix(name)
    if prefix:
        return prefix, "experts of one MoE layer"
    m = _FUSED_RE.match(name)
    if m:
        if m.group(2) in ("q_proj", "k_proj", "v_proj"):
            return f"{m.group(1)}.qkv_proj", "q/k/v projections fused into one qkv_proj by vLLM"
        return f"{m.group(1)}.gate_up_proj", "gate/up projections fused into one gate_up_proj by vLLM"
    return None


_W13_RE = re.compile(r"^(.*\.experts\.\d+)\.(w1|w3)\.weight$")
_MLA_A_RE = re.compile(r"^(.*)\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")


def global_scale_group(name: str) -> str:
    """The key of the weights that share one NVFP4 global scale with ``name`` (ModelOpt and llmcompressor
    share it where vLLM fuses: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, one expert's w1/w3
    into its ``w13``, MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``); ``name`` itself
    otherwise."""
    m = _FUSED_RE.match(name)
    if m:
        fused = "qkv_proj" if m.group(2) in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
        return f"{m.group(1)}.{fused}"
    m = _W13_RE.match(name)
    if m:
        return f"{m.group(1)}.w13"
    m = _MLA_A_RE.match(name)
    return f"{m.group(1)}.fused_qkv_a_proj" if m else name


@dataclass(frozen=True)
class Decision:
    """The policy's verdict on one tensor.

    Attributes:
        name: tensor name as in the checkpoint / ``state_dict``.
        shape: the tensor's shape (tuple of ints).
        dtype: the source dtype (torch.dtype).
        quantize: True when the tensor is written as MXFP8 (rowwise values + compact E8M0 scales).
        reason: one line saying which rule decided it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quantize: bool
    reason: str

    @property
    def module(self) -> str:
        """The module name (``name`` without ``.weight``)."""
        return module_name(self.name)

    def to_dict(self) -> dict:
        """JSON-able form: name, shape, dtype (e.g. "bfloat16"), quantize, reason."""
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "quantize": self.quantize, "reason": self.reason}


def _parts(name: str) -> list[str]:
    return module_name(name).split(".")


def _structural_keep_reason(name: str) -> str | None:
    """Rule 2: embeddings, lm_head, norms, routers (by module name parts)."""
    parts = _parts(name)
    for p in parts:
        low = p.lower()
        if "embed" in low or low in ("wte", "wpe"):
            return "embedding (kept in high precision)"
        if low == "lm_head" or low == "output_layer":
            return "output head lm_head (kept in high precision)"
        if "norm" in low or low.startswith("ln_") or low in ("ln", "ln_f"):
            return "norm (kept in high precision)"
    last = parts[-1].lower()
    if last in ("gate", "router", "router_logits", "shared_expert_gate") or "router" in last or (
            last.endswith("_gate") and last != "gate_proj"):
        return "MoE router (kept in high precision)"
    return None


def _matches(name: str, patterns: Sequence[str]) -> str | None:
    mod = module_name(name)
    for pat in patterns:
        if fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(mod, pat):
            return pat
    return None


def _check_patterns(patterns, argname: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str) or not p:
            raise TypeError(f"{argname} must be a sequence of non-empty pattern strings, got {p!r}")
    return out


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which tensors are quantized to MXFP8 (see the module docstring for the rules and pattern syntax).

    Args:
        include: fnmatch patterns; when non-empty only matching candidates are quantized.
        exclude: fnmatch patterns; matching candidates are kept in high precision.
        keep_first: keep the first N decoder layers in high precision (N >= 0).
        keep_last: keep the last N decoder layers in high precision (N >= 0).

    Raises:
        TypeError: a pattern that is not a non-empty string; a non-int ``keep_first`` / ``keep_last``.
        ValueError: a negative ``keep_first`` / ``keep_last``.
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    keep_first: int = 0
    keep_last: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", _check_patterns(self.include, "include"))
        object.__setattr__(self, "exclude", _check_patterns(self.exclude, "exclude"))
        for arg in ("keep_first", "keep_last"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{arg} must be an int number of layers, got {v!r}")
            if v < 0:
                raise ValueError(f"{arg} must be >= 0, got {v}")

    def to_dict(self) -> dict:
        return {"include": list(self.include), "exclude": list(self.exclude), "keep_first": self.keep_first,
                "keep_last": self.keep_last}

    def decide_all(self, entries: Iterable[tuple[str, Sequence[int], torch.dtype | str]]) -> list[Decision]:
        """One :class:`Decision` per ``(name, shape, dtype)`` entry, in the order given (model order).

        ``dtype`` is a torch.dtype or a safetensors dtype name ("BF16", "F32", ...). Decisions depend on the
        whole list (layer count for ``keep_last``, MoE groups), hence one call for all entries.

        Raises:
            TypeError: an entry that is not a (str, shape, dtype) triple.
            ValueError: a name given twice.
        """
        norm: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        seen: set[str] = set()
        for e in entries:
            if not (isinstance(e, (tuple, list)) and len(e) == 3 and isinstance(e[0], str)):
                raise TypeError(f"entries must be (name, shape, dtype) tuples, got {e!r}")
            name, shape, dtype = e
            if name in seen:
                raise ValueError(f"entries name {name!r} twice")
            seen.add(name)
            norm.append((name, tuple(int(s) for s in shape), _as_dtype(dtype)))

        layers = [i for i in (layer_index(n) for n, _, _ in norm) if i is not None]
        n_layers = max(layers) + 1 if layers else 0
        first_kept = set(range(min(self.keep_first, n_layers)))
        last_kept = set(range(max(n_layers - self.keep_last, 0), n_layers))

        out: list[Decision] = []
        user_kept: dict[str, str] = {}  # share group -> reason of a user-kept member
        for name, shape, dtype in norm:
            quant, reason = self._decide_one(name, shape, dtype, first_kept, last_kept)
            out.append(Decision(name, shape, dtype, quant, reason))
            group = share_group(name)
            if group and not quant and reason.startswith("kept by") and group[0] not in user_kept:
                user_kept[group[0]] = f"{name}: {reason}"
        if user_kept:  # rules 5 and 6: one precision per MoE layer / per engine-fused projection
            for i, d in enumerate(out):
                group = share_group(d.name)
                if d.quantize and group and group[0] in user_kept:
                    out[i] = Decision(d.name, d.shape, d.dtype, False,
                                      f"kept: {group[1]} share one precision ({user_kept[group[0]]})")
        return out

    def _decide_one(self, name, shape, dtype, first_kept, last_kept) -> tuple[bool, str]:
        if dtype not in FLOAT_DTYPES:
            return False, f"not a floating tensor ({str(dtype).removeprefix('torch.')}): kept as is"
        if len(shape) < 2:
            return False, f"{len(shape)}-D tensor (bias, norm or buffer): kept"
        structural = _structural_keep_reason(name)
        if structural:
            return False, structural
        if len(shape) == 2 and name.endswith(".weight"):
            kind = "linear weight"
        elif len(shape) == 3 and experts_prefix(name) and not name.endswith("bias"):
            kind = "fused expert weight [E, N, K]"
        else:
            return False, f"not a linear or expert weight ({len(shape)}-D): kept"
        pat = _matches(name, self.exclude)
        if pat:
            return False, f"kept by --exclude {pat!r}"
        if self.include and not _matches(name, self.include):
            return False, "kept by --include (matches no include pattern)"
        idx = layer_index(name)
        if idx is not None and idx in first_kept:
            return False, f"kept by --keep-first {self.keep_first} (layer {idx})"
        if idx is not None and idx in last_kept:
            return False, f"kept by --keep-last {self.keep_last} (layer {idx})"
        return True, f"{kind}: MXFP8"

    def decide_model(self, model: torch.nn.Module) -> dict[str, Decision]:
        """Decisions for an ``nn.Module``'s ``state_dict()`` entries, keyed by tensor name, in model order.

        Tied parameters appear under each of their names (e.g. ``lm_head.weight`` and the embedding); both are
        kept by rule 2.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        entries = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()]
        return {d.name: d for d in self.decide_all(entries)}

    def decide_module_names(self, model: torch.nn.Module) -> dict[str, Decision]:
        """Decisions for the ``*.weight`` tensors of ``model`` keyed by module name
        (``model.layers.0.self_attn.q_proj``): which ``nn.Linear`` modules to convert to MXFP8."""
        return {d.module: d for d in self.decide_model(model).values() if d.name.endswith(".weight")}


def decide_all(entries, policy: PrecisionPolicy | None = None) -> list[Decision]:
    """``(policy or PrecisionPolicy()).decide_all(entries)``."""
    return (policy or PrecisionPolicy()).decide_all(entries)


def decide_module_names(model: torch.nn.Module, policy: PrecisionPolicy | None = None) -> dict[str, Decision]:
    """``(policy or PrecisionPolicy()).decide_module_names(model)``."""
    return (policy or PrecisionPolicy()).decide_module_names(model)


def exclude_modules(decisions: Iterable[Decision]) -> list[str]:
    """Module names of the kept 2-D / 3-D weights that an engine would otherwise quantize (linear weights,
    ``lm_head``, expert weights): the checkpoint config's exclude / ignore list, in model order, each once.

    Embeddings, norms, 1-D tensors are not listed (engines never quantize them); ``lm_head`` is listed, as
    ModelOpt does. For MoE layers kept whole, the ``<prefix>.experts`` module is listed once.
    """
    out: dict[str, None] = {}
    for d in decisions:
        if d.quantize or len(d.shape) < 2 or d.dtype not in FLOAT_DTYPES:
            continue
        parts = [p.lower() for p in _parts(d.name)]
        if any("embed" in p or "norm" in p for p in parts):
            continue
        prefix = experts_prefix(d.name)
        if prefix:
            out.setdefault(prefix)
        elif d.name.endswith(".weight"):
            out.setdefault(d.module)
    return list(out)
