"""Graph mode's decode: the whole decode forward compiled once with ``torch.compile(fullgraph=True)`` over a static
KV cache, the experts' cache decisions and copies included (SeqMoE §8.2; DESIGN.md §11 "Graph mode"); prefill
stays eager, as in the paper. On a GPU the same step can be compiled with CUDA graphs (``cuda_graphs=True``,
``mode="reduce-overhead"``); the experts' custom ops do not capture yet (``bench.gpu_check_graph`` says why), so the
default compiles without them.

``load_graph`` builds an offloaded model whose engine is a ``runtime.graph.engine.GraphEngine``;
``GraphDecoder.generate_ids`` is ``generation.generate.generate_ids`` for graph mode (FullLoad models too, for the
reference). The static cache's length is rounded up to ``CACHE_BUCKET`` positions and kept across requests, so
requests of similar length reuse one compiled step (a longer one compiles a new one once). The decode step that
compiles is shown as a progress phase (its expected time: the last compile of the same step, ``compile_times.json``
in the user cache) and kept out of the decode rate (``GraphDecoder.compile_s``); torch's own compile cache keeps the
generated code across runs (``inductor_cache_dir``).
"""

from __future__ import annotations

import inspect
import json
import time

import torch

from ..errors import MoeOffloadError
from ..core.policy_spec import PolicySpec, parse_policy
from ..runtime.graph.cache import GraphCache, check_graph_policy
from ..runtime.graph.engine import GraphEngine

#: static KV cache lengths are multiples of this many positions
CACHE_BUCKET = 256
#: compiled graphs of the decode step one process may hold (``torch._dynamo.config.recompile_limit`` is at least
#: this while a decoder exists): every ``GraphDecoder`` compiles its own graph of the one ``_step`` code object, which
#: dynamo counts as recompiles of it (default limit 8), e.g. ``bench graph`` with several policies and residencies
DECODER_GRAPHS = 64
#: compiler backends ``--graph-backend`` accepts: inductor (generated kernels, the speed), aot_eager (the traced
#: graph run op by op: the eager kernels, hence FullLoad eager's tokens bit for bit)
BACKENDS = ("inductor", "aot_eager")
#: seconds a decode step is expected to compile when no earlier compile of it was timed (a cold cache, 2 cores)
COLD_COMPILE_S = 60.0


def load_graph(model_dir, *, policy: PolicySpec | str = "lru", residency: float | None = None,
               slots: int | None = None, device: str | None = None, dtype: str | None = None, progress: bool = False,
               predictor: str | None = None, link_epl: float = 1.39):
    """``models.loader.load_offloaded`` with a ``GraphEngine`` (graph mode) instead of the Python slot table.

    Args:
        policy: a ``core.policy_spec.PolicySpec`` (a name is parsed) that graph mode runs: ``lru``, ``lfu``,
            ``seqmoe-cacheonly`` (probabilistic Belady; ``runtime.graph.cache``) or
            ``seqmoe`` (probabilistic Belady plus JSD prefetching by a CPU worker through the control region:
            ``runtime.graph.fetch_cache``, ``runtime.graph.prefetch``).
        residency, slots, device, dtype, progress: as ``load_offloaded``.
        predictor: a trained predictor directory (``seqmoe-cacheonly``, ``seqmoe``: required): run inside the
            step (``graph.predictor``, rollout every step).
        link_epl: with ``seqmoe``: the JSD scheduler's transfer budget B_avg, experts per layer time (as
            ``load_offloaded``).
    Returns:
        A ``LoadedModel`` whose ``engine`` is a ``GraphEngine``. With a slot for every expert (residency 1.0) and
        no prefetcher, every expert is copied into its slot here (``GraphEngine.preload_all``) and the step only
        looks slots up (``GraphEngine.set_lookup_only``): no expert is ever evicted or fetched, so the decisions
        would change nothing but cost a plan per layer.
    Raises:
        MoeOffloadError: as ``load_offloaded``; a policy graph mode does not support, or fewer slots than one
        layer's experts (``runtime.graph.cache.check_graph_policy``); a predictor with another policy than
        ``seqmoe-cacheonly``/``seqmoe`` or one that does not fit the model; ``seqmoe`` without a predictor, with
        fewer slots than one layer's experts plus one, or on CUDA (``runtime.graph.prefetch.GraphPrefetcher``).
    """
    from ..models.capability import experts_modules
    from ..models.loader import load_offloaded

    spec = parse_policy(policy)
    kind = check_graph_policy(spec, 1 << 30, 1)  # the policy first, before loading anything
    scheduler = spec.prefetch
    if scheduler and not predictor:
        raise MoeOffloadError(f"--graph --policy {spec.name} needs --predictor DIR (its forecasts drive prefetching)")
    lm = load_offloaded(model_dir, device=device, dtype=dtype, residency=residency, slots=slots,
                        policy="lru", progress=progress)
    old = lm.engine
    try:
        check_graph_policy(spec, old.pool.num_slots, lm.num_experts)
    except MoeOffloadError:
        lm.close()
        raise
    if scheduler and old.pool.num_slots <= lm.num_experts:
        lm.close()
        raise MoeOffloadError(f"--graph --policy {spec.name} needs at least {lm.num_experts + 1} slots (one MoE layer's "
                              f"{lm.num_experts} experts + 1 to prefetch into), got {old.pool.num_slots}")
    if scheduler:
        from ..runtime.graph.fetch_cache import FetchingGraphCache

        cache = FetchingGraphCache(old.pool.num_slots, lm.num_experts, lm.num_moe_layers, kind, device=old.pool.device)
    else:
        cache = GraphCache(old.pool.num_slots, lm.num_experts, lm.num_moe_layers, kind, device=old.pool.device)
    engine = GraphEngine(old.store, old.pool, cache, lm.num_experts, spec.name)
    engine.attach([m for _, m in experts_modules(lm.model)])
    lm.engine = engine
    _attach_forecasts(lm, engine, cache, predictor, scheduler, link_epl)
    _all_resident(engine)
    return lm


