"""mxport.integrations.sglang against a stand-in engine honouring SGLang 0.5.23's weight-update API.

The stand-in keeps SGLang's signatures and return values (SGLang itself needs CUDA and does not run on these
machines): ``begin_weight_update`` / ``update_weights_from_tensor`` / ``end_weight_update`` return
``(success, message)``; updates outside a session and a second ``begin`` return ``(False, ...)``
(sglang/srt/managers/scheduler_components/weight_updater.py)."""

import pytest
import torch

from mxport import quantize
from mxport.integrations.sglang import SGLangUpdateError, update_sglang_weights


class StandInSGLang:
    """The session rules and return values of sglang 0.5.23 ``Engine`` (no model: loads into a dict)."""

    def __init__(self, fail_on_chunk: int | None = None):
        self.session = False
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []
        self.fail_on_chunk, self.chunk = fail_on_chunk, 0

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append("begin")
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(f"update(flush={flush_cache})")
        if not self.session:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and "
                           "end_weight_update()")
        self.chunk += 1
        if self.fail_on_chunk == self.chunk:
            return False, "Failed to update weights: shape mismatch for model.layers.0.mlp.down_proj.weight"
        self.weights.update({n: t.clone() for n, t in named_tensors})
        return True, "Success"


def _pairs():
    out = []
    for i in range(3):
        c = quantize(torch.randn(64, 96))
        out += [(f"model.layers.{i}.mlp.down_proj.weight", c.data),
                (f"model.layers.{i}.mlp.down_proj.weight_scale", c.scale_inv)]
    return out + [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))]


def test_full_session_and_sglang_names():
    eng, pairs = StandInSGLang(), _pairs()
    res = update_sglang_weights(eng, pairs, chunk_bytes=7000)
    assert eng.calls[0] == "begin" and eng.calls[-1] == "end" and not eng.session
    assert res["chunks"] == len([c for c in eng.calls if c.startswith("update")]) > 1
    assert eng.calls[-2] == "update(flush=True)" and "update(flush=False)" in eng.calls
    assert torch.equal(eng.weights["model.layers.2.mlp.down_proj.weight_scale_inv"], pairs[5][1])
    assert not any(n.endswith(".weight_scale") for n in eng.weights)
    assert res["bytes"] == sum(t.numel() * t.element_size() for _, t in pairs)


def test_engine_failure_raises_with_its_message_and_closes_the_session():
    eng = StandInSGLang(fail_on_chunk=2)
    with pytest.raises(SGLangUpdateError, match="shape mismatch for model.layers.0"):
        update_sglang_weights(eng, _pairs(), chunk_bytes=7000)
    assert not eng.session and eng.calls[-1] == "end"
    eng.fail_on_chunk = None
    update_sglang_weights(eng, _pairs(), chunk_bytes=7000)  # the next refit can begin


def test_open_session_is_reported_not_ignored():
    eng = StandInSGLang()
    eng.begin_weight_update()
    with pytest.raises(SGLangUpdateError, match="already open"):
        update_sglang_weights(eng, _pairs())


def test_malformed_pairs_never_reach_the_engine():
    eng, pairs = StandInSGLang(), _pairs()
    bad = [pairs[0], (pairs[1][0], pairs[1][1][:, :2])]
    with pytest.raises(ValueError, match="expected uint8 E8M0"):
        update_sglang_weights(eng, bad)
    with pytest.raises(ValueError, match="without"):
        update_sglang_weights(eng, [pairs[0]])
    e5 = [(pairs[0][0], pairs[0][1].float().to(torch.float8_e5m2)), pairs[1]]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        update_sglang_weights(eng, e5)
    assert eng.calls == []
