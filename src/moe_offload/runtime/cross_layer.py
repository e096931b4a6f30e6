"""Cross-layer forecasts, computed: the next layers' routers applied to this layer's router input (Fate, arXiv
2502.12224; ProMoE; Pre-gated MoE).

The router inputs of adjacent MoE layers differ only by a residual update, so at MoE layer ``l`` of decode step
``s`` the routers of layers ``l+1 .. l+d``, called on layer ``l``'s router input, forecast the experts those layers
will choose for the *same* token — no training, the model's own router functions (softmax, sigmoid + bias, group
limits, ...), called as the model calls them. ``CrossLayerForecaster`` captures each router's input (a forward
pre-hook) and calls the later routers on it; ``xl_probabilities`` turns a router's output into a probability per
expert. ``predictor.cross_layer`` feeds these forecasts to the policies ``xl`` and ``seqmoe-xl``;
``trace.collect`` records them (``trace collect --xl-forecasts``) so the simulator replays what the runtime saw.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ..core.forecast import XL_DEPTH
from ..errors import MoeOffloadError
from . import huge_pages
from .kernels import native
from .route_rows import router_of


#: router weight dtypes the one-token decode path of ``CrossLayerForecaster.probs`` runs in numpy (as float32)
HOST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _router_of(model: torch.nn.Module, experts_name: str, where: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(parent block, router module)`` of the experts module named ``experts_name``: the ``gate`` or ``router``
    beside it (transformers' MoE blocks; ``runtime.route_rows.router_of``).

    Raises:
        MoeOffloadError: no router module; a block that rewrites its router's choices before the experts call
            (LongCat-Flash's zero-computation experts, ``zero_expert_num``: their ids are mapped onto routed experts
            with weight 0), so a router call does not tell which experts the layer computes."""
    router = router_of(model, experts_name)
    if router is None:
        raise MoeOffloadError(f"cross-layer forecasts: no router module (gate/router) beside {experts_name}")
    parent = model.get_submodule(experts_name.rpartition(".")[0])
    if getattr(parent, "zero_expert_num", None):
        raise MoeOffloadError(f"{where}: the MoE block maps its router's zero-computation experts onto routed ones "
                              "(zero_expert_num), so a router call does not tell which experts it computes; "
                              "cross-layer forecasts cannot be applied")
    return parent, router


def _extra_args(parent: torch.nn.Module, router: torch.nn.Module, where: str) -> list[str]:
    """Names of the router's forward arguments after the hidden states; each must be a tensor (or None) of the MoE
    block itself (an expert bias the block passes, e.g. AFMoE, LFM2-MoE, HunYuan-V3, MiniMax-M2), else the router
    depends on more than the hidden state (a hash router's token ids, a previous layer's router state) and cannot
    be applied to another layer's hidden state."""
    params = list(inspect.signature(router.forward).parameters.values())[1:]
    names = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        val = getattr(parent, p.name, None)
        if not (val is None and hasattr(parent, p.name)) and not isinstance(val, torch.Tensor):
            raise MoeOffloadError(f"cross-layer forecasts: the router of {where} ({type(router).__name__}) also "
                                  f"takes {p.name!r}, which is not the MoE block's own tensor; it cannot be applied "
                                  "to another layer's hidden state")
        names.append(p.name)
    return names


def xl_probabilities(router_out, num_experts: int) -> torch.Tensor:
    """One router output as a probability per expert (what a cross-layer forecast gives the decision core).

    ``p = (1 - eps) * onehot(top_k_index) / k + eps * softmax(router_logits[:, :E])`` with ``eps = 1 / (2(k + 1))``:
    the router's own top-k first (each at least ``(1 - eps) / k > eps``, so the top-k of ``p`` is exactly the
    router's, whatever its scoring: softmax, sigmoid + bias, group limits), the rest ranked by the router logits
    (exact for softmax routers; beyond the top-k an approximation for biased or group-limited ones); sums to 1 over
    the experts like SeqMoE's forecasts (§5.3), so the two blend and mix in one CacheScore.

    Args:
        router_out: the router's return value ``(router_logits [T, E'] (E' >= E), top_k_weights [T, k],
            top_k_index [T, k] int, ...)`` (transformers' router convention; Inkling adds shared-expert gammas).
        num_experts: E.
    Returns:
        float32 ``[T, E]`` on the router's device.
    Raises:
        MoeOffloadError: an output that is not such a tuple.
    """
    logits, index = _logits_and_index(router_out, num_experts)
    return _topk_mixture(logits, index)


