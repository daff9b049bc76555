"""The ``mxport verify`` pipeline: how far an MXFP8 twin of a model drifts from the model itself.

1. Load the source model (float32; default: the embedded SmolLM2-135M-Instruct) and build its MXFP8 twin: a
   deep copy whose policy linears become :class:`mxport.nn.MXFP8Linear` and whose fused 3-D expert weights
   (MoE) become MXFP8 (:class:`mxport.nn.MXFP8Experts`) (:func:`mxport.nn.quantize_model`), or a deep copy
   filled from an exported checkpoint (:func:`mxport.nn.load_checkpoint`).
2. Generate greedily from chat prompts (the tokenizer's chat template; left-padded batches through
   ``model.generate``) with the MXFP8 twin — the rollout engine.
3. Score prompt + generated tokens with both models (teacher forcing, full next-token distributions) and
   compare them at the generated positions: :func:`mxport.metrics.gen_kl_error` KL(P_mxfp8 || P_source),
   :func:`~mxport.metrics.token_mult_prob_error`, :func:`~mxport.metrics.greedy_agreement`; plus the weight
   SQNR of every quantized tensor.
4. Optional per-layer sweep: the twin with only decoder layer *i* quantized (every other layer's linears and
   experts modules swapped back to the source modules) gives layer *i*'s KL and its share of the sum; then
   layers are kept in high precision greedily by share, re-measuring after each, until the KL is at most
   ``target_kl``. The sweep scores the tokens generated in step 2 (teacher forcing; no regeneration per
   configuration).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .formats import element_format
from .metrics import gen_kl_error, greedy_agreement, sqnr_db, token_logprobs, token_mult_prob_error
from .nn import (
    MXFP8Experts,
    load_checkpoint,
    mxfp8_experts,
    mxfp8_modules,
    planned_experts,
    planned_linears,
    planned_modules,
    quantize_model,
)
from .policy import layer_index
from .prompts import load_prompts

Progress = Callable[[str, int, int], None]


def _noop(stage: str, done: int, total: int) -> None:
    return None


@dataclass
class Rollouts:
    """Token ids of each prompt (1-D long) and of what the MXFP8 model generated after it (1-D long)."""

    prompts: list[torch.Tensor]
    generated: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return sum(int(g.numel()) for g in self.generated)


@dataclass
class Scores:
    """Per generated position, concatenated over prompts: the source model's log-probs (float32 ``[T, V]``),
    kept so that other configurations can be compared with it, and the generated token ids ``[T]``."""

    logp: torch.Tensor
    tokens: torch.Tensor


def build_twin(model: nn.Module, *, checkpoint: str | os.PathLike | None = None, policy=None,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn, activation: str = "none",
               progress: Progress = _noop) -> nn.Module:
    """A deep copy of ``model`` with MXFP8 linears and fused experts: quantized per ``policy`` (default policy
    when None), or loaded from ``checkpoint`` (an ``mxport export`` directory; its element format wins over
    ``fp8_dtype``).

    Raises ValueError when the result has no MXFP8 layer (nothing to verify) or the checkpoint does not match.
    """
    twin = copy.deepcopy(model)
    if checkpoint is not None:
        load_checkpoint(twin, checkpoint, activation=activation)
    else:
        names = planned_modules(twin, policy)
        done = iter(range(1, len(names) + 1))
        quantize_model(twin, fp8_dtype=fp8_dtype, activation=activation, modules=names,
                       progress=lambda _name: progress("quantize", next(done), len(names)))
    if not quantized_modules(twin):
        raise ValueError("the MXFP8 twin has no MXFP8 layer (the policy kept every linear layer)")
    return twin


#: the weight formats ``verify`` measures: MXFP8 (the twin's MXFP8 modules) or a 4-bit format of
#: :mod:`mxport.fp4` (weight-only: the same tensors quantized and decoded in place)
QUANTS = ("mxfp8", "mxfp4", "nvfp4")


@torch.no_grad()
def build_fp4_twin(model: nn.Module, quant: str, *, policy=None, progress: Progress = _noop
                   ) -> tuple[nn.Module, dict[str, float]]:
    """A deep copy of ``model`` whose weights that MXFP8 would quantize under ``policy`` (the planned linears
    and fused-expert weights) hold their ``quant`` (``"mxfp4"`` / ``"nvfp4"``) decoded values, in their own
    dtype: weight-only fake quantization, each tensor quantized along its last dimension (NVFP4's global scale
    shared where vLLM fuses, as ``mxport export --quant nvfp4`` writes it:
    :func:`mxport.fp4_linear.shared_global_scales`). Returns ``(twin, {name: weight SQNR dB})``, keyed as
    :func:`weight_sqnr` keys (a linear by module name, an expert weight by tensor name).

    Raises ValueError when nothing is planned, or naming a tensor whose last dimension is not a multiple of
    the format's block."""
    from .fp4 import quantize_fp4
    from .fp4_linear import shared_global_scales

    twin = copy.deepcopy(model)
    tensors = [(n, f"{n}.weight") for n in planned_linears(twin, policy)]
    tensors += [(f"{m}.{w}", f"{m}.{w}") for m, ws in planned_experts(twin, policy).items() for w in ws]
    if not tensors:
        raise ValueError(f"the {quant} twin has no quantized weight (the policy kept every linear layer)")
    sqnr = {}
    shared = shared_global_scales({name: twin.get_parameter(name) for _, name in tensors}, quant)
    for i, (key, name) in enumerate(tensors, 1):
        p = twin.get_parameter(name)
        try:
            kwargs = {"global_scale": shared[name]} if name in shared else {}
            decoded = quantize_fp4(p.detach(), quant, **kwargs).dequantize(torch.float32)
        except ValueError as exc:
            raise ValueError(f"{name} {tuple(p.shape)}: {exc}") from exc
        p_ref = p.detach().float().clone()
        p.copy_(decoded.to(p.dtype))  # NVFP4's scale * global may round again in a BF16 weight
        sqnr[key] = sqnr_db(p_ref, p.detach().float())
        progress("quantize", i, len(tensors))
    return twin, sqnr