def _all_resident(engine: GraphEngine) -> None:
    """With a slot for every expert and no prefetcher, every expert into its slot and the step lookup-only (nothing
    is ever evicted or fetched, so the decisions would change nothing but cost a plan per layer)."""
    if engine.cache.S >= engine.cache.N and engine.prefetcher is None:
        engine.preload_all()
        engine.set_lookup_only(True)


def _attach_forecasts(lm, engine: GraphEngine, cache, predictor: str | None, scheduler: str | None,
                      link_epl: float) -> None:
    """``load_graph``'s predictor (run inside the step) and prefetcher (a CPU worker with ``scheduler``) for
    ``engine``; closes ``lm`` before re-raising when either cannot be built."""
    if predictor:
        from ..predictor.model import load_predictor
        from .predictor import GraphPredictor

        try:
            engine.predictor = GraphPredictor(load_predictor(predictor, model_id=lm.model_id, device=lm.device), cache)
        except MoeOffloadError:
            lm.close()
            raise
    if scheduler:
        from ..core.prefetch import make_scheduler
        from ..runtime.graph.prefetch import GraphPrefetcher

        try:
            engine.prefetcher = GraphPrefetcher(engine, make_scheduler(scheduler, num_moe_layers=lm.num_moe_layers,
                                                                       b_avg=link_epl, auto_ema=False),
                                                engine.predictor, lm.num_moe_layers, lm.num_experts, lm.top_k)
        except MoeOffloadError:  # e.g. on CUDA: the control region is not built there
            lm.close()
            raise