def _logits_and_index(router_out, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32 logits [T, E], int64 top_k_index [T, k])`` of one router output (see ``xl_probabilities``)."""
    if not (isinstance(router_out, tuple) and len(router_out) >= 3 and isinstance(router_out[2], torch.Tensor)
            and not router_out[2].is_floating_point()):
        raise MoeOffloadError("cross-layer forecasts: the router does not return (logits, weights, indices)")
    logits, _, index = router_out[:3]
    k = index.shape[-1]
    return logits.reshape(-1, logits.shape[-1])[:, :num_experts].float(), index.reshape(-1, k).long()


def _topk_mixture(logits: torch.Tensor, index: torch.Tensor, soft: torch.Tensor | None = None) -> torch.Tensor:
    """``(1 - eps) * onehot(index) / k + eps * softmax(logits)`` over the last dimension (``xl_probabilities``):
    float32 ``logits [..., E]`` (or their softmax ``soft``), int64 ``index [..., k]`` -> float32 ``[..., E]``."""
    k = index.shape[-1]
    eps = 1.0 / (2 * (k + 1))
    if soft is None:
        soft = torch.softmax(logits, dim=-1)
    return torch.zeros_like(soft).scatter_(-1, index, (1.0 - eps) / k).add_(soft, alpha=eps)


def _one_token_mixture(w: np.ndarray, x: np.ndarray, n: int, k: int) -> np.ndarray:
    """``_topk_mixture`` of one token's logits for n linear softmax top-k routers, in numpy: the decode step's case
    (a few dozen floats per router, where each torch op's dispatch costs more than its arithmetic).

    Args:
        w: float32 ``[n * E, H]``, the n routers' weights stacked (``CrossLayerForecaster._stack_routers``).
        x: float32 ``[H]``, the token's router input.
        n, k: routers, and the experts each routes a token to.
    Returns:
        float32 ``[n, E]``: ``(1 - eps) * onehot(top-k of softmax) / k + eps * softmax(logits)``, ``eps = 1 / (2(k +
        1))`` (the top-k set as ``torch.topk``'s up to exact ties).
    """
    logits = (w @ x).reshape(n, -1)
    soft = np.exp(logits - logits.max(axis=1, keepdims=True))
    soft /= soft.sum(axis=1, keepdims=True)
    eps = 1.0 / (2 * (k + 1))
    top = np.argpartition(soft, soft.shape[1] - k, axis=1)[:, -k:]
    out = soft * np.float32(eps)
    out[np.arange(n)[:, None], top] += np.float32((1.0 - eps) / k)
    return out


def _linear_softmax_topk(router: torch.nn.Module, extra: list[str]) -> int | None:
    """k when ``router`` is a bias-free linear router with softmax top-k (Mixtral, Qwen-MoE, OLMoE, ...): its only
    parameter is ``weight [E', H]``, it has no buffers and no extra arguments, and on a probe of random inputs its
    logits are exactly ``F.linear(x, weight)`` and its top-k indices those of ``softmax(logits)``. Else None."""
    params = dict(router.named_parameters())
    w = params.get("weight")
    if extra or len(params) != 1 or w is None or w.dim() != 2 or any(True for _ in router.buffers()):
        return None
    gen = torch.Generator().manual_seed(0)
    try:  # a router this probe cannot run (e.g. a quantized weight) takes the router-by-router path
        x = torch.randn(8, w.shape[1], generator=gen).to(w.device, w.dtype)
        with torch.no_grad():
            out = router(x)
            if not (isinstance(out, tuple) and len(out) >= 3 and isinstance(out[2], torch.Tensor)
                    and not out[2].is_floating_point() and out[0].shape == (8, w.shape[0])):
                return None
            logits = torch.nn.functional.linear(x, w)
            k = out[2].shape[-1]
            want = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).indices
            same = torch.equal(out[0], logits) and torch.equal(out[2].long().sort(-1).values, want.sort(-1).values)
    except (RuntimeError, TypeError, ValueError):
        return None
    return k if same else None


def _on_huge_pages(weights: list) -> list:
    """The CPU tensors of ``weights`` (anything else kept as it is) as views of one buffer on huge pages
    (``runtime.huge_pages``) holding copies of them, each at a 64-byte boundary: the cross-layer forecast reads them
    between two layers' expert kernels, whose streams evict them from the caches and their 4 KiB pages from the TLB
    (session 51: the native forecast took 68 us in the decode step where it took 80 from ordinary pages)."""
    def fits(w) -> bool:
        return isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.is_contiguous()

    align = 64
    spans = [-(-w.numel() * w.element_size() // align) * align if fits(w) else 0 for w in weights]
    if not any(spans):
        return weights
    buf = huge_pages.empty((sum(spans),), torch.uint8, min_bytes=0)
    out, at = [], 0
    for w, span in zip(weights, spans):
        if not span:
            out.append(w)
            continue
        view = buf[at:at + w.numel() * w.element_size()].view(w.dtype).view(w.shape)
        view.copy_(w)
        out.append(view)
        at += span
    return out


class CrossLayerForecaster:
    """The model's routers, one per MoE layer, applied to earlier layers' router inputs.

    Args:
        model: the transformers model (``LoadedModel.model``).
        experts: ``[(qualified name, experts module)]`` in MoE-layer order (``models.capability.experts_modules``).
        num_experts: E routed experts per MoE layer.
        depth: d >= 1, later layers forecast by each layer.
    Raises:
        MoeOffloadError: ``depth < 1``; a MoE layer without a router module, or whose router needs more than the
            hidden state (one line naming the layer and the argument).

    ``probs(layer)`` after the model ran MoE layer ``layer``'s router in the current forward pass gives float32
    ``[n, E]`` on the host (numpy; ``n = min(d, L - 1 - layer)``, the token mean of ``xl_probabilities``): row j
    forecasts MoE layer ``layer + 1 + j``. Call ``close()`` to remove the hooks.
    """

    def __init__(self, model: torch.nn.Module, experts: list, num_experts: int, depth: int = XL_DEPTH):
        if depth < 1:
            raise MoeOffloadError(f"--xl-depth must be >= 1, got {depth}")
        self.depth, self.E, self.L = depth, num_experts, len(experts)
        self.routers: list[tuple[torch.nn.Module, torch.nn.Module, list[str]]] = []
        for layer, (name, _) in enumerate(experts):
            parent, router = _router_of(model, name, f"MoE layer {layer}")
            self.routers.append((parent, router, _extra_args(parent, router, f"MoE layer {layer}")))
        self.inputs: list[torch.Tensor | None] = [None] * self.L
        self._handles = [r.register_forward_pre_hook(self._capture(i), with_kwargs=True)
                         for i, (_, r, _) in enumerate(self.routers)]
        self._stacked = self._stack_routers()
        self._kernel = native()   # router_forecast, the one-token path, when the native kernels are built
        self._host_w = self._host_weights()

    def _stack_routers(self) -> list[tuple[torch.Tensor, int] | None]:
        """Per MoE layer: ``(weights of layers layer+1 .. layer+n stacked [n * E', H], k)`` when each of those
        routers is a linear softmax top-k router (``_linear_softmax_topk``) of the same shape and k, so that
        ``probs`` runs them as one GEMM (d x the router weights, copied once: on the CPU into one buffer on huge
        pages, ``_on_huge_pages``); else None."""
        ks = [_linear_softmax_topk(r, extra) for _, r, extra in self.routers]
        out: list[tuple[torch.Tensor, int] | None] = []
        for layer in range(self.L):
            nxt = range(layer + 1, min(self.L, layer + 1 + self.depth))
            if not nxt or any(ks[j] is None or ks[j] != ks[nxt[0]] for j in nxt):
                out.append(None)
                continue
            ws = [self.routers[j][1].weight for j in nxt]
            if len({w.shape for w in ws}) != 1 or ws[0].shape[0] != self.E:
                out.append(None)
                continue
            out.append((torch.cat([w.detach() for w in ws]), ks[nxt[0]]))
        placed = _on_huge_pages([f[0] if f is not None else None for f in out])
        return [None if f is None else (w, f[1]) for f, w in zip(out, placed)]

    def _host_weights(self) -> list[torch.Tensor | np.ndarray | None]:
        """Per MoE layer, the stacked router weights (``_stacked``) for the one-token decode path of ``probs`` when
        they are on the CPU in one of ``HOST_DTYPES``, else None: as they are (float32, bfloat16: the huge-page
        views of ``_stack_routers``, no copy) for the native ``router_forecast``; else as numpy float32
        ``[n * E, H]`` (a widened copy for the 16-bit ones: d x the routers' bytes, e.g. 6.6 MB for 30 layers of
        32 x 576). The forecast's logits are then float32 dot products
        of the router's own weights, where the router computes them in its dtype: the chance of each expert moves
        by the rounding, the model's output not at all."""
        out: list[torch.Tensor | np.ndarray | None] = []
        for f in self._stacked:
            if f is None or f[0].device.type != "cpu" or f[0].dtype not in HOST_DTYPES:
                out.append(None)
            elif self._kernel is not None and f[0].dtype in (torch.float32, torch.bfloat16):
                out.append(f[0].contiguous())
            else:
                out.append(f[0].float().contiguous().numpy())
        return out

    def _capture(self, layer: int):
        def hook(module, args, kwargs):
            self.inputs[layer] = args[0] if args else kwargs["hidden_states"]
        return hook

    def route(self, layer: int, hidden_states: torch.Tensor):
        """MoE layer ``layer``'s router on ``hidden_states [..., H]``, called as its MoE block calls it: the
        router's output tuple."""
        parent, router, extra = self.routers[layer]
        return router(hidden_states, *[getattr(parent, n) for n in extra])

    @torch.no_grad()
    def probs(self, layer: int) -> np.ndarray | None:
        """float32 ``[n, E]`` (numpy, on the host: the decision core's side) forecasts of layers ``layer + 1 ..
        layer + n`` from this pass's router input of ``layer`` (None at the last layer or before the router ran)."""
        x = self.inputs[layer]
        n = min(self.depth, self.L - 1 - layer)
        if x is None or n < 1:
            return None
        fast = self._stacked[layer]
        if fast is not None:  # linear softmax top-k routers: one GEMM for the n layers
            w, k = fast
            hw = self._host_w[layer]
            if hw is not None and x.device.type == "cpu" and x.numel() == hw.shape[1]:
                if isinstance(hw, torch.Tensor):  # one native call (runtime.kernels: router_forecast)
                    return self._kernel.router_forecast(hw, x.detach(), n, k).numpy()
                return _one_token_mixture(hw, x.detach().reshape(-1).float().numpy(), n, k)
            x = x.reshape(-1, w.shape[1])
            logits = torch.nn.functional.linear(x, w).view(x.shape[0], n, -1).transpose(0, 1).float()
            soft = torch.softmax(logits, dim=-1)                           # [n, T, E]
            return _topk_mixture(logits, torch.topk(soft, k, dim=-1).indices, soft).mean(1).cpu().numpy()
        got = [_logits_and_index(self.route(layer + 1 + j, x), self.E) for j in range(n)]
        if len({g[1].shape for g in got}) != 1:  # routers of different top-k: one layer at a time
            out = torch.stack([_topk_mixture(*g).mean(0) for g in got])
        else:
            logits = torch.stack([g[0] for g in got])        # [n, T, E]: one softmax / scatter for the n layers
            index = torch.stack([g[1] for g in got])
            out = _topk_mixture(logits, index).mean(1)
        return out.cpu().numpy()

    def close(self) -> None:
        """Remove the router hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