def weight_sqnr(source: nn.Module, twin: nn.Module) -> dict[str, float]:
    """``{name: SQNR dB}`` of each MXFP8Linear weight of ``twin`` (keyed by module name) and of each MXFP8
    fused expert weight (keyed by tensor name, ``...mlp.experts.gate_up_proj``) against the same weight in
    ``source`` (:func:`mxport.metrics.sqnr_db`)."""
    out = {}
    for name, mod in mxfp8_modules(twin).items():
        ref = source.get_submodule(name).weight.detach().float()
        out[name] = sqnr_db(ref, mod.decoded_weight(torch.float32).to(ref.device))
    for name, mod in mxfp8_experts(twin).items():
        for w in mod._mx_weights:
            ref = getattr(source.get_submodule(name), w).detach().float()
            out[f"{name}.{w}"] = sqnr_db(ref, mod.decoded_weight(w, torch.float32).to(ref.device))
    return out


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the MXFP8 modules of ``model``: :class:`~mxport.nn.MXFP8Linear` and
    :class:`~mxport.nn.MXFP8Experts`, in model order."""
    mx = {**mxfp8_modules(model), **mxfp8_experts(model)}
    return {n: mx[n] for n, _ in model.named_modules() if n in mx}


def encode_prompts(tokenizer, conversations: list[list[dict]]) -> list[torch.Tensor]:
    """Token ids of each conversation through the tokenizer's chat template with the generation prompt added
    (plain text of the user turns joined by newlines when the tokenizer has no template)."""
    out = []
    for conv in conversations:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in conv))["input_ids"]
        t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"prompt {conv!r:.60} encodes to no token")
        out.append(t)
    return out


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids


@torch.no_grad()
def generate_greedy(model: nn.Module, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: set[int],
                    progress: Progress = _noop, *, pad_id: int = 0,
                    batch_size: int = 8) -> list[torch.Tensor]:
    """Greedy decoding (argmax, KV cache) with ``model.generate``, ``batch_size`` left-padded prompts at a
    time,
    up to ``max_new_tokens`` tokens or an EOS token (included). Returns the generated ids of each prompt (1-D
    long, at least one token)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    eos = sorted(eos_ids)
    out: list[torch.Tensor] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        width = max(int(p.numel()) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, width - p.numel():] = p
            mask[row, width - p.numel():] = 1
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=1,
                              pad_token_id=pad_id, eos_token_id=eos or None, temperature=None, top_p=None,
                              top_k=None)
        for row in range(len(chunk)):
            gen = seqs[row, width:].cpu()
            hits = [i for i, t in enumerate(gen.tolist()) if t in eos_ids]
            out.append(gen[: hits[0] + 1] if hits else gen)
        progress("generate", len(out), len(prompts))
    return out