class GraphDecoder:
    """Greedy/sampled generation with the decode step compiled whole (one per model, reused across requests).

    Args:
        lm: a ``LoadedModel`` (FullLoad, or from ``load_graph``).
        backend: ``inductor`` (default) or ``aot_eager`` (``BACKENDS``).
        cuda_graphs: on CUDA, capture the step with CUDA graphs (``mode="reduce-overhead"``); default off (FullLoad
            captures; the offloaded step's custom ops read slot ids on the host, which capture refuses).
        progress: show the compiling step as a progress phase (``common.progress.Phases``).
        cache_len: every request's static KV cache holds this many positions (rounded up to ``CACHE_BUCKET``), so
            one compiled step serves them all (``serve --graph``: the server's ``--max-context``); None (default):
            the request's own length, rounded up, and a longer request compiles a new step once.

    Raises:
        MoeOffloadError: an unknown backend; an engine that is neither None (FullLoad) nor a ``GraphEngine``.
    """

    def __init__(self, lm, backend: str = "inductor", cuda_graphs: bool = False, progress: bool = False,
                 cache_len: int | None = None):
        if backend not in BACKENDS:
            raise MoeOffloadError(f"unknown graph backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
        if lm.engine is not None and not isinstance(lm.engine, GraphEngine):
            raise MoeOffloadError("graph mode needs a model loaded with graph.decode.load_graph")
        self.lm, self.backend, self.progress, self.cache_len = lm, backend, progress, cache_len
        self.cache = None
        #: seconds spent in the decode steps that compiled (not in ``generate_ids``' decode time)
        self.compile_s = 0.0
        #: decode steps of the last ``generate_ids`` call left out of its decode time (1 if it compiled, else 0)
        self.last_compile_steps = 0
        self._compiled_lengths: set[int] = set()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DECODER_GRAPHS)
        opts = dict(fullgraph=True, backend=backend)
        if cuda_graphs and backend == "inductor" and lm.device.type == "cuda":
            opts["mode"] = "reduce-overhead"  # (torch.compile takes a mode or options, not both)
        elif "isolate_recompiles" in inspect.signature(torch.compile).parameters:
            # no guards on the model's modules: checking them costs ~1.5 ms per step here, and a decoder's model
            # never changes after loading (its tensors are the graph's inputs, read at every call). Safe only with
            # this decoder's graphs kept apart from every other decoder's (which the module guards told apart)
            opts.update(isolate_recompiles=True,
                        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.step = torch.compile(self._step, **opts)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """One decode forward: ``input_ids [1, 1]``, ``position_ids [1, 1]`` int64 -> logits ``[1, V]``."""
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
        return out.logits[:, -1]

    def _compiled_step(self, input_ids, position_ids, cache) -> torch.Tensor:
        """``self.step``, with a compiler backend's failure reported in one line (it happens inside the compiler's
        own code generation: e.g. inductor's C++ backend on seqmoe-cacheonly's step for testbed-sparse).

        Raises:
            MoeOffloadError: the backend failed to compile the step.
        """
        try:
            return self.step(input_ids, position_ids, cache)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None) or exc
            why = " ".join(f"{type(inner).__name__}: {inner}".split())[:200]
            hint = ("--graph-backend aot_eager compiles it without generated kernels" if self.backend == "inductor"
                    else "run without --graph")
            raise MoeOffloadError(f"the {self.backend} backend failed to compile the decode step ({why}); "
                                  f"{hint}") from None

    def _compile_key(self) -> str:
        """What one compiled step is for: the model, the engine (policy, slots), the cache length, backend, torch."""
        eng = self.lm.engine
        what = "full-load" if eng is None else f"{type(eng.cache).__name__}-{eng.cache.S}-{eng.cache.kind}"
        return f"{self.lm.model_id}|{self.lm.dtype}|{what}|{self._cache_len}|{self.backend}|torch {torch.__version__}"

    def _compiling_step(self, input_ids, position_ids, cache) -> torch.Tensor:
        """The first decode step at a new static cache length: it compiles. Shown as a progress phase whose bar
        runs to the slowest compile of this step seen so far (else ``COLD_COMPILE_S``) and whose label gives the
        range seen: the fast end is a warm compile cache, the slow end a cold one (torch's cache keys hold the
        source files' paths, so another checkout compiles cold once). Its time is added to ``compile_s`` and
        remembered."""
        from ..common.progress import Phases

        key, where = self._compile_key(), inductor_cache_dir()
        seen = _read_compile_times().get(key)
        what = (f"compiling the decode step (earlier {seen[0]:.0f}-{seen[1]:.0f} s: the fast end when torch's compile "
                f"cache in {where} holds it)" if seen else
                f"compiling the decode step (about a minute the first time; torch's compile cache in {where} "
                "shortens the next ones)")
        t0 = time.perf_counter()
        with Phases(1, enabled=self.progress).phase(what, seen[1] if seen else COLD_COMPILE_S):
            logits = self._compiled_step(input_ids, position_ids, cache)
        took = time.perf_counter() - t0
        self.compile_s += took
        self._compiled_lengths.add(self._cache_len)
        _write_compile_time(key, took)
        return logits

    def _static_cache(self, length: int):
        from transformers import StaticCache

        need = -(-max(length, self.cache_len or 0) // CACHE_BUCKET) * CACHE_BUCKET
        if self.cache is None or self._cache_len < need:
            self.cache = StaticCache(config=self.lm.model.config, max_cache_len=need)
            self._cache_len = need
        else:
            self.cache.reset()
        return self.cache

    @torch.no_grad()
    def warm_up(self) -> float:
        """Compile the decode step now, so that the first real request does not wait for the compiler: a prefill of
        two tokens of id 0 and one decode step after it, whatever they produce (an EOS included); the engine's
        counters are zeroed after them. Returns the seconds it took (0 when the step was compiled already)."""
        t0, engine, dev = time.perf_counter(), self.lm.engine, self.lm.device
        cache = self._static_cache(3)
        if self._cache_len in self._compiled_lengths:
            return 0.0
        ids = torch.zeros((1, 2), dtype=torch.long, device=dev)
        if engine is not None:
            engine.begin_step(0, 0)
        self.lm.model(input_ids=ids, cache=cache, use_cache=True)  # the prefill, eager
        if engine is not None:
            engine.begin_step(0, 1)
        # a fresh [1, 1] token, as the requests' steps pass (a view of ``ids`` has other strides: dynamo would
        # compile the step again at the first request)
        self._compiling_step(torch.zeros((1, 1), dtype=torch.long, device=dev),
                             torch.full((1, 1), 2, dtype=torch.long, device=dev), cache)
        if engine is not None:
            engine.reset_stats()
        return time.perf_counter() - t0

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int | None = None, request: int = 0,
                     on_token=None):
        """``generation.generate.generate_ids`` in graph mode: eager prefill into a static KV cache, then compiled decode
        steps; stops at an EOS id or the model's position limit (``generation.generate.token_budget``); the same sampler
        (``moe_offload.generation.sampling``, outside the compiled step). Returns ``(new_ids, ttft_s, decode_s)``.

        The decode step that compiles (the first at a new cache length) is not in ``decode_s``: its seconds go to
        ``compile_s``, and ``last_compile_steps`` says whether it happened. ``on_token(token_id)``: as
        ``generation.generate.generate_ids``' (every new token as it is chosen; True stops after it).

        Raises:
            MoeOffloadError: the prompt leaves no room for a new token within the model's position limit."""
        from ..generation.generate import eos_ids, last_position_only, sync_device, token_budget
        from ..generation.sampling import pick
        from ..common.seeds import make_generator

        lm, engine = self.lm, self.lm.engine
        max_new_tokens = token_budget(lm, len(prompt_ids), max_new_tokens)
        dev, gen, eos = lm.device, make_generator(seed), eos_ids(lm)
        cache = self._static_cache(len(prompt_ids) + max_new_tokens)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        if engine is not None:
            engine.begin_step(request, 0)
        out = lm.model(input_ids=ids, cache=cache, use_cache=True, **last_position_only(lm.model))
        tok = pick(out.logits[:, -1], temperature, top_p, gen, top_k)
        new = [int(tok)]
        sync_device(dev)
        t1 = time.perf_counter()
        compiled_before, self.last_compile_steps = self.compile_s, 0
        stop = on_token is not None and bool(on_token(new[-1]))
        while not stop and len(new) < max_new_tokens and new[-1] not in eos:
            if engine is not None:
                engine.begin_step(request, len(new))
            pos = torch.tensor([[len(prompt_ids) + len(new) - 1]], dtype=torch.long, device=dev)
            if self._cache_len in self._compiled_lengths:
                logits = self._compiled_step(tok.view(1, 1), pos, cache)
            else:
                logits = self._compiling_step(tok.view(1, 1), pos, cache)
                self.last_compile_steps = 1
            tok = pick(logits, temperature, top_p, gen, top_k)
            new.append(int(tok))
            stop = on_token is not None and bool(on_token(new[-1]))
        sync_device(dev)
        return new, t1 - t0, time.perf_counter() - t1 - (self.compile_s - compiled_before)


