"""The predictor's one-step and recursive prediction (SeqMoE §5.3) in numpy, for a float32 predictor on the CPU.

A decode step runs the Mamba2 recurrent update of each predictor once (one-step prediction) and, every
``rollout_every`` steps, ``rollout`` more times (recursive prediction): about thirty operations on vectors of a few
hundred floats each time, where a torch operator's dispatch costs several times its arithmetic (issue 17: the
predictor was ~5% of a decode step on this CPU). ``HostStep`` runs the same arithmetic as
``predictor.recurrent.block_step`` (``Mamba2Mixer``'s ``causal_conv1d_update`` + selective state update + gated
RMSNorm) on numpy views of the predictor's parameters and of the recurrent state's tensors, so the state is updated
in place where the torch path would update it, and training that changes the parameters in place is seen at the
next call. Results agree with the torch path to float32 rounding (exp, SiLU and the sums may round differently;
tested), and the top-k of a recursive input is the same set unless two logits tie exactly.

``SeqPredictor.step`` / ``rollout`` take this path for CPU float32 predictors outside ``torch.compile`` (graph
mode's captured predictor stays in torch), so the runtime, the simulator's forecast replay and ``predictor eval``
all run the same code.
"""

from __future__ import annotations

import numpy as np
import torch

from .recurrent import conv_and_ssm_states


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU float32 tensor's data."""
    return t.detach().numpy()


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20): ``x`` above 20, else ``log1p(exp(x))``."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * weight


class _Block:
    """numpy views of one ``Mamba2Block``'s parameters (``n_groups == 1``)."""

    def __init__(self, block):
        mixer = block.mixer
        self.norm_w, self.norm_eps = _np(block.norm.weight), block.norm.variance_epsilon
        self.I, self.H, self.P, self.N = mixer.intermediate_size, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size
        self.conv_dim = mixer.conv_dim
        self.w_in = _np(mixer.in_proj.weight)
        self.b_in = None if mixer.in_proj.bias is None else _np(mixer.in_proj.bias)
        self.conv_w = _np(mixer.conv1d.weight)[:, 0]                       # [conv_dim, K]
        self.conv_b = None if mixer.conv1d.bias is None else _np(mixer.conv1d.bias)
        self.dt_bias, self.A_log, self.D = _np(mixer.dt_bias), _np(mixer.A_log), _np(mixer.D)
        self.gnorm_w, self.gnorm_eps = _np(mixer.norm.weight), mixer.norm.variance_epsilon
        self.w_out = _np(mixer.out_proj.weight)
        self.b_out = None if mixer.out_proj.bias is None else _np(mixer.out_proj.bias)

    def step(self, h: np.ndarray, conv: np.ndarray, ssm: np.ndarray) -> np.ndarray:
        """``h + mixer(RMSNorm(h))`` for one position: ``h`` float32 ``[m]``; ``conv [conv_dim, K]`` and
        ``ssm [H, P, N]`` (views of the cache's tensors) updated in place."""
        I, H, P, N = self.I, self.H, self.P, self.N
        x = _rms_norm(h, self.norm_w, self.norm_eps)
        z = self.w_in @ x
        if self.b_in is not None:
            z += self.b_in
        gate, xbc, dt = z[:I], z[I:I + self.conv_dim], z[I + self.conv_dim:]
        conv[:, :-1] = conv[:, 1:]
        conv[:, -1] = xbc
        xbc = (conv * self.conv_w).sum(-1)
        if self.conv_b is not None:
            xbc += self.conv_b
        xbc = _silu(xbc)
        hs, B, C = xbc[:I].reshape(H, P), xbc[I:I + N], xbc[I + N:]
        dt = _softplus(dt + self.dt_bias)                                  # [H]
        dA = np.exp(dt * -np.exp(self.A_log))
        ssm *= dA[:, None, None]
        ssm += (dt[:, None] * hs)[..., None] * B
        y = (ssm @ C + hs * self.D[:, None]).reshape(I) * _silu(gate)
        y = _rms_norm(y, self.gnorm_w, self.gnorm_eps)
        out = self.w_out @ y
        if self.b_out is not None:
            out += self.b_out
        return h + out