@torch.no_grad()
def score(model: nn.Module, rollouts: Rollouts, batch_size: int = 8) -> Scores:
    """Teacher-forced next-token log-probs of ``model`` at the generated positions of ``rollouts``: float32
    ``[T, V]`` (T = all generated tokens, prompt order), right-padded batches of ``batch_size`` sequences."""
    device = next(model.parameters()).device
    logps, toks = [], []
    seqs = [torch.cat([p, g]) for p, g in zip(rollouts.prompts, rollouts.generated, strict=True)]
    for start in range(0, len(seqs), batch_size):
        chunk = list(range(start, min(start + batch_size, len(seqs))))
        width = max(int(seqs[i].numel()) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : seqs[i].numel()] = seqs[i]
            mask[row, : seqs[i].numel()] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        for row, i in enumerate(chunk):
            p, g = rollouts.prompts[i].numel(), rollouts.generated[i].numel()
            logps.append(torch.log_softmax(logits[row, p - 1: p - 1 + g].float(), dim=-1).cpu())
            toks.append(rollouts.generated[i])
        del logits
    return Scores(torch.cat(logps), torch.cat(toks))


def compare(gen: Scores, train: Scores) -> dict:
    """The fidelity figures of the generation model's ``gen`` scores against the training model's ``train``:
    ``gen_kl_error_mean``, ``gen_kl_error_max``, ``token_mult_prob_error``, ``greedy_agreement``,
    ``tokens``."""
    kl = gen_kl_error(gen.logp, train.logp)
    return {
        "gen_kl_error_mean": kl["mean"],
        "gen_kl_error_max": kl["max"],
        "token_mult_prob_error": token_mult_prob_error(token_logprobs(gen.logp, gen.tokens),
                                                       token_logprobs(train.logp, train.tokens)),
        "greedy_agreement": greedy_agreement(gen.logp, train.logp),
        "tokens": int(gen.tokens.numel()),
    }


def _set_quantized(twin: nn.Module, mx: dict[str, nn.Module], hp: dict[str, nn.Module], quantized) -> None:
    """Put the MXFP8 module in place for names where ``quantized(name)`` is true, the source module
    elsewhere."""
    for name in mx:
        twin.set_submodule(name, mx[name] if quantized(name) else hp[name])


def _layer_prefix(name: str, idx: int) -> str:
    token = f".{idx}."
    cut = (name + ".").find(token)
    return name[: cut + len(token) - 1] if cut >= 0 else name


