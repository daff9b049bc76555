"""Fused 3-D expert tensors <-> the per-expert names engines load.

``transformers`` 5 holds a MoE layer's experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, K]``, gate
rows first, ``mlp.experts.down_proj`` ``[E, H, I]``) and converts them back to the checkpoint's per-expert
names when it saves (``transformers/conversion_mapping.py``): Mixtral's
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), and for the ``qwen2_moe`` family
(Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, ...) ``mlp.experts.{e}.gate_proj`` / ``up_proj`` /
``down_proj``. vLLM's loaders read those names (``RoutedExperts.build_expert_params_mapping``:
``experts.{e}.{ckpt name}.`` -> ``w13_`` / ``w2_``, scales included); a fused ``mlp.experts.gate_up_proj``
in a Mixtral checkpoint matches no module of vLLM's ``MixtralModel`` (its experts live under
``block_sparse_moe``; its fused names would be ``experts.w13`` / ``experts.w2``). So export writes experts
per expert under these names (scales ``<name>.weight_scale`` / ``_scale_inv`` as every other weight), and
:func:`mxport.nn.load_checkpoint` fuses them back.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: model types whose checkpoints name experts as Mixtral does (transformers' "mixtral" conversion and aliases)
MIXTRAL_TYPES = ("mixtral", "minimax", "minimax_m2")
#: model types whose checkpoints name experts ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``
#: (transformers' "qwen2_moe" conversion, which these model types share)
QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "olmoe", "flex_olmo",
                  "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4v_moe", "dots1", "ernie4_5_moe",
                  "hunyuan_v1_moe", "exaone_moe", "solar_open")

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<attr>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.weight$")
#: per-expert weight name -> (fused attribute, which half of gate_up: 0 gate, 1 up; None for down)
_PART = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
         "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


@dataclass(frozen=True)
class ExpertNaming:
    """How one model family's checkpoints name experts: ``module`` replaces ``.mlp.`` in every tensor name
    (Mixtral: ``.block_sparse_moe.``; None: names stay); ``gate`` / ``up`` / ``down``: the per-expert
    weights."""

    model_type: str
    module: str | None
    gate: str
    up: str
    down: str

    def rename(self, name: str) -> str:
        """``name`` as the checkpoint calls it (module names too: the exclude list)."""
        return name.replace(".mlp.", f".{self.module}.") if self.module else name

    def split(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int]] | None:
        """For a fused expert tensor: its per-expert output tensors as ``(name, first row, end row)`` over the
        rows of its ``(E * N, K)`` view, in order (gate before up for each expert); None for any other."""
        m = _FUSED.match(name)
        if not m or len(shape) != 3:
            return None
        prefix, (e_count, n, _) = self.rename(m.group("prefix")), shape
        if m.group("attr") == "down_proj":
            return [(f"{prefix}.{e}.{self.down}.weight", e * n, (e + 1) * n) for e in range(e_count)]
        if n % 2:
            raise ValueError(f"{name}: {n} rows cannot be gate | up halves")
        half = n // 2
        return [(f"{prefix}.{e}.{w}.weight", e * n + i * half, e * n + (i + 1) * half)
                for e in range(e_count) for i, w in enumerate((self.gate, self.up))]


def expert_naming(config: dict | None) -> ExpertNaming | None:
    """The naming of ``config``'s model type (``config.json`` dict), or None when mxport does not know it."""
    model_type = str((config or {}).get("model_type") or "")
    if model_type in MIXTRAL_TYPES:
        return ExpertNaming(model_type, "block_sparse_moe", "w1", "w3", "w2")
    if model_type in QWEN_MOE_TYPES:
        return ExpertNaming(model_type, None, "gate_proj", "up_proj", "down_proj")
    return None


def fused_names(names) -> list[str]:
    """The fused 3-D expert tensor names among ``names`` (``...experts.gate_up_proj`` / ``...down_proj``)."""
    return [n for n in names if _FUSED.match(n)]


def checkpoint_naming(config: dict | None, names) -> ExpertNaming | None:
    """The naming an export of tensors ``names`` (source names) uses: None when there are no fused experts
    (names are written as they are).

    Raises:
        ValueError: fused experts of a model type whose per-expert names mxport does not know (one line).
    """
    fused = fused_names(names)
    if not fused:
        return None
    naming = expert_naming(config)
    if naming is None:
        model_type = (config or {}).get("model_type")
        raise ValueError(f"fused 3-D experts ({fused[0]!r} and {len(fused) - 1} more) of model type "
                         f"{model_type!r}: engines load experts under their checkpoint's per-expert names, "
                         f"which mxport knows for {', '.join(MIXTRAL_TYPES + QWEN_MOE_TYPES)} only")
    return naming


def per_expert_part(name: str) -> tuple[str, str, int, int | None] | None:
    """``(prefix, fused attribute, expert, half)`` of a per-expert checkpoint weight name
    (``...experts.3.w1.weight`` -> ``("...experts", "gate_up_proj", 3, 0)``), or None."""
    m = _PER_EXPERT.match(name)
    if not m:
        return None
    attr, half = _PART[m.group("w")]
    return m.group("prefix"), attr, int(m.group("e")), half


def parts_of(shape: tuple[int, ...], attr: str) -> int:
    """How many per-expert pieces make the fused tensor ``attr`` of ``shape`` (E for down, 2E for gate_up)."""
    return math.prod(shape[:1]) * (2 if attr == "gate_up_proj" else 1)
