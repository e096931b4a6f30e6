"""``moe-offload bench graph``: graph mode's compiled decode step (issue 20) against compiled FullLoad, measured in
one run, with the management share of the step.

Every configuration is loaded and compiled first; then the timed requests run in rounds, one configuration after
the other within a round, so a change of machine load affects all of them alike. The breakdown of a graph-mode
decode step (SeqMoE fig. 9 phases, ``runtime.breakdown``):

* ``expert_compute`` and ``stall`` (on-demand copies): timed inside the two custom ops;
* ``management``: the cache decisions — ``GraphCache.plan`` of every MoE layer, compiled alone with the same
  backend and timed over ``MGMT_STEPS`` steps in every round right after the row's requests (its shapes are
  fixed, so its cost does not depend on the routing), plus the copy op's own bookkeeping;
* ``other_compute``: the rest of the step.

A/B measurement of the management: at residency 1.0 a policy's model has every expert preloaded
(``GraphEngine.preload_all``), and a row ``<policy> lookup-only`` runs the same model — weights, slot pool, KV
cache and decoder shared — with the cache decisions turned off (``GraphEngine.set_lookup_only``: a layer only
gathers its slots). Per round the two run back to back; the median difference of their steps is what the decisions
cost *inside* the compiled step, where inductor fuses them with their neighbours. It is printed below the breakdown
next to the replayed figure. The plan's shapes grow with the slots (``topk`` over them), so at residency 1.0 (every
expert a slot) it bounds a lower residency's from above. Two separately loaded copies of a model differed by 1-2 ms
per step with nothing else changed (measured with a second model as the baseline; memory placement is the likely
cause), which is why the pair shares one model.
"""

from __future__ import annotations

import copy
import gc
import time
import statistics
from dataclasses import dataclass, field

import torch

from ..generation.generate import run
from ..models.loader import load_full
from ..core.policy_spec import parse_policies, parse_policy
from ..graph.decode import GraphDecoder, load_graph, run_graph

#: steps over which the management (the plan of every layer) is timed
MGMT_STEPS = 50
#: the A/B baseline rows' suffix: every expert preloaded, no cache decisions in the step
LOOKUP_ONLY = "lookup-only"


@dataclass
class GraphRow:
    """One configuration: ``name``, residency (None: FullLoad), decode seconds and tokens summed over the rounds,
    hit rate, tokens equal to FullLoad eager's, and the engine (None for FullLoad)."""

    name: str
    residency: float | None
    decoder: GraphDecoder
    lm: object
    decode_s: float = 0.0
    tokens: int = 0
    same: bool = True
    hits: int = 0
    misses: int = 0
    ops: dict | None = None
    mgmt: object = None
    mgmt_s: float = 0.0
    round_step_s: list = field(default_factory=list)
    lookup_only: bool = False

    @property
    def tok_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def management_step(engine, top_k: int, backend: str):
    """A function running ``GraphCache.plan`` of every MoE layer once (one decode step, batch 1), compiled with
    ``backend`` on a copy of the engine's cache state, with random routing (distinct experts per layer); its
    shapes are fixed, so its cost does not depend on the routing. With prefetching (a ``FetchingGraphCache``)
    each layer also lands (no copy finished), reserves (no request) and releases, as in the step. Call it to time
    the management."""
    from ..runtime.graph.fetch_cache import FetchingGraphCache

    cache = copy.deepcopy(engine.cache)
    g = torch.Generator().manual_seed(0)
    idx = [torch.randperm(cache.E, generator=g)[:top_k].view(1, top_k).to(cache.lookup.device)
           for _ in range(cache.L)]
    fetching = isinstance(cache, FetchingGraphCache)
    if fetching:
        done = torch.zeros(cache.S, dtype=torch.long, device=cache.lookup.device)
        none = torch.full((cache.R,), cache.N, dtype=torch.long, device=cache.lookup.device)

    def all_layers(idx):
        out = []
        for layer, i in enumerate(idx):
            if fetching:
                cache.land(done)
            out.append(cache.plan(layer, i)[0])
            if fetching:
                cache.reserve_slots(none)
                cache.release(layer)
        return out

    fn = torch.compile(all_layers, fullgraph=True, backend=backend)
    fn(idx)
    return lambda: fn(idx)