def per_layer_sweep(source: nn.Module, twin: nn.Module, rollouts: Rollouts, ref: Scores, full_kl: float,
                    target_kl: float | None, batch_size: int = 8, progress: Progress = _noop) -> dict:
    """Each decoder layer's share of the error and the smallest greedy set of layers to keep for
    ``target_kl``.

    Returns ``{"layers": [{"layer", "prefix", "gen_kl_error_mean", "share"}...] (layer order), "suggestion":
    {"target_kl", "keep_layers", "exclude", "gen_kl_error_mean", "met", "steps"} or None}``; ``exclude`` holds
    :class:`mxport.policy.PrecisionPolicy` patterns (``model.layers.3.*``) for ``mxport export --exclude``.
    The twin is restored (all MXFP8) before returning.
    """
    mx = quantized_modules(twin)  # linears and experts modules: a MoE layer's experts toggle with their layer
    hp = {name: source.get_submodule(name) for name in mx}
    by_layer: dict[int, list[str]] = {}
    for name in mx:
        idx = layer_index(name)
        if idx is not None:
            by_layer.setdefault(idx, []).append(name)
    layers = sorted(by_layer)
    prefixes = {i: _layer_prefix(by_layer[i][0], i) for i in layers}

    def measure(quantized) -> float:
        _set_quantized(twin, mx, hp, quantized)
        return gen_kl_error(score(twin, rollouts, batch_size).logp, ref.logp)["mean"]

    rows = []
    done, total = 0, len(layers)
    try:
        for i in layers:
            kl = measure(lambda n, i=i: layer_index(n) == i)
            rows.append({"layer": i, "prefix": prefixes[i], "gen_kl_error_mean": kl})
            done += 1
            progress("per-layer", done, total)
        total_kl = sum(r["gen_kl_error_mean"] for r in rows)
        for r in rows:
            r["share"] = r["gen_kl_error_mean"] / total_kl if total_kl > 0 else 0.0
        suggestion = None
        if target_kl is not None:
            order = [r["layer"] for r in sorted(rows, key=lambda r: -r["gen_kl_error_mean"])]
            kept: list[int] = []
            kl = full_kl
            steps = [{"keep_layers": [], "gen_kl_error_mean": kl}]
            while kl > target_kl and len(kept) < len(order):
                kept.append(order[len(kept)])
                keep = set(kept)
                kl = measure(lambda n, keep=keep: layer_index(n) not in keep)
                steps.append({"keep_layers": sorted(kept), "gen_kl_error_mean": kl})
                progress("keep-search", len(kept), len(order))
            suggestion = {"target_kl": target_kl, "keep_layers": sorted(kept),
                          "exclude": [f"{prefixes[i]}.*" for i in sorted(kept)],
                          "gen_kl_error_mean": kl, "met": kl <= target_kl, "steps": steps}
    finally:
        _set_quantized(twin, mx, hp, lambda n: True)
    return {"layers": rows, "suggestion": suggestion}


#: the figures that gate ``passed``: each must be a finite number (NaN / inf = a broken model or checkpoint)
GATING_FIGURES = ("gen_kl_error_mean", "gen_kl_error_max", "token_mult_prob_error", "greedy_agreement")


def failed_checks(figures: dict, max_kl: float | None) -> list[str]:
    """One line per failed check of ``figures`` (from :func:`compare`): a gating figure that is not finite, or
    ``gen_kl_error_mean`` above ``max_kl`` (when given). Empty when everything passed."""
    failures = [f"{name} is {figures[name]} (not a finite number)" for name in GATING_FIGURES
                if not math.isfinite(figures[name])]
    mean = figures["gen_kl_error_mean"]
    if max_kl is not None and math.isfinite(mean) and mean > max_kl:
        failures.append(f"gen_kl_error_mean {mean:.6g} exceeds max_kl {max_kl:.6g}")
    return failures


def _fp8(fp8_dtype) -> torch.dtype:
    return element_format(fp8_dtype).dtype


