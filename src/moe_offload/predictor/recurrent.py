"""One position of a Mamba2 block in recurrent form, without the transformers wrapper (SeqMoE §5.3's one-step and
recursive prediction run this every decode step).

``transformers``' ``Mamba2Mixer`` computes the same update through its generic path: a depthwise ``conv1d`` over the
concatenated window (on CPU an mkldnn convolution for four taps), dtype round trips, expanded copies of B and C per
head, and the cache's bookkeeping; together they made the predictor the largest overhead of a decode step (issue
17). Here the window update is a shift and the four taps a product-sum, the state update broadcasts, and the
cache's tensors are updated in place. The arithmetic is
the mixer's (``causal_conv1d_update`` + ``mamba2_selective_state_update`` + ``MambaRMSNormGated``); only the order of
the four-tap sum may differ, so results agree with ``Mamba2Model.forward`` to float32 rounding (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_and_ssm_states(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv window ``[1, conv_dim, K]`` and SSM state ``[1, heads, head_dim, N]`` (float32) of Mamba2 layer
    ``layer_idx`` in a transformers ``DynamicCache`` that a prefill has filled.

    Raises:
        RuntimeError: the layer has no state yet (run the predictor's prefill first).
    """
    conv, ssm = cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    if conv is None or ssm is None:
        raise RuntimeError(f"Mamba2 layer {layer_idx} has no recurrent state: run the prefill first")
    return conv, ssm


def mixer_step(mixer, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One position of a ``Mamba2Mixer`` (``n_groups == 1``, SiLU) in recurrent form.

    Args:
        mixer: a transformers ``Mamba2Mixer``.
        x: float32 ``[1, m]``, the normalised block input.
        conv_state: float32 ``[1, conv_dim, K]``, the causal-conv window; shifted by one position in place.
        ssm_state: float32 ``[1, heads, head_dim, N]``; updated in place.
    Returns:
        float32 ``[1, m]``, the mixer's output.
    """
    I, H, P, N = mixer.intermediate_size, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size
    gate, xbc, dt = F.linear(x, mixer.in_proj.weight, mixer.in_proj.bias).split([I, mixer.conv_dim, H], dim=-1)
    conv_state.copy_(conv_state.roll(-1, dims=-1))
    conv_state[:, :, -1] = xbc
    xbc = (conv_state * mixer.conv1d.weight.squeeze(1)).sum(-1)
    if mixer.conv1d.bias is not None:
        xbc = xbc + mixer.conv1d.bias
    hs, B, C = F.silu(xbc).split([I, N, N], dim=-1)
    dt = F.softplus(dt + mixer.dt_bias)                                  # [1, H]
    dA = torch.exp(dt * -torch.exp(mixer.A_log.float()))                 # [1, H]
    hs = hs.view(1, H, P)
    ssm_state.mul_(dA[:, :, None, None]).add_((dt[:, :, None] * hs)[..., None] * B.view(1, 1, 1, N))
    y = (ssm_state @ C.view(1, 1, N, 1)).view(1, H, P) + hs * mixer.D[:, None]
    y = y.view(1, I) * F.silu(gate)                                      # gated RMSNorm, one group
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon) * mixer.norm.weight
    return F.linear(y, mixer.out_proj.weight, mixer.out_proj.bias)


def block_step(block, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One position of a ``Mamba2Block``: ``h + mixer(RMSNorm(h))``; ``h`` float32 ``[1, m]`` -> ``[1, m]``; the
    states are updated in place (see ``mixer_step``)."""
    norm = block.norm
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    return h + mixer_step(block.mixer, x, conv_state, ssm_state)
