"""mxport.metrics on hand-made distributions whose values are known in closed form."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxport.metrics import gen_kl_error, greedy_agreement, sqnr_db, token_logprobs, token_mult_prob_error


def _kl2(a, b):
    """KL of two-point distributions (a, 1-a) || (b, 1-b), closed form in float64."""
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


@settings(max_examples=30, deadline=None)
@given(a=st.floats(0.01, 0.99), b=st.floats(0.01, 0.99))
def test_gen_kl_two_point_closed_form(a, b):
    lg = torch.tensor([[math.log(a), math.log(1 - a)]], dtype=torch.float64)
    lt = torch.tensor([[math.log(b), math.log(1 - b)]], dtype=torch.float64)
    out = gen_kl_error(lg, lt)
    assert out["mean"] == pytest.approx(_kl2(a, b), rel=1e-4, abs=1e-6)
    assert out["max"] == pytest.approx(_kl2(a, b), rel=1e-4, abs=1e-6)


def test_gen_kl_mean_max_mask_and_direction():
    pairs = [(0.5, 0.5), (0.9, 0.5), (0.2, 0.7), (0.99, 0.01)]
    lg = torch.log(torch.tensor([[a, 1 - a] for a, _ in pairs]))
    lt = torch.log(torch.tensor([[b, 1 - b] for _, b in pairs]))
    kls = [_kl2(a, b) for a, b in pairs]
    out = gen_kl_error(lg, lt)
    assert out["per_position"].shape == (4,)
    assert out["per_position"][0] == 0.0
    assert out["mean"] == pytest.approx(sum(kls) / 4, rel=1e-5)
    assert out["max"] == pytest.approx(max(kls), rel=1e-5)
    mask = torch.tensor([True, True, True, False])
    masked = gen_kl_error(lg, lt, mask)
    assert masked["mean"] == pytest.approx(sum(kls[:3]) / 3, rel=1e-5)
    assert masked["max"] == pytest.approx(kls[2], rel=1e-5)
    # KL is not symmetric: KL(gen||train) is the one reported
    rev = gen_kl_error(lt, lg)
    assert float(rev["per_position"][1]) == pytest.approx(_kl2(0.5, 0.9), rel=1e-5)
    assert float(rev["per_position"][1]) != pytest.approx(float(out["per_position"][1]), rel=1e-3)


def test_gen_kl_zero_probabilities_and_logits_input():
    # p_gen = (1/2, 1/2, 0), p_train = (1/4, 1/4, 1/2): KL = 2 * 1/2 * ln 2 = ln 2; the p_gen = 0 term adds 0
    lg = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])
    lt = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    assert gen_kl_error(lg, lt)["mean"] == pytest.approx(math.log(2), rel=1e-6)
    # logits are normalized: adding a constant changes nothing
    assert gen_kl_error(lg + 3.0, lt - 7.0)["mean"] == pytest.approx(math.log(2), rel=1e-6)
    # p_train = 0 where p_gen > 0: infinite
    assert math.isinf(gen_kl_error(lt, lg)["mean"])


def test_gen_kl_batched_shapes():
    lg = torch.log_softmax(torch.randn(2, 5, 11), -1)
    out = gen_kl_error(lg, lg.clone())
    assert out["per_position"].shape == (2, 5)
    assert out["mean"] == pytest.approx(0.0, abs=1e-6)


def test_token_mult_prob_error_nemo_definition():
    g = torch.tensor([[-0.1, -1.0, -2.0, -0.5]])
    t = torch.tensor([[-0.2, -0.8, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    expect = (math.exp(0.1) + math.exp(0.2) + math.exp(0.0)) / 3
    assert token_mult_prob_error(g, t, mask) == pytest.approx(expect, rel=1e-6)
    assert token_mult_prob_error(g, t) == pytest.approx((3 * expect + math.exp(2.5)) / 4, rel=1e-6)
    assert token_mult_prob_error(g, g) == 1.0


def test_token_logprobs_gathers_generated_tokens():
    logp = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]))
    tok = torch.tensor([2, 1])
    assert torch.allclose(token_logprobs(logp, tok), torch.log(torch.tensor([0.7, 0.3])))


def test_greedy_agreement():
    a = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    b = torch.tensor([[0.2, 0.8], [0.1, 0.9], [0.4, 0.6], [0.3, 0.7]])
    assert greedy_agreement(a.log(), b.log()) == 0.5
    assert greedy_agreement(a.log(), b.log(), torch.tensor([True, False, True, False])) == 1.0


def test_sqnr_db_known_values():
    ref = torch.ones(100)
    test = ref + 0.125 * torch.tensor([1.0, -1.0]).repeat(50)  # noise 100/64, signal 100 -> 10 log10(64) dB
    assert sqnr_db(ref, test) == pytest.approx(10 * math.log10(64), abs=1e-12)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(torch.zeros(4), torch.ones(4)) == -math.inf
    assert math.isnan(sqnr_db(torch.tensor([math.nan]), torch.tensor([1.0])))


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        gen_kl_error(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="logp_gen"):
        gen_kl_error(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mask"):
        gen_kl_error(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        sqnr_db(torch.zeros(3), torch.zeros(4))


def test_gen_kl_error_is_nan_for_nan_distributions():
    """NaN log-probs (a model with NaN weights) must never read as KL 0 (a perfect match): pg > 0 is False for
    NaN, which used to drop every term of a NaN row from the sum."""
    good = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.0]]), dim=-1)
    nan = torch.full_like(good, math.nan)
    for a, b in ((nan, good), (good, nan), (nan, nan)):
        r = gen_kl_error(a, b)
        assert math.isnan(r["mean"]) and math.isnan(r["max"])
        assert torch.isnan(r["per_position"]).all()
    one_bad = good.clone()
    one_bad[1, 2] = math.nan
    r = gen_kl_error(one_bad, good)
    assert r["per_position"][0].item() == 0.0 and math.isnan(r["per_position"][1].item())
    assert math.isnan(r["mean"]) and math.isnan(r["max"])
    # the NaN position masked out: the selected positions are exact
    masked = gen_kl_error(one_bad, good, mask=torch.tensor([True, False]))
    assert masked["mean"] == 0.0 and masked["max"] == 0.0
    # a row of -inf logits has no distribution (log_softmax gives NaN): NaN, not 0
    no_dist = torch.full((1, 3), -math.inf)
    assert math.isnan(gen_kl_error(no_dist, good[:1])["mean"])


def test_greedy_agreement_and_token_error_are_nan_for_nan_inputs():
    good = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    nan = torch.full_like(good, math.nan)
    assert math.isnan(greedy_agreement(nan, good)) and math.isnan(greedy_agreement(good, nan))
    assert greedy_agreement(good, good) == 1.0
    half = good.clone()
    half[1, 0] = math.nan
    assert greedy_agreement(half, good, mask=torch.tensor([True, False])) == 1.0
    assert math.isnan(token_mult_prob_error(torch.tensor([math.nan, 0.0]), torch.tensor([0.0, 0.0])))