def verify(source=None, *, checkpoint=None, prompts=None, max_new_tokens: int = 32, activation: str = "none",
           fp8_dtype: torch.dtype | str = torch.float8_e4m3fn, policy=None, max_kl: float | None = None,
           per_layer: bool = False, target_kl: float | None = None, device: str | torch.device = "cpu",
           batch_size: int = 8, progress: Progress = _noop, samples: int = 3, quant: str = "mxfp8") -> dict:
    """Run the verify pipeline (module docstring) and return a JSON-able report.

    Args:
        source: model directory / GGUF / None (embedded default model), as
            :func:`mxport.models.resolve_source`; or an already loaded ``(model, tokenizer)`` pair.
        checkpoint: an ``mxport export`` directory to build the twin from (else the twin is quantized here).
        prompts: a prompts file (:func:`mxport.prompts.load_prompts`) or None for the built-in set.
        max_new_tokens: generation budget per prompt (>= 1).
        activation: ``"none"`` (weight-only) or ``"mxfp8"`` (W8A8).
        fp8_dtype: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` or "e4m3" / "e5m2".
        policy: :class:`mxport.policy.PrecisionPolicy` (None = default).
        max_kl: threshold; ``passed`` is False when ``gen_kl_error_mean`` exceeds it. With or without it,
            ``passed`` is False when a gating figure (:data:`GATING_FIGURES`) is NaN or infinite; ``failures``
            lists why (:func:`failed_checks`).
        per_layer: run :func:`per_layer_sweep` (with ``target_kl``).
        device: where both models run.
        quant: ``"mxfp8"`` (default), or ``"mxfp4"`` / ``"nvfp4"``: the twin's weights in that 4-bit format
            (:func:`build_fp4_twin`; weight-only, no checkpoint, no per-layer sweep).

    Returns a dict with ``gen_kl_error_mean``, ``gen_kl_error_max``, ``token_mult_prob_error``,
    ``greedy_agreement``, ``tokens``, ``weight_sqnr_db_min``, ``weight_sqnr_db_mean``, ``weight_sqnr_db`` (per
    tensor), ``quant``, ``element`` (the weights' element type: "e4m3" / "e5m2", "e2m1" for 4-bit),
    ``quantized_tensors``; for MXFP8 also ``fp8_dtype`` (None for 4-bit), ``mxfp8_layers`` (MXFP8 modules:
    linears and MoE experts modules), ``mxfp8_experts`` (experts modules), ``mxfp8_tensors`` (quantized weight
    tensors; these three are 0 for 4-bit twins); ``passed``, ``failures``, ``per_layer`` (when asked),
    ``samples`` (first decoded generations: ``prompt`` and ``<quant>_output``, e.g. ``mxfp8_output``) and the
    settings. A model folder without a tokenizer
    works: its prompts are token ids drawn from the vocabulary (:func:`mxport.models.vocabulary_prompts`,
    one per built-in prompt), and ``prompt_note`` says so (None otherwise).

    Raises:
        ValueError / TypeError / FileNotFoundError: bad arguments, unreadable model, prompts or checkpoint.
    """
    _check_verify_args(activation, max_new_tokens, max_kl, target_kl)
    fp8 = _fp8(fp8_dtype)
    _check_quant(quant, checkpoint, activation, per_layer, fp8)
    device = check_device(device)
    conversations = load_prompts(prompts)
    model, tok, label, where = _load_source(source, device)
    progress("load", 1, 1)
    prompt_ids, note = _prompt_ids(model, tok, conversations, where, prompts)
    if quant == "mxfp8":
        twin = build_twin(model, checkpoint=checkpoint, policy=policy, fp8_dtype=fp8, activation=activation,
                          progress=progress)
        weights = _weight_report(model, twin)
    else:
        twin, sqnr = build_fp4_twin(model, quant, policy=policy, progress=progress)
        weights = {**_sqnr_summary(sqnr), "element": "e2m1", "fp8_dtype": None, "mxfp8_layers": 0,
                   "mxfp8_experts": 0, "mxfp8_tensors": 0}
    generated = generate_greedy(twin, prompt_ids, max_new_tokens, _eos_ids(model, tok), progress,
                                pad_id=_pad_id(model, tok), batch_size=batch_size)
    rollouts = Rollouts(prompt_ids, generated)
    ref = score(model, rollouts, batch_size)
    progress("score", 1, 2)
    figures = compare(score(twin, rollouts, batch_size), ref)
    progress("score", 2, 2)
    report = {**figures, **weights, "quant": quant, "quantized_tensors": len(weights["weight_sqnr_db"]),
              "model": label,
              "checkpoint": None if checkpoint is None else str(checkpoint), "activation": activation,
              "prompts": len(conversations), "prompt_note": note, "max_new_tokens": max_new_tokens,
              "max_kl": max_kl}
    failures = failed_checks(figures, max_kl)
    pairs = list(zip(conversations, prompt_ids, generated, strict=True))[:samples]
    samples_out = [{"prompt": c[-1]["content"] if tok is not None else f"token ids {p.tolist()}",
                    f"{quant}_output": tok.decode(g, skip_special_tokens=True) if tok is not None
                    else f"token ids {g.tolist()}"} for c, p, g in pairs]
    report.update(passed=not failures, failures=failures, samples=samples_out)
    if per_layer:
        report["per_layer"] = per_layer_sweep(model, twin, rollouts, ref, figures["gen_kl_error_mean"],
                                              target_kl, batch_size, progress)
    return report


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device`` that exists here. ValueError naming it otherwise (an unknown device
    type, CUDA on a machine without it, a CUDA index past the last GPU)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1, ...): {exc}") from None
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == "cuda" and (dev.index or 0) >= cuda:
        raise ValueError(f"device {device!r}: no such CUDA device here ({cuda} available)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: verify runs on cpu or cuda")
    return dev