def _time(fn, steps: int = MGMT_STEPS) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls."""
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def bench_graph(path, prompts: list[str], residencies: list[float], *, policy: list | str = "lru",
                max_new_tokens: int = 32, rounds: int = 3, backend: str = "inductor", device: str | None = None,
                dtype: str | None = None, predictor: str | None = None) -> str:
    """Compiled FullLoad vs graph mode at each residency and policy (greedy), in ``rounds`` interleaved rounds.

    ``policy``: graph-mode policies (``core.policy_spec.PolicySpec``s; a string is parsed: one name or several,
    comma-separated; those a predictor drives, ``seqmoe-cacheonly`` and ``seqmoe``, run ``predictor`` inside the step;
    ``seqmoe`` also prefetches through the CPU worker, ``runtime.graph.prefetch``).

    Returns a markdown table: configuration, residency, decode tok/s, ratio to compiled FullLoad, hit rate, whether
    the tokens equal FullLoad eager's; then the graph-mode step breakdown (ms per step and share).

    Raises:
        MoeOffloadError: as ``load_graph`` / ``GraphDecoder``.
    """
    full = load_full(path, device=device, dtype=dtype)
    ref = [o.token_ids for o in run(full, prompts, max_new_tokens)[0]]
    rows = [GraphRow("FullLoad compiled", None, GraphDecoder(full, backend=backend), full)]
    rows += _graph_rows(path, policy, residencies, backend, device, dtype, predictor)
    t_compile = {}
    for row in rows:  # compile (and warm up) every step first
        _set_mode(row)
        t0 = time.perf_counter()
        run_graph(row.lm, prompts[:1], min(4, max_new_tokens), decoder=row.decoder)
        t_compile[row.name, row.residency] = time.perf_counter() - t0
    for row in rows:
        if row.lm.engine is not None and not row.lookup_only:
            row.mgmt = management_step(row.lm.engine, full.top_k, backend)
    for _ in range(rounds):
        for row in rows:
            _measure_round(row, prompts, max_new_tokens, ref, rounds)
    base = rows[0].tok_s
    out = ["| configuration | residency | decode tok/s | vs FullLoad compiled | hit rate | same tokens as FullLoad "
           "eager | compile s |", "|---|---|---|---|---|---|---|"]
    lines = ["| configuration | residency | ms per decode step | expert compute | other compute | management | "
             "stall |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        eng = row.lm.engine
        hit = "-" if eng is None or row.lookup_only else f"{row.hits / max(1, row.hits + row.misses):.4f}"
        res = "-" if row.residency is None else f"{row.residency:.2f}"
        out.append(f"| {row.name} | {res} | {row.tok_s:.2f} | {row.tok_s / base:.3f} | {hit} | "
                   f"{'yes' if row.same else 'NO'} | {t_compile[row.name, row.residency]:.0f} |")
        if eng is not None and not row.lookup_only:
            lines.append(_breakdown_line(row, res))
    lines += _ab_lines(rows) + _prefetch_lines(rows)
    for lm in {id(r.lm): r.lm for r in rows[1:]}.values():
        lm.close()
    gc.collect()
    return "\n".join(out + [f"\n{len(prompts)} prompts x {max_new_tokens} new tokens x {rounds} rounds, model {path}, "
                            f"backend {backend}, torch threads {torch.get_num_threads()}"
                            + (f", predictor {predictor} (inside the step, rollout every step)"
                               if any(r.lm.engine is not None and r.lm.engine.predictor is not None for r in rows)
                               else ""),
                            ""] + lines)


def _graph_rows(path, policy: list | str, residencies: list[float], backend: str, device, dtype, predictor) -> list[GraphRow]:
    """``bench_graph``'s graph-mode rows, loaded: each policy at each residency, and at residency 1.0 without a
    predictor also its lookup-only twin (the A/B pair, module docstring)."""
    rows = []
    for pol in parse_policies(policy) if isinstance(policy, str) else [parse_policy(p) for p in policy]:
        for r in residencies:
            lm = load_graph(path, policy=pol, residency=r, device=device, dtype=dtype,
                            predictor=predictor if pol.needs_predictor else None)
            row = GraphRow(f"graph {pol}", r, GraphDecoder(lm, backend=backend), lm)
            rows.append(row)
            if r == 1.0 and lm.engine.predictor is None:
                lm.engine.preload_all()
                rows.append(GraphRow(f"graph {pol} {LOOKUP_ONLY}", r, row.decoder, lm, lookup_only=True))
    return rows


def _measure_round(row: GraphRow, prompts, max_new_tokens: int, ref, rounds: int) -> None:
    """One timed run of ``row``'s requests, added to its totals; then its management timed under the same load."""
    _set_mode(row)
    outs, st = run_graph(row.lm, prompts, max_new_tokens, decoder=row.decoder)
    row.decode_s += st.decode_s
    row.tokens += st.decode_tokens
    row.same = row.same and [o.token_ids for o in outs] == ref
    row.round_step_s.append(st.decode_s / max(1, st.decode_tokens))
    if row.mgmt is not None:  # each run starts from zeroed counters
        row.hits += st.offload.hits
        row.misses += st.offload.misses
        row.ops = {k: v + (row.ops or {}).get(k, 0.0) for k, v in row.lm.engine.op_seconds.items()}
        row.mgmt_s += _time(row.mgmt) / rounds