class HostStep:
    """One ``SeqPredictor``'s recurrent execution modes in numpy (module docstring).

    Args:
        pred: a ``predictor.model.SeqPredictor`` with float32 parameters on the CPU.
    """

    def __init__(self, pred):
        self.n, self.e, self.k = pred.spec.num_layers, pred.num_experts, pred.top_k
        self.w_inp, self.b_inp = _np(pred.inp.weight), _np(pred.inp.bias)
        self.blocks = [_Block(b) for b in pred.backbone.layers]
        nf = pred.backbone.norm_f
        self.normf_w, self.normf_eps = _np(nf.weight), nf.variance_epsilon
        self.w_out, self.b_out = _np(pred.out.weight), _np(pred.out.bias)
        self.skip = None if pred.skip is None else _np(pred.skip)

    @staticmethod
    def states(state) -> list[tuple[np.ndarray, np.ndarray]]:
        """numpy views ``(conv [conv_dim, K], ssm [H, P, N])`` per Mamba2 layer of a prefilled ``DynamicCache``
        (``predictor.recurrent.conv_and_ssm_states``; batch 1)."""
        out = []
        for i in range(len(state.layers)):
            conv, ssm = conv_and_ssm_states(state, i)
            out.append((_np(conv)[0], _np(ssm)[0]))
        return out

    def step(self, x: np.ndarray, states: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """One-step prediction: Psi features ``x`` float32 ``[n * e]`` -> logits float32 ``[n, e]`` for the next
        step; ``states`` (``HostStep.states``) advance in place (``SeqPredictor.step``)."""
        h = self.w_inp @ x + self.b_inp
        for block, (conv, ssm) in zip(self.blocks, states):
            h = block.step(h, conv, ssm)
        y = self.w_out @ _rms_norm(h, self.normf_w, self.normf_eps) + self.b_out
        if self.skip is not None:
            y += self.skip * (x > 0)
        return y.reshape(self.n, self.e)

    def psi_topk(self, logits: np.ndarray) -> np.ndarray:
        """``features.psi_topk`` in numpy: ``logits [n, e]`` -> float32 ``[n * e]``, the softmax of each layer's
        top-k logits (zeros elsewhere)."""
        top = np.argpartition(logits, self.e - self.k, axis=1)[:, self.e - self.k:]
        val = np.take_along_axis(logits, top, 1)
        val = np.exp(val - val.max(1, keepdims=True))
        out = np.zeros_like(logits)
        np.put_along_axis(out, top, val / val.sum(1, keepdims=True), 1)
        return out.reshape(-1)

    def rollout(self, first: np.ndarray, states: list[tuple[np.ndarray, np.ndarray]], steps: int) -> np.ndarray:
        """Recursive prediction (``SeqPredictor.rollout``): ``first [n, e]`` logits -> float32 ``[steps, n, e]``;
        ``states`` are restored afterwards."""
        snap = [(c.copy(), s.copy()) for c, s in states]
        outs = np.empty((steps, self.n, self.e), dtype=np.float32)
        cur = first
        try:
            for j in range(steps):
                cur = outs[j] = self.step(self.psi_topk(cur), states)
        finally:
            for (c, s), (c0, s0) in zip(states, snap):
                c[...] = c0
                s[...] = s0
        return outs


def host_step_for(pred, x: torch.Tensor) -> HostStep | None:
    """``pred``'s ``HostStep`` when the numpy path applies to input ``x``: float32 parameters and input on the CPU,
    no autograd, not inside ``torch.compile``; else None (the torch path). Made at the first call and kept in
    ``pred._host_step`` (False: the parameters are not CPU float32); ``SeqPredictor`` drops it when its parameters
    are moved, cast or loaded (``_apply``, ``load_state_dict``), and in-place updates (training) need nothing."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled() \
            or torch.compiler.is_compiling():
        return None
    hs = pred.__dict__.get("_host_step")
    if hs is None:
        host = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pred.parameters())
        hs = pred.__dict__["_host_step"] = HostStep(pred) if host else False
    return hs or None