def _check_quant(quant: str, checkpoint, activation: str, per_layer: bool, fp8: torch.dtype) -> None:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if quant != "mxfp8":
        for given, what in ((checkpoint is not None, "a checkpoint"), (activation != "none", "activation "
                            f"{activation!r}"), (per_layer, "the per-layer sweep"),
                            (fp8 != torch.float8_e4m3fn, "an FP8 element type")):
            if given:
                raise ValueError(f"quant {quant!r} measures weight-only {quant} quantized here: {what} "
                                 "is for mxfp8")


def _check_verify_args(activation: str, max_new_tokens: int, max_kl, target_kl) -> None:
    if activation not in ("none", "mxfp8"):
        raise ValueError(f"activation must be 'none' or 'mxfp8', got {activation!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for name, v in (("max_kl", max_kl), ("target_kl", target_kl)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def _load_source(source, device) -> tuple[nn.Module, object, str, str]:
    """``(model, tokenizer, label, where)`` for a model source, or an already loaded ``(model, tokenizer)``
    pair; the tokenizer is None when the source has none (``where`` says where it was looked for)."""
    from .models import load_causal_lm, resolve_source

    if isinstance(source, tuple):
        model, tok = source
        label = where = type(model).__name__
    else:
        src = resolve_source(source)
        label, where = src.label, str(src.path)
        model, tok = load_causal_lm(src, dtype=torch.float32, device=device, require_tokenizer=False)
    model.eval()
    return model, tok, label, where


def _prompt_ids(model: nn.Module, tok, conversations: list, where: str,
                prompts_file) -> tuple[list[torch.Tensor], str | None]:
    """The prompts' token ids and, without a tokenizer, the note saying they are drawn from the vocabulary
    (:func:`mxport.models.vocabulary_prompts`, one per conversation of the built-in set)."""
    from .models import vocabulary_prompts, vocabulary_prompts_note

    if tok is not None:
        return encode_prompts(tok, conversations), None
    if prompts_file is not None:
        raise ValueError(f"no tokenizer in {where}: a prompts file needs one to encode its text (without "
                         "one, prompts are token ids drawn from the vocabulary)")
    ids = vocabulary_prompts(int(model.config.vocab_size), len(conversations))
    return list(ids), vocabulary_prompts_note(where, len(conversations))


def _pad_id(model: nn.Module, tok) -> int:
    """The padding token of the prompts' batches: the tokenizer's pad (else EOS, else 0) id; without a
    tokenizer, the model's pad or EOS id, else 0."""
    if tok is not None:
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    for src in (getattr(model, "generation_config", None), model.config):
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(src, attr, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(value, int):
                return value
    return 0


def _weight_report(model: nn.Module, twin: nn.Module) -> dict:
    """The twin's weight figures: per-tensor SQNR and its summary, the element formats, what is quantized."""
    mx = quantized_modules(twin)
    sqnr = weight_sqnr(model, twin)
    elements = sorted({t.dtype for m in mx.values() for t in m.buffers(recurse=False)
                       if t.dtype.itemsize == 1 and t.is_floating_point()}, key=str)
    names = ",".join(element_format(d).name for d in elements)
    return {**_sqnr_summary(sqnr), "element": names, "fp8_dtype": names,
            "mxfp8_layers": len(mx),
            "mxfp8_experts": sum(isinstance(m, MXFP8Experts) for m in mx.values()),
            "mxfp8_tensors": len(sqnr)}


def _sqnr_summary(sqnr: dict[str, float]) -> dict:
    finite = [v for v in sqnr.values() if math.isfinite(v)]
    return {"weight_sqnr_db_min": min(sqnr.values()) if sqnr else math.nan,
            "weight_sqnr_db_mean": sum(finite) / len(finite) if finite else (math.inf if sqnr else math.nan),
            "weight_sqnr_db": sqnr}
