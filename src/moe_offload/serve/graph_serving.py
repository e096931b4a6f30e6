"""``serve --graph``: the requests decoded by graph mode's compiled step (``graph.decode.GraphDecoder``), compiled
once when the server starts, so no client waits for the compiler (issue 46: "compile once per serve").

The server then runs batch 1 (the compiled step decodes one sequence) over a static KV cache of ``--max-context``
positions, one compiled step for every request. The pool is sized by ``--residency`` / ``--slots`` (graph mode's
``load_graph``), not by ``--memory-budget``; the experts live in host memory (``--host-store pinned``); policies as
``generate --graph``.
"""

from __future__ import annotations

from ..errors import MoeOffloadError


def check_graph_config(cfg, diffusion: dict | None) -> None:
    """Refuse what ``serve --graph`` does not run.

    Raises:
        MoeOffloadError: a diffusion model, ``--memory-budget``, ``--max-batch`` above 1, another host store than
            ``pinned``, or ``--host-cache``."""
    if diffusion is not None:
        raise MoeOffloadError("--graph compiles the autoregressive decode step; a diffusion model is served without it")
    if cfg.memory_budget_gb is not None:
        raise MoeOffloadError("--graph sizes its pool from --residency or --slots, not --memory-budget")
    if cfg.max_batch is not None and cfg.max_batch > 1:
        raise MoeOffloadError(f"--graph decodes one request at a time (its compiled step is batch 1): --max-batch "
                              f"{cfg.max_batch} is not served with it")
    if cfg.host_store != "pinned" or cfg.host_cache_gb is not None:
        raise MoeOffloadError("--graph serves the experts from host memory (--host-store pinned, no --host-cache)")


def load_graph_model(cfg, path):
    """The model for ``serve --graph``: ``graph.decode.load_graph`` with the server's policy, pool size, device,
    dtype and predictor (``auto``: lru, as ``generate --graph``).

    Raises:
        MoeOffloadError: as ``load_graph``."""
    from ..core.policy_spec import parse_policy
    from ..graph.decode import load_graph

    policy = parse_policy("lru") if cfg.policy.family == "auto" else cfg.policy
    return load_graph(path, policy=policy, residency=cfg.residency, slots=cfg.slots, device=cfg.device,
                      dtype=cfg.dtype, progress=cfg.progress, predictor=cfg.predictor)


def compile_decoder(lm, cfg, max_context: int, log):
    """Compile the decode step now, over a static cache of ``max_context`` positions (``GraphDecoder.warm_up``);
    logs how long it took. Returns the ``GraphDecoder``.

    Raises:
        MoeOffloadError: the compiler backend failed (one line, as ``generate --graph``)."""
    from ..graph.decode import GraphDecoder, inductor_cache_dir

    decoder = GraphDecoder(lm, backend=cfg.graph_backend, progress=cfg.progress, cache_len=max_context)
    log(f"compiling the decode step ({cfg.graph_backend}; torch's compile cache: {inductor_cache_dir()})")
    took = decoder.warm_up()
    log(f"decode step compiled in {took:.1f} s: requests decode with it, one at a time")
    return decoder
