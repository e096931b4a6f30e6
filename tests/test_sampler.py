"""The shared sampler (``moe_offload.generation.sampling``: ``pick`` and ``choose``, its
decision with a confidence for block diffusion) at the edges of its settings (issue 34): a temperature below
``GREEDY_TEMPERATURE`` is greedy and never NaN; ``top_p`` 0 / tiny keeps only the most probable token; ``top_k`` keeps
exactly k tokens (1: greedy; 0, negative, >= V: off); non-finite settings are a clear ValueError."""

import math

import pytest
import torch

from moe_offload.generation.generate import GREEDY_TEMPERATURE
from moe_offload.generation.sampling import pick as _pick
from moe_offload.generation.sampling import choose, pick


def _logits(v=64, scale=30.0, dtype=torch.float32):
    return (torch.randn(1, v, generator=torch.Generator().manual_seed(7)) * scale).to(dtype)


@pytest.mark.parametrize("temperature", [0.0, -1.0, 1e-40, 5e-324, 1e-30, GREEDY_TEMPERATURE / 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tiny_temperature_is_greedy(temperature, dtype):
    logits = _logits(dtype=dtype)
    tok = _pick(logits, temperature, 1.0, torch.Generator().manual_seed(0))
    assert tok.shape == (1,) and tok.dtype == torch.long and int(tok) == int(logits.argmax())


def test_temperature_at_the_epsilon_samples_without_nan():
    # 1e-5 scales logits of magnitude ~100 to ~1e7: finite, so the softmax is exact (a one-hot at the argmax)
    logits = _logits(scale=100.0)
    for s in range(20):
        assert int(_pick(logits, GREEDY_TEMPERATURE, 1.0, torch.Generator().manual_seed(s))) == int(logits.argmax())
    extreme = torch.tensor([[3.0e38, -3.0e38, 0.0]])
    assert int(_pick(extreme, 1.0, 1.0, torch.Generator().manual_seed(0))) == 0


@pytest.mark.parametrize("top_p", [0.0, 1e-300, 1e-9])
def test_zero_and_tiny_top_p_keep_only_the_most_probable_token(top_p):
    logits = _logits(scale=1.0)  # flat: plain sampling would often pick another token
    picks = {int(_pick(logits, 2.0, top_p, torch.Generator().manual_seed(s))) for s in range(50)}
    assert picks == {int(logits.argmax())}


def test_top_p_one_equals_plain_sampling():
    logits = _logits(scale=1.0)
    for s in range(30):
        assert int(_pick(logits, 1.0, 1.0, torch.Generator().manual_seed(s))) == int(
            torch.multinomial(torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(s)))


def test_top_k_keeps_exactly_k_tokens():
    logits = _logits(scale=1.0)
    top3 = set(logits.topk(3).indices[0].tolist())
    picks = {int(_pick(logits, 2.0, 1.0, torch.Generator().manual_seed(s), top_k=3)) for s in range(300)}
    assert picks == top3  # all three reached at a high temperature over 300 draws, nothing else
    assert {int(_pick(logits, 2.0, 1.0, torch.Generator().manual_seed(s), top_k=1)) for s in range(20)} == {
        int(logits.argmax())}


@pytest.mark.parametrize("top_k", [0, -1, 64, 10**9])
def test_top_k_off_values_equal_no_top_k(top_k):
    logits = _logits(scale=1.0)
    for s in range(30):
        g1, g2 = torch.Generator().manual_seed(s), torch.Generator().manual_seed(s)
        assert int(_pick(logits, 1.3, 0.9, g1, top_k=top_k)) == int(_pick(logits, 1.3, 0.9, g2))


def test_top_k_then_top_p_on_the_renormalised_top_k():
    # probabilities 0.4, 0.3, 0.2, 0.1: top_k 2 renormalises to 4/7, 3/7; top_p 0.5 then keeps only the first
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert {int(_pick(logits, 1.0, 0.5, torch.Generator().manual_seed(s), top_k=2)) for s in range(50)} == {0}
    assert {int(_pick(logits, 1.0, 0.6, torch.Generator().manual_seed(s), top_k=2)) for s in range(80)} == {0, 1}


@pytest.mark.parametrize("temperature,top_p", [(math.nan, 1.0), (math.inf, 1.0), (1.0, math.nan), (1.0, -math.inf)])
def test_non_finite_settings_are_a_clear_error(temperature, top_p):
    with pytest.raises(ValueError, match="must be finite"):
        _pick(_logits(), temperature, top_p, None)


# -- sampling.choose: pick's decision with each token's confidence (block diffusion) ----------------------------------


def _rows(n=5, v=32, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(11)) * scale


def _old_greedy(logits):
    """The diffusion loop's temperature-0 choice before the shared sampler: argmax and its plain-softmax probability."""
    conf, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return tok, conf


@pytest.mark.parametrize("temperature", [0.0, -1.0, 1e-40, 5e-324, GREEDY_TEMPERATURE / 2])
def test_choose_below_the_epsilon_is_the_old_greedy_bit_for_bit(temperature):
    logits = _rows()
    tok, conf = choose(logits, temperature, 1.0, torch.Generator().manual_seed(0))
    want_tok, want_conf = _old_greedy(logits)
    assert tok.dtype == torch.long and conf.dtype == torch.float32 and tok.shape == conf.shape == (5,)
    assert torch.equal(tok, want_tok) and torch.equal(conf, want_conf)


def test_choose_top_k_one_is_greedy_at_any_temperature():
    logits = _rows()
    for t in (GREEDY_TEMPERATURE, 1.0, 2.0):
        tok, conf = choose(logits, t, 0.7, torch.Generator().manual_seed(1), top_k=1)
        want_tok, want_conf = _old_greedy(logits)
        assert torch.equal(tok, want_tok) and torch.equal(conf, want_conf)


@pytest.mark.parametrize("top_p", [0.0, 1e-300, 1e-9])
def test_choose_zero_top_p_keeps_the_top_token_with_confidence_one(top_p):
    logits = _rows(scale=0.5)  # flat rows: plain sampling would often leave the argmax
    for s in range(10):
        tok, conf = choose(logits, 2.0, top_p, torch.Generator().manual_seed(s))
        assert torch.equal(tok, logits.argmax(-1)) and torch.equal(conf, torch.ones(5))


def test_choose_top_k_draws_within_the_k_most_probable_with_their_renormalised_probability():
    logits = _rows(scale=0.5)
    top3 = logits.topk(3, dim=-1).indices
    seen = set()
    for s in range(60):
        tok, conf = choose(logits, 1.5, 1.0, torch.Generator().manual_seed(s), top_k=3)
        assert all(int(t) in top3[i].tolist() for i, t in enumerate(tok))
        p = torch.softmax(logits / 1.5, dim=-1)
        want = p.gather(-1, tok[:, None]).view(-1) / p.gather(-1, top3).sum(-1)
        torch.testing.assert_close(conf, want)
        seen |= {(i, int(t)) for i, t in enumerate(tok)}
    assert len(seen) == 15  # every row reached each of its three tokens, and nothing else


def test_choose_sampled_confidence_is_the_drawn_tokens_probability():
    logits = _rows()
    tok, conf = choose(logits, 0.8, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(tok, pick(logits, 0.8, 1.0, torch.Generator().manual_seed(3)))  # one decision
    assert torch.equal(conf, torch.softmax(logits / 0.8, dim=-1).gather(-1, tok[:, None]).view(-1))
    tok, conf = choose(logits, 1.0, 0.5, torch.Generator().manual_seed(3))  # the nucleus, renormalised
    p = torch.softmax(logits, dim=-1)
    sp = p.sort(dim=-1, descending=True).values
    nucleus = (sp * (sp.cumsum(-1) - sp < 0.5)).sum(-1)
    torch.testing.assert_close(conf, p.gather(-1, tok[:, None]).view(-1) / nucleus)


@pytest.mark.parametrize("temperature,top_p", [(math.nan, 1.0), (math.inf, 1.0), (1.0, math.nan)])
def test_choose_non_finite_settings_are_a_clear_error(temperature, top_p):
    with pytest.raises(ValueError, match="must be finite"):
        choose(_rows(), temperature, top_p, None)