def _breakdown_line(row: GraphRow, res: str) -> str:
    steps = max(1, row.tokens)
    step = row.decode_s / steps
    mgmt = row.mgmt_s + row.ops["copy_overhead"] / steps
    expert = row.ops["expert_compute"] / steps
    stall = row.ops["stall"] / steps
    other = step - mgmt - expert - stall

    def cell(s):
        return f"{1e3 * s:.2f} ({s / step:.1%})"

    return (f"| {row.name} | {res} | {1e3 * step:.2f} | {cell(expert)} | {cell(other)} | {cell(mgmt)} | "
            f"{cell(stall)} |")


def _prefetch_lines(rows: list[GraphRow]) -> list[str]:
    """Per row with a prefetch worker: its requests, copies, landings and waits since the model was loaded
    (compile run and every round)."""
    out = []
    for row in rows:
        pf = row.lm.engine.prefetcher if row.lm.engine is not None else None
        if pf is not None:
            c = pf.counts()
            out.append(f"\n{row.name} {row.residency:.2f}: the prefetch worker requested {c['requested']} experts and "
                       f"copied {c['copied']} ({pf.copy_s:.2f} s); {c['landed']} landed before their layer, "
                       f"{c['waited']} were waited for (compile run and all rounds)")
    return out


def _set_mode(row: GraphRow) -> None:
    """Decisions on or off (``lookup_only``) for the row's engine, which an A/B pair shares."""
    if row.lm.engine is not None and row.lm.engine.preloaded:
        row.lm.engine.set_lookup_only(row.lookup_only)


def _ab_lines(rows: list[GraphRow]) -> list[str]:
    """The A/B management (module docstring): per lookup-only row, the median over rounds of (its partner's ms per
    decode step - its own in the same round), and that as a share of each of the partner policy's rows' step."""
    out = []
    for base in (r for r in rows if r.lookup_only):
        full = next(r for r in rows if r.lm is base.lm and not r.lookup_only)
        d = statistics.median(a - b for a, b in zip(full.round_step_s, base.round_step_s))
        shares = ", ".join(f"{r.residency:.2f}: {d / (r.decode_s / max(1, r.tokens)):.1%}"
                           for r in rows if r.name == full.name)
        out.append(f"- {full.name}: {1e3 * d:.2f} ms per step ({shares}); median over {len(base.round_step_s)} "
                   f"rounds, {base.name}'s step {1e3 * statistics.median(base.round_step_s):.2f} ms")
    if out:
        out = ["", "Management inside the compiled step (A/B against the same model with the decisions off, module "
               "docstring), as a share of each row's step:", ""] + out
    return out
