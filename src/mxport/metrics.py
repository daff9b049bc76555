"""Fidelity metrics between a generation (MXFP8) model and a training (high-precision) model, and weight SQNR.

Conventions: ``logp_gen`` / ``logp_train`` are next-token log-probabilities (or logits: every function
normalizes with ``log_softmax`` in float32) of shape ``[..., T, V]`` for T positions over a V-token
vocabulary; ``mask`` is a bool / 0-1 tensor ``[..., T]`` selecting the generated positions (None = all).
Results are Python floats.

Sources: NeMo-RL ``nemo_rl/algorithms/loss_functions.py`` (``token_mult_prob_error``: masked mean of
``exp(|generation_logprobs - prev_logprobs|)``) and its GRPO guide (``gen_kl_error``, here computed exactly
over the full distributions instead of estimated from the sampled token).
"""

from __future__ import annotations

import math

import torch

__all__ = ["gen_kl_error", "token_mult_prob_error", "greedy_agreement", "sqnr_db"]


def _logp(x: torch.Tensor, argname: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{argname} must be a floating torch.Tensor of log-probabilities [..., T, V], got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{argname} must have a vocabulary dimension, got a 0-d tensor")
    return torch.log_softmax(x.to(torch.float32), dim=-1)


def _mask(mask, shape: torch.Size, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor [..., T] or None, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the positions {tuple(shape)}")
    return mask.to(device=device).bool()


def _check_same(a: torch.Tensor, b: torch.Tensor, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{an} shape {tuple(a.shape)} != {bn} shape {tuple(b.shape)}")


def gen_kl_error(logp_gen: torch.Tensor, logp_train: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """KL(P_gen || P_train) = sum_v p_gen(v) (log p_gen(v) - log p_train(v)) per position, in nats.

    Args:
        logp_gen: ``[..., T, V]`` log-probs (or logits) of the generation model.
        logp_train: same shape, the training model.
        mask: ``[..., T]`` generated positions (None = all).

    Returns:
        ``{"mean": float, "max": float, "per_position": Tensor [..., T] float32}`` (mean / max over masked
        positions; 0.0 when none). Terms with p_gen = 0 contribute 0; p_train = 0 where p_gen > 0 gives inf. A
        position where either distribution holds a NaN (NaN logits, or a row with no finite logit) is NaN, and
        so are the mean and max over it: a broken model never reads as a perfect match.

    Raises:
        TypeError: non-float inputs. ValueError: shape mismatches.
    """
    _check_same(logp_gen, logp_train, "logp_gen", "logp_train")
    lg, lt = _logp(logp_gen, "logp_gen"), _logp(logp_train, "logp_train")
    pg = lg.exp()
    terms = torch.where(pg > 0, pg * (lg - lt), torch.zeros_like(pg))
    per_pos = terms.sum(dim=-1).clamp_min(0.0)  # KL >= 0; rounding can give -1e-9
    # pg > 0 is False for NaN: without this, NaN in logp_gen would drop out of the sum as a 0 term
    broken = lg.isnan().any(dim=-1) | lt.isnan().any(dim=-1)
    per_pos = per_pos.masked_fill(broken, math.nan)
    m = _mask(mask, per_pos.shape, per_pos.device)
    sel = per_pos[m]
    if sel.numel() == 0:
        return {"mean": 0.0, "max": 0.0, "per_position": per_pos}
    return {"mean": float(sel.double().mean()), "max": float(sel.max()), "per_position": per_pos}


def token_mult_prob_error(logp_gen_tokens: torch.Tensor, logp_train_tokens: torch.Tensor,
                          mask: torch.Tensor | None = None) -> float:
    """NeMo-RL's ``token_mult_prob_error``: mean over generated tokens of ``exp(|logp_gen - logp_train|)``.

    Args:
        logp_gen_tokens: ``[..., T]`` log-prob of each generated token under the generation model.
        logp_train_tokens: same shape, under the training model.
        mask: ``[..., T]`` generated positions (None = all).

    Returns a float >= 1 (1.0 = identical; 1.0 when no position is selected).
    Source: NeMo-RL ``ClippedPGLossFn``:
    ``masked_mean(exp(|generation_logprobs - prev_logprobs| * mask), mask)``.
    """
    for x, n in ((logp_gen_tokens, "logp_gen_tokens"), (logp_train_tokens, "logp_train_tokens")):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"{n} must be a floating torch.Tensor [..., T] of token log-probs")
    _check_same(logp_gen_tokens, logp_train_tokens, "logp_gen_tokens", "logp_train_tokens")
    err = (logp_gen_tokens.double() - logp_train_tokens.double()).abs().exp()
    m = _mask(mask, err.shape, err.device)
    sel = err[m]
    return float(sel.mean()) if sel.numel() else 1.0


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logp[..., t, tokens[..., t]]``: the log-prob of each token, ``[..., T]`` float32 (``logp`` normalized
    with ``log_softmax`` first)."""
    lp = _logp(logp, "logp")
    if tokens.shape != lp.shape[:-1]:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} does not match "
                         f"positions {tuple(lp.shape[:-1])}")
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def greedy_agreement(logp_gen: torch.Tensor, logp_train: torch.Tensor,
                     mask: torch.Tensor | None = None) -> float:
    """Fraction of (masked) positions where both models' most likely next token (argmax) is the same, in
    [0, 1] (1.0 when no position is selected; NaN when a selected position holds a NaN in either input: argmax
    of NaN is meaningless)."""
    _check_same(logp_gen, logp_train, "logp_gen", "logp_train")
    same = (logp_gen.argmax(dim=-1) == logp_train.argmax(dim=-1)).double()
    broken = logp_gen.isnan().any(dim=-1) | logp_train.isnan().any(dim=-1)
    same = same.masked_fill(broken, math.nan)
    m = _mask(mask, same.shape, same.device)
    sel = same[m]
    return float(sel.mean()) if sel.numel() else 1.0


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``ref`` in dB:
    ``10 log10(sum(ref^2) / sum((ref - test)^2))``, squares in float32, sums in float64. ``inf`` when
    identical; ``-inf`` for an all-zero ``ref`` with nonzero error; NaN when either holds NaN.

    Raises ValueError on a shape mismatch, TypeError on non-tensors.
    """
    if not isinstance(ref, torch.Tensor) or not isinstance(test, torch.Tensor):
        raise TypeError("ref and test must be torch.Tensors")
    _check_same(ref, test, "ref", "test")
    r, t = ref.float(), test.float()  # element-wise in float32, sums accumulated in float64
    signal = float(torch.sum(r * r, dtype=torch.float64))
    noise = float(torch.sum((r - t) ** 2, dtype=torch.float64))
    if math.isnan(signal) or math.isnan(noise):
        return math.nan
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
