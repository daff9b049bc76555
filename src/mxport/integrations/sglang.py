"""Refit an SGLang engine with MXFP8 checkpoint-format tensors, every step checked.

SGLang 0.5.23 (``sglang/srt/entrypoints/engine.py``: ``Engine.begin_weight_update`` l.1643,
``end_weight_update`` l.1650, ``update_weights_from_distributed`` l.1657, ``update_weights_from_tensor``
l.1679; ``managers/tokenizer_control_mixin.py`` returns ``Tuple[bool, str]``) only accepts
``update_weights_from_tensor`` / ``_from_distributed`` between ``begin_weight_update()`` and
``end_weight_update()``: outside a session they return ``(False, "... must run between begin_weight_update()
and end_weight_update()")`` (``managers/scheduler_components/weight_updater.py`` l.192-196, l.234-238) instead
of raising, and a second ``begin_weight_update`` while one is open returns ``(False, "a weight-update session
is already open ...")``.

:func:`update_sglang_weights` drives begin -> update_weights_from_tensor (in chunks) -> end, checks every
``(success, message)`` and raises :class:`SGLangUpdateError` with SGLang's message. Before ``begin`` it checks
every tensor (FP8 values with a uint8 E8M0 ``weight_scale_inv`` of the compact shape right after them), so a
malformed refit never reaches the engine; if SGLang itself fails mid-update the session is still closed with
``end_weight_update`` (so the next refit can begin) and the error is raised. SGLang's loader writes each chunk
as it arrives, so unlike mxport's vLLM backend a failure *inside* SGLang can leave part of the new weights
loaded: re-send the whole refit.

SGLang does not run on CPU-only machines; this module is tested against a stand-in with the 0.5.23 signatures
and return values (tests/test_integration_sglang.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..formats import is_fp8_dtype

SCALE_SUFFIX = "_scale_inv"  # SGLang mxfp8: <m>.weight + <m>.weight_scale_inv


class SGLangUpdateError(RuntimeError):
    """An SGLang weight-update call returned ``success=False``.

    ``step`` names the call, ``message`` is SGLang's.
    """

    def __init__(self, step: str, message: str):
        self.step, self.message = step, message
        super().__init__(f"SGLang {step} failed: {message}")


def _check(step: str, result) -> str:
    if not (isinstance(result, Sequence) and len(result) == 2 and isinstance(result[0], bool)):
        raise SGLangUpdateError(step, f"unexpected return value {result!r} (expected (success, message))")
    ok, message = result
    if not ok:
        raise SGLangUpdateError(step, str(message))
    return str(message)


def to_sglang_names(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint pairs with scale names renamed to SGLang's ``<m>.weight_scale_inv``.

    modelopt / compressed-tensors scale names (``<m>.weight_scale``) are renamed; names already in SGLang form
    pass unchanged."""
    out = []
    for name, t in pairs:
        if name.endswith(".weight_scale"):
            name += "_inv"
        out.append((name, t))
    return out


def check_pairs(pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Every FP8 ``<m>.weight`` [.., K] must be followed by ``<m>.weight_scale_inv`` uint8 [.., ceil(K/32)];
    ValueError naming the first tensor that is not."""
    for i, (name, t) in enumerate(pairs):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name!r}: not a tensor ({type(t).__name__})")
        if name.endswith(".weight_scale_inv"):
            prev = pairs[i - 1] if i else None
            if prev is None or prev[0] != name.removesuffix(SCALE_SUFFIX) or not is_fp8_dtype(prev[1].dtype):
                raise ValueError(f"{name!r}: a scale without its FP8 values tensor right before it")
            k = prev[1].shape[-1]
            want = (*prev[1].shape[:-1], -(-k // 32))
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise ValueError(f"{name!r}: {t.dtype} {tuple(t.shape)}, expected uint8 E8M0 {want}")
        elif is_fp8_dtype(t.dtype):
            nxt = pairs[i + 1][0] if i + 1 < len(pairs) else None
            if nxt != name + SCALE_SUFFIX:
                raise ValueError(f"{name!r}: FP8 values without {name + SCALE_SUFFIX!r} right after them")
            if t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name!r}: {t.dtype}; SGLang registers MXFP8 values as float8_e4m3fn")


def _chunks(pairs: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int):
    chunk, size = [], 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        keep_pair = name.endswith(".weight_scale_inv")  # never split values from their scales
        if chunk and size + n > chunk_bytes and not keep_pair:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += n
    if chunk:
        yield chunk


def update_sglang_weights(engine, pairs: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = 512 << 20,
                          load_format: str | None = None) -> dict:
    """One checked refit of an SGLang ``Engine`` (or anything with its 0.5.23 methods).

    Args:
        engine: ``sglang.Engine``. pairs: ``(name, tensor)`` checkpoint-format pairs (modelopt scale names are
            renamed to ``weight_scale_inv``), e.g. ``MxportWeightSource(model)`` or
            ``mxport.refit.checkpoint_tensors(plan, targets, "sglang")``.
        chunk_bytes: bytes per ``update_weights_from_tensor`` call (values and their scales stay together).
    Returns: ``{"chunks": int, "bytes": int, "messages": [str, ...]}``.
    Raises:
        ValueError: malformed pairs (nothing was sent). SGLangUpdateError: SGLang returned ``(False,
            message)`` (the session was closed with ``end_weight_update`` before raising).
    """
    pairs = to_sglang_names(pairs)
    check_pairs(pairs)
    messages = [_check("begin_weight_update", engine.begin_weight_update())]
    chunks = list(_chunks(pairs, chunk_bytes))
    try:
        for i, chunk in enumerate(chunks):
            res = engine.update_weights_from_tensor(chunk, load_format=load_format,
                                                    flush_cache=(i == len(chunks) - 1))
            messages.append(_check("update_weights_from_tensor", res))
    except BaseException:
        try:
            engine.end_weight_update()  # close the session so the next refit can begin; the first error wins
        except Exception:  # noqa: BLE001, S110 - reported through the original error
            pass
        raise
    messages.append(_check("end_weight_update", engine.end_weight_update()))
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    return {"chunks": len(chunks), "bytes": nbytes, "messages": messages}
