"""The shared sampler ``generate._pick`` at the edges of its settings (issue 34): a temperature below
``GREEDY_TEMPERATURE`` is greedy and never NaN; ``top_p`` 0 / tiny keeps only the most probable token; ``top_k`` keeps
exactly k tokens (1: greedy; 0, negative, >= V: off); non-finite settings are a clear ValueError."""

import math

import pytest
import torch

from moe_offload.generate import GREEDY_TEMPERATURE, _pick


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