def run_graph(lm, prompts: list[str], max_new_tokens: int, *, decoder: GraphDecoder | None = None,
              temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
              progress: bool = False):
    """``generation.generate.run`` in graph mode: ``(outputs, RunStats)``; ``decoder`` reuses a compiled step."""
    from ..generation.generate import run_requests

    dec = decoder or GraphDecoder(lm, progress=progress)

    def one(i, pids):
        new, ttft, d = dec.generate_ids(pids, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                        seed=seed, request=i)
        return new, ttft, d, len(new) - 1 - dec.last_compile_steps

    return run_requests(lm, prompts, one, max_new_tokens=max_new_tokens, progress=progress)


def inductor_cache_dir() -> str:
    """The folder where torch's inductor keeps compiled code across runs (``TORCHINDUCTOR_CACHE_DIR``, else
    torch's default under the temporary folder); read without creating it."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()


def _compile_times_path():
    from ..common.cache import default_cache_dir

    return default_cache_dir() / "compile_times.json"


def _read_compile_times() -> dict[str, list[float]]:
    """The fastest and slowest compile seen of each decode step (``GraphDecoder._compile_key`` -> ``[s, s]``); {} if
    none (an unreadable or malformed file counts as none)."""
    try:
        data = json.loads(_compile_times_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: [float(v[0]), float(v[1])] for k, v in data.items()
            if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)}


def _write_compile_time(key: str, seconds: float) -> None:
    """Widen ``key``'s range of compile times by ``seconds`` (best effort: an unwritable cache only loses the
    estimate; written to a temporary file and renamed, so a concurrent reader never sees half a file)."""
    import os
    import tempfile

    path = _compile_times_path()
    times = _read_compile_times()
    lo, hi = times.get(key, [seconds, seconds])
    times[key] = [round(min(lo, seconds), 1), round(max(hi, seconds), 1)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".compile_times.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(times, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
