"""Trace collection through the runtime's own router hook (DESIGN.md §7).

``TraceRecorder`` registers an observer on the offload engine, which sees every MoE layer's ``top_k_index`` and
``top_k_weights`` exactly as the offloaded experts receive them; with ``router_probs`` it also hooks each router
module (``gate``/``router`` beside the experts module; transformers' routers return
``(router_logits [T, E], weights, indices)``) and keeps ``softmax(router_logits)``; a router with classes past the
E experts (Zaya's skip expert, index E, which computes nothing) keeps the experts' columns of that softmax. With ``xl_depth = d > 0`` it also records, per decode step and MoE layer, the cross-layer
forecast of the next d layers (``runtime.cross_layer.CrossLayerForecaster``, the very computation the ``xl`` and
``seqmoe-xl`` policies run), so the simulator replays what the runtime saw.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import MoeOffloadError
from ..models.loader import LoadedModel, experts_modules
from ..runtime.route_rows import router_of
from .format import HookedRecorder, Trace


class TraceRecorder(HookedRecorder):
    """Records a routing trace while ``generation.generate.run`` runs (pass it as ``recorder=``).

    Args:
        lm: an offloaded model (``load_offloaded``); FullLoad has no engine to observe.
        router_probs: also record softmax router probabilities ``[T, E]`` per MoE layer.
        source: free text stored in the header (what produced the trace).
        xl_depth: d > 0: also record the cross-layer forecasts of the next d MoE layers (``Trace.xl_probs``).
    Raises:
        MoeOffloadError: FullLoad (no engine); with ``xl_depth``, a model whose routers cross-layer forecasts cannot
            call (``CrossLayerForecaster``).
    Call ``close()`` (or use it as a context manager) to remove the hooks.
    """

    def __init__(self, lm: LoadedModel, router_probs: bool = False, source: str = "", xl_depth: int = 0):
        if lm.engine is None:
            raise MoeOffloadError("trace collection needs the offloaded runtime (not --full-load)")
        self.lm = lm
        self.L, self.E, self.k = lm.num_moe_layers, lm.num_experts, lm.top_k
        self.source = source
        self._layer_ids: list[torch.Tensor | None] = [None] * self.L
        self._layer_w: list[torch.Tensor | None] = [None] * self.L
        self._layer_p: list[torch.Tensor | None] = [None] * self.L
        self._rows_ids, self._rows_w, self._rows_p, self._rows_req, self._rows_step = [], [], [], [], []
        self._prompts: list[list[int]] = []
        self._requests: list[dict] = []
        self._request = -1
        self._handles = []
        self.xl = None
        self._layer_xl: list[torch.Tensor | None] = [None] * self.L
        self._rows_xl: list[np.ndarray] = []
        if xl_depth:
            from ..runtime.cross_layer import CrossLayerForecaster

            self.xl = CrossLayerForecaster(lm.model, experts_modules(lm.model), self.E, xl_depth)
        lm.engine.observers.append(self._observe)
        self.router_probs = router_probs
        if router_probs:
            for layer, (name, _) in enumerate(experts_modules(lm.model)):
                router = router_of(lm.model, name)
                if router is None:
                    raise MoeOffloadError(f"{name}: no router module beside the experts; cannot record probabilities")
                self._handles.append(router.register_forward_hook(self._router_hook(layer)))

    def _observe(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        self._layer_ids[layer] = top_k_index.detach().to("cpu", torch.int16)
        self._layer_w[layer] = top_k_weights.detach().to("cpu", torch.float16)
        if self.xl is not None:
            probs = torch.zeros(self.xl.depth, self.E)
            got = self.xl.probs(layer)
            if got is not None:
                probs[:got.shape[0]] = torch.from_numpy(got)
            self._layer_xl[layer] = probs

    def _router_hook(self, layer: int):
        def hook(module, args, out):
            logits = out[0] if isinstance(out, tuple) else out
            probs = torch.softmax(logits.detach().float(), dim=-1)[..., :self.E]
            self._layer_p[layer] = probs.to("cpu", torch.float16)
        return hook

    def start_request(self, index: int, prompt_ids: list[int]) -> None:
        """A new request begins with these prompt token ids."""
        self._request = index
        self._prompts.append(list(prompt_ids))
        self._requests.append({"prompt_tokens": len(prompt_ids), "decode_steps": 0})

    def end_step(self, step: int) -> None:
        """A forward pass (``step`` 0 = prefill) finished: stack what every MoE layer saw into rows."""
        if any(t is None for t in self._layer_ids):
            raise RuntimeError("a forward pass finished without every MoE layer reporting its routing")
        self._rows_ids.append(torch.stack(self._layer_ids, dim=1).numpy())
        self._rows_w.append(torch.stack(self._layer_w, dim=1).numpy())
        if self.router_probs:
            self._rows_p.append(torch.stack(self._layer_p, dim=1).numpy())
        n = self._rows_ids[-1].shape[0]
        self._rows_req.append(np.full(n, self._request, np.int32))
        self._rows_step.append(np.full(n, step, np.int32))
        if step > 0:
            self._requests[-1]["decode_steps"] = step
            if self.xl is not None:
                self._rows_xl.append(torch.stack(self._layer_xl).unsqueeze(0).numpy())
        self._layer_ids = [None] * self.L
        self._layer_w = [None] * self.L
        self._layer_p = [None] * self.L

    def trace(self) -> Trace:
        """The trace recorded so far."""
        lm = self.lm
        header = {"model_id": lm.model_id, "model_type": lm.arch.model_type, "num_moe_layers": self.L,
                  "num_experts": self.E, "top_k": self.k, "synthetic": False, "requests": self._requests,
                  "source": self.source}
        cat = (lambda xs, shape, dt: np.concatenate(xs) if xs else np.zeros(shape, dt))
        return Trace(header,
                     cat(self._rows_ids, (0, self.L, self.k), np.int16),
                     cat(self._rows_w, (0, self.L, self.k), np.float16),
                     cat(self._rows_req, (0,), np.int32), cat(self._rows_step, (0,), np.int32),
                     np.array([t for p in self._prompts for t in p], np.int32),
                     cat(self._rows_p, (0, self.L, self.E), np.float16) if self.router_probs else None,
                     cat(self._rows_xl, (0, self.L, self.xl.depth, self.E), np.float32) if self.xl else None)

    def close(self) -> None:
        """Remove the engine observer and router hooks."""
        if self._observe in self.lm.engine.observers:
            self.lm.engine.observers.remove(self._observe)
        if self.xl is not None:
            self.xl.close()
        super().close()


def collect_trace(lm: LoadedModel, prompts: list[str], max_new_tokens: int, *, router_probs: bool = False,
                  xl_depth: int = 0, source: str = "", progress: bool = False) -> Trace:
    """``trace collect`` on an autoregressive model: generate greedily (``generation.generate.run``) while a
    ``TraceRecorder`` records the routing (``router_probs``, ``xl_depth``: as ``TraceRecorder``).

    Raises:
        MoeOffloadError: as ``TraceRecorder``.
    """
    from ..generation.generate import run

    with TraceRecorder(lm, router_probs=router_probs, source=source, xl_depth=xl_depth) as rec:
        run(lm, prompts, max_new_tokens, progress=progress, recorder=rec)
        return rec.trace()


def collect_diffusion_trace(lm: LoadedModel, prompts: list[str], max_new_tokens: int, params: dict, *,
                            source: str = "", progress: bool = False):
    """``trace collect`` on a diffusion model (FullLoad): the block-diffusion loop with ``params``
    (``generation.diffusion.loop_params``) while a ``trace.diffusion.DiffusionTraceRecorder`` records each step's
    expert token counts. Returns ``(diffusion trace, per-request results)``."""
    from ..generation.diffusion import run_diffusion
    from .diffusion import DiffusionTraceRecorder

    with DiffusionTraceRecorder(lm, params["block_length"], source=source) as rec:
        _, _, results = run_diffusion(lm, prompts, max_new_tokens, progress=progress, recorder=rec, **params)
        return rec.trace(results), results

