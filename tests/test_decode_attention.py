"""The attention of a decode step on the native kernel (issue 46, ``runtime.decode_attention``): its values against
float64 scaled_dot_product_attention (grouped-query heads, masks as sdpa takes them, float32 and bfloat16 caches,
value heads of another width); bit for bit the same whatever the thread count, the AVX2 or portable path, or the
batch a sequence is in; selected on a model that uses sdpa, left to sdpa for what it does not compute."""

import pytest
import torch
import torch.nn.functional as F

from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full
from moe_offload.runtime import kernels
from moe_offload.runtime.decode_attention import NAME, decode_attention_forward

kernel = kernels.native()
pytestmark = pytest.mark.skipif(kernel is None, reason="the native kernels are not built here")


def _qkv(dtype, B=2, Hq=9, Hkv=3, S=37, D=64, Dv=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    return q, k, v


def _reference(q, k, v, mask, scale):
    if mask is not None and mask.is_floating_point():
        mask = mask.double()  # (sdpa in float64 misreads a float32 mask)
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("shape", [dict(), dict(Hq=4, Hkv=4, S=1, D=13, Dv=7), dict(B=1, Hq=8, Hkv=1, S=300, D=192,
                                                                                      Dv=128)])
def test_values_against_sdpa(dtype, mask_kind, shape):
    q, k, v = _qkv(dtype, **shape)
    B, S = q.shape[0], k.shape[2]
    mask = None
    if mask_kind is not None:
        keep = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(1)) > 0.3
        keep[..., 0] = True  # one visible position per row
        mask = keep if mask_kind == "bool" else torch.zeros(B, 1, 1, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    got = kernel.decode_attention(q, k, v, mask, 0.125)
    ref = _reference(q, k, v, mask, 0.125)
    assert got.shape == ref.shape and got.dtype == q.dtype
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(S=200), dict(S=203, D=40, Dv=40), dict(S=7, D=13, Dv=72),
                                   dict(S=66, D=192, Dv=128)])
def test_bit_for_bit_whatever_the_threads_path_or_batch(dtype, shape):
    """The AVX2 path (scores four positions at a time, the values' sum in registers up to 64 wide) and the portable
    path agree bit for bit, at any thread count and batch position; masked positions (zero weights) included."""
    q, k, v = _qkv(dtype, B=3, **shape)
    mask = torch.rand(3, 1, 1, k.shape[2], generator=torch.Generator().manual_seed(2)) > 0.2
    mask[..., 0] = True
    before = torch.get_num_threads()
    for m in (None, mask):
        try:
            torch.set_num_threads(1)
            one = kernel.decode_attention(q, k, v, m, 0.125)
            torch.set_num_threads(2)
            two = kernel.decode_attention(q, k, v, m, 0.125)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)
        assert torch.equal(one, kernel.decode_attention(q, k, v, m, 0.125, True))  # the portable path
        alone = kernel.decode_attention(q[1:2], k[1:2], v[1:2], None if m is None else m[1:2], 0.125)
        assert torch.equal(one[1:2], alone)


def test_a_fully_masked_row_gives_zeros_and_bad_input_is_refused():
    q, k, v = _qkv(torch.float32, B=1)
    out = kernel.decode_attention(q, k, v, torch.zeros(1, 1, 1, k.shape[2], dtype=torch.bool), 0.125)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(RuntimeError, match="shapes"):
        kernel.decode_attention(q, k[:, :2], v, None, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.decode_attention(q, k.half(), v.half(), None, 0.125)


class _Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("kw", [dict(softcap=30.0), dict(output_attentions=True), dict(sinks=torch.zeros(9))])
def test_what_the_kernel_does_not_compute_goes_to_sdpa(kw, monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    called = []
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: called.append(k) or ("sdpa", None))
    q, k, v = _qkv(torch.float32)
    assert decode_attention_forward(_Attn(), q, k, v, None, **kw)[0] == "sdpa"
    assert decode_attention_forward(_Attn(), q.expand(-1, -1, 2, -1), k, v, None)[0] == "sdpa"  # two queries
    longer = torch.ones(q.shape[0], 1, 1, k.shape[2] + 1, dtype=torch.bool)  # a mask of other positions
    assert decode_attention_forward(_Attn(), q, k, v, longer)[0] == "sdpa"
    out, _ = decode_attention_forward(_Attn(), q, k, v, None, scaling=0.125)
    assert torch.equal(out, kernel.decode_attention(q, k, v, None, 0.125)) and len(called) == 3


def test_a_model_runs_it_and_agrees_with_sdpa(tiny_dirs, monkeypatch):
    """FullLoad selects it (decode steps run the kernel, prefill sdpa); against the same model on sdpa the logits
    agree within 1e-5 of their scale and the greedy tokens are the same."""
    ours = load_full(tiny_dirs["qwen3_moe"], device="cpu")
    assert ours.model.config._attn_implementation == NAME
    theirs = load_full(tiny_dirs["qwen3_moe"], device="cpu")
    theirs.model.set_attn_implementation("sdpa")
    ids = encode_prompt(ours.tokenizer, "Hello there, how are you today?")
    calls = []
    real = kernel.decode_attention
    monkeypatch.setattr(kernels, "_state", dict(kernels._state, module=_Counting(real, calls)))
    a, _, _ = generate_ids(ours, ids, 10)
    assert len(calls) == 9 * ours.model.config.num_hidden_layers  # every decode step, every layer
    b, _, _ = generate_ids(theirs, ids, 10)
    assert a == b


class _Counting:
    def __init__(self, real, calls):
        self.real, self.calls = real, calls

    def decode_attention(self, *args):
        self.calls.append(1)
        return self.real(*args)

    def __getattr__(self, name):
        return getattr(kernel, name)
