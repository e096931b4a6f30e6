"""The routing an experts call's observers see, for models whose experts call gets one route per row.

transformers' experts modules receive the router's decision as ``top_k_index [T, k]`` and ``top_k_weights [T, k]``
(DESIGN.md §4), and the engines hand exactly that to their observers (trace recorders, predictor runners), which
read one row per token. A few models wrap the experts call in a forward of their own that gives every route its own
row, to apply something per route before the weighted sum (Ergo: a learned RMSNorm per expert output). Their
experts call gets ``[T * k, H]`` rows, ``top_k_index [T * k, 1]`` and unit weights, so observers would see k = 1,
T * k "tokens" and no routing weights. The experts' arithmetic is unaffected (every route is still computed once).

``watch_routers`` finds such modules (their class overrides the ``@use_experts_implementation`` forward) and hooks
the router beside them; ``observed_routing`` then gives observers the router's own ``[T, k]`` indices and weights.
"""

from __future__ import annotations

import torch


def router_of(model: torch.nn.Module, experts_name: str) -> torch.nn.Module | None:
    """The router module beside the experts module named ``experts_name`` (its parent's ``gate`` or ``router``;
    transformers' routers return ``(router_logits [T, E], weights [T, k], indices [T, k])``), or None."""
    parent = model.get_submodule(experts_name.rpartition(".")[0])
    for attr in ("gate", "router"):
        router = getattr(parent, attr, None)
        if isinstance(router, torch.nn.Module):
            return router
    return None


def routes_per_row(module: torch.nn.Module) -> bool:
    """True if ``module``'s own class overrides the forward that ``@use_experts_implementation`` dispatches (the
    decorated forward carries ``__wrapped__``), i.e. the experts call may not receive the router's ``[T, k]``."""
    return not hasattr(type(module).forward, "__wrapped__")


def watch_routers(model: torch.nn.Module, experts: list[tuple[str, torch.nn.Module]]) -> list:
    """Hook the router of every experts module in ``experts`` (``[(qualified name, module)]``) that
    ``routes_per_row``, so that its last ``(indices [T, k] int64, weights [T, k])`` is kept on the module.

    Returns:
        the hook handles (``handle.remove()`` undoes one).
    """
    handles = []
    for name, mod in experts:
        router = router_of(model, name) if routes_per_row(mod) else None
        if router is None:
            continue

        def hook(_router, _args, out, mod=mod):
            if isinstance(out, tuple) and len(out) == 3:
                mod._moe_offload_routing = (out[2], out[1])
        handles.append(router.register_forward_hook(hook))
    return handles


def observed_routing(module: torch.nn.Module, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing observers see for one experts call: the call's own ``top_k_index [T, k]`` and ``top_k_weights
    [T, k]``, or, when the call got one route per row (``[T * k, 1]``) and the module's router was watched
    (``watch_routers``), the router's ``[T, k]`` indices and weights of those same routes."""
    routing = getattr(module, "_moe_offload_routing", None)
    if routing is None or top_k_index.shape[1] != 1:
        return top_k_index, top_k_weights
    index, weights = routing
    if index.numel() != top_k_index.numel() or index.shape[1] == 1:
        return top_k_index, top_k_weights
    return index, weights
