"""Prediction quality and cost (SeqMoE §9.1 metric, §9.4 fig. 8, §9.5 overhead).

Recall: for each (position, MoE layer), the share of the true top-k experts found among the forecast's
top-(k+3) (and, as a stricter figure, its top-k), averaged over all (position, layer) pairs.

Rows of the table:
- ``Seq-1``: one-step prediction of each decode step, in the runtime's execution modes (prefill over the prompt,
  then one step per decode position);
- ``Seq-h``: the forecast made h steps ahead by recursive prediction (one-step, then h-1 recursive steps; h = 8
  by default), for decode steps;
- ``Seq-L1``: Seq-1 restricted to requests of at least ``long_threshold`` positions;
- ``Markov``: the first-order cross-step baseline, for the same decode steps;
- ``Last``: the previous step's experts, topped up by the most popular ones (a persistence baseline); ``Last-h``:
  the experts of the step h before (what Seq-h competes with);
- ``Seq-1 (all positions)`` vs ``Shuffled control``: the ordered model and the model trained on step-shuffled
  sequences, each over every position of (ordered resp. shuffled) test requests (SeqMoE §3.1 fig. 2);
- ``XL-j`` (traces collected with ``--xl-forecasts``): the cross-layer forecast of layer ``l + j`` made at layer ``l``
  of the same decode step (``predictor.cross_layer``: layer ``l + j``'s router on layer ``l``'s router input), for
  the same decode steps; ``Seq-1+XL-j``: Seq-1 blended with it as the policy ``seqmoe-xl`` blends them
  (``predictor.blend.mix``, weight ``w_j``);
- ``Chance``: (k+3)/e resp. k/e.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .baselines import MarkovPredictor
from .features import Sequence
from .model import PredictorSet


@dataclass
class Recall:
    """Accumulated recall: ``hits_wide`` / ``hits_k`` are sums of per-(position, layer) recall at top-(k+3) / top-k."""

    hits_wide: float = 0.0
    hits_k: float = 0.0
    pairs: int = 0
    positions: int = 0

    def add(self, scores: torch.Tensor, true_ids: torch.Tensor, k: int, extra: int = 3) -> None:
        """``scores [N, n, e]``, ``true_ids [N, n, k]`` -> accumulate."""
        if scores.shape[0] == 0:
            return
        wide = scores.topk(k + extra, dim=-1).indices
        narrow = wide[..., :k]
        hw = (wide.unsqueeze(-1) == true_ids.unsqueeze(-2)).any(-2).sum(-1).float() / k   # [N, n]
        hk = (narrow.unsqueeze(-1) == true_ids.unsqueeze(-2)).any(-2).sum(-1).float() / k
        self.hits_wide += float(hw.sum())
        self.hits_k += float(hk.sum())
        self.pairs += hw.numel()
        self.positions += scores.shape[0]

    @property
    def wide(self) -> float:
        return self.hits_wide / self.pairs if self.pairs else float("nan")

    @property
    def narrow(self) -> float:
        return self.hits_k / self.pairs if self.pairs else float("nan")


@dataclass
class EvalResult:
    """Recall rows keyed by name (see the module docstring), plus the geometry."""

    rows: dict[str, Recall] = field(default_factory=dict)
    top_k: int = 0
    num_experts: int = 0
    horizon: int = 8
    long_threshold: int = 0
    requests: int = 0
    long_requests: int = 0
    #: ``{(layer distance j, weight w): Recall}`` of Seq-1 blended with XL-j at weight w (``xl_grid``)
    blend_grid: dict = field(default_factory=dict)

    def row(self, name: str) -> Recall:
        return self.rows.setdefault(name, Recall())


@torch.no_grad()
def evaluate_predictor(pset: PredictorSet, seqs: list[Sequence], *, horizon: int = 8, long_threshold: int = 512,
                       markov: MarkovPredictor | None = None, popularity: torch.Tensor | None = None,
                       control: PredictorSet | None = None, shuffle_seed: int = 1234,
                       progress: bool = False, xl_weights=None, xl_grid=None) -> EvalResult:
    """Evaluate on held-out sequences.

    Args:
        pset: the trained predictors.
        seqs: test requests.
        horizon: h of the Seq-h row (>= 1; 1 disables it).
        long_threshold: minimum positions for the Seq-L1 row.
        markov: a fitted Markov baseline (row omitted if None).
        popularity: float ``[L, e]`` activation counts for the ``Last`` baseline's top-up (row omitted if None).
        control: the shuffled-control predictors (row omitted if None).
        shuffle_seed: seed of the test sequences' shuffling for the control.
        xl_weights: the blend weights of the ``Seq-1+XL-j`` rows (default: ``pset.xl_weights``, else
            ``predictor.xl_weights.XL_WEIGHTS``).
        xl_grid: optional weights in ``[0, 1]``: Seq-1 blended with each XL-j at each of them too, in
            ``EvalResult.blend_grid`` (``predictor.xl_calibrate``).

    Returns:
        ``EvalResult``.
    """
    from tqdm.auto import tqdm

    from .xl_weights import XL_WEIGHTS

    if xl_weights is None:
        xl_weights = getattr(pset, "xl_weights", None) or XL_WEIGHTS
    xl_weights = tuple(xl_weights)
    h = pset.header
    k, E = h.top_k, h.num_experts
    res = EvalResult(top_k=k, num_experts=E, horizon=horizon, long_threshold=long_threshold)
    for s_i, seq in enumerate(tqdm(seqs, desc="eval", disable=not progress, leave=False)):
        T, P = len(seq), seq.prompt_len
        if T < 2:
            continue
        res.requests += 1
        is_long = T >= long_threshold
        res.long_requests += int(is_long)
        for p in pset.predictors:
            _predictor_rows(res, p, seq, s_i, control, shuffle_seed, is_long, xl_weights, xl_grid)
        if seq.xl is not None and P >= 1:
            _xl_rows(res, seq)
        _baseline_rows(res, seq, markov, popularity, h.num_moe_layers)
    return res


def _predictor_rows(res: EvalResult, p, seq: Sequence, s_i: int, control: PredictorSet | None, shuffle_seed: int,
                    is_long: bool, xl_weights, xl_grid) -> None:
    """One predictor's rows for request ``seq`` (number ``s_i``): ``Seq-1 (all positions)`` (parallel mode) and its
    shuffled control, then, in the runtime's modes (prefill over the prompt, one step per decode position), ``Seq-1``,
    its blends with the cross-layer forecasts, ``Seq-L1`` (``is_long``) and ``Seq-h``."""
    k, E, horizon = res.top_k, res.num_experts, res.horizon
    T, P = len(seq), seq.prompt_len
    lo, hi = p.spec.layers
    x = seq.features((lo, hi), E)
    ids = seq.ids[:, lo:hi]
    # every position, parallel mode: logits[t] forecasts t + 1
    full, _ = p(x.unsqueeze(0))
    res.row("Seq-1 (all positions)").add(full[0, :-1], ids[1:], k)
    if control is not None:
        cp = control.predictors[[c.spec.layers for c in control.predictors].index((lo, hi))]
        sh = seq.shuffled(shuffle_seed + s_i)
        cl, _ = cp(sh.features((lo, hi), E).unsqueeze(0))
        res.row("Shuffled control (all positions)").add(cl[0, :-1], sh.ids[1:, lo:hi], k)
    if P < 1 or P >= T:
        return
    nxt, state = p.prefill(x[:P])
    for t in range(P, T):
        res.row("Seq-1").add(nxt.unsqueeze(0), ids[t:t + 1], k)
        if seq.xl is not None:
            _blend_rows(res, seq, t, (lo, hi), nxt, xl_weights, xl_grid)
        if is_long:
            res.row("Seq-L1").add(nxt.unsqueeze(0), ids[t:t + 1], k)
        if horizon > 1 and t + horizon - 1 < T:
            roll = p.rollout(nxt, state, horizon - 1)
            res.row(f"Seq-{horizon}").add(roll[-1:], ids[t + horizon - 1:t + horizon], k)
        if t + 1 < T:
            nxt = p.step(x[t], state)


def _baseline_rows(res: EvalResult, seq: Sequence, markov: MarkovPredictor | None, popularity: torch.Tensor | None,
                   num_moe_layers: int) -> None:
    """The baselines' rows for request ``seq`` over its decode positions: ``Markov``, and ``Last`` / ``Last-h`` (the
    previous step's experts topped up by ``popularity``)."""
    k, E, horizon = res.top_k, res.num_experts, res.horizon
    T, P = len(seq), seq.prompt_len
    dec = slice(max(P, 1), T)
    if markov is not None and dec.start < T:
        res.row("Markov").add(markov.predict(seq.ids[dec.start - 1:T - 1], seq.weights[dec.start - 1:T - 1]),
                              seq.ids[dec], k)
    if popularity is not None and dec.start < T:
        pop = 1e-3 * popularity / popularity.sum(-1, keepdim=True).clamp_min(1)
        for lag, name in ((1, "Last"), (horizon, f"Last-{horizon}")):
            first = max(dec.start, lag, P - 1 + lag)   # the same rows as Seq-1 resp. Seq-h
            if lag == 1 or (horizon > 1 and first < T):
                prev = torch.zeros(T - first, num_moe_layers, E).scatter_(-1, seq.ids[first - lag:T - lag], 1.0)
                res.row(name).add(prev + pop, seq.ids[first:T], k)


def _xl_rows(res: EvalResult, seq: Sequence) -> None:
    """Rows ``XL-j``: the cross-layer forecasts of every decode step of ``seq`` against its true experts."""
    P, L, d = seq.prompt_len, seq.ids.shape[1], seq.xl.shape[2]
    for j in range(1, min(d, L - 1) + 1):
        res.row(f"XL-{j}").add(seq.xl[:, :L - j, j - 1], seq.ids[P:, j:], res.top_k)


def _blend_rows(res: EvalResult, seq: Sequence, t: int, layers: tuple[int, int], logits: torch.Tensor,
                weights, grid=None) -> None:
    """Rows ``Seq-1+XL-j`` at position ``t`` for one predictor's ``layers``: its one-step ``logits [n, E]`` (softmax:
    the runtime's forecast) blended with the cross-layer forecast of each layer from ``j`` layers before; with a
    ``grid``, the blends at each of its weights into ``res.blend_grid``."""
    from .blend import mix

    lo, hi = layers
    xl = seq.xl[t - seq.prompt_len]                       # [L, d, E]
    probs = torch.softmax(logits, dim=-1)
    for j in range(1, xl.shape[1] + 1):
        ps = torch.arange(max(lo, j), hi)
        if len(ps):
            x, p, true = xl[ps - j, j - 1], probs[ps - lo], seq.ids[t:t + 1, ps]
            b = mix(x, p, weights, [j] * len(ps))
            res.row(f"Seq-1+XL-{j}").add(b.unsqueeze(0), true, res.top_k)
            for w in grid or ():
                bw = mix(x, p, (w,), [j] * len(ps))
                res.blend_grid.setdefault((j, w), Recall()).add(bw.unsqueeze(0), true, res.top_k)


def popularity_counts(seqs: list[Sequence], num_moe_layers: int, num_experts: int) -> torch.Tensor:
    """float32 ``[L, e]``: how often each expert was selected over all positions of ``seqs``."""
    c = torch.zeros(num_moe_layers, num_experts)
    for s in seqs:
        c += torch.zeros(len(s), num_moe_layers, num_experts).scatter_(-1, s.ids, 1.0).sum(0)
    return c


def recall_table(res: EvalResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows for printing: name, recall@top-(k+3), recall@top-k, positions."""
    k, E = res.top_k, res.num_experts
    head = ["forecast", f"recall@top-{k + 3}", f"recall@top-{k}", "(position, layer) pairs"]
    xl = sorted((n for n in res.rows if n.startswith(("XL-", "Seq-1+XL-"))), key=lambda n: (n[0] == "S", n))
    order = ["Seq-1", f"Seq-{res.horizon}", "Seq-L1", *xl, "Markov", "Last", f"Last-{res.horizon}",
             "Seq-1 (all positions)", "Shuffled control (all positions)"]
    rows = []
    for name in order:
        r = res.rows.get(name)
        if r is None or not r.pairs:
            continue
        rows.append([name, f"{100 * r.wide:.2f}%", f"{100 * r.narrow:.2f}%", str(r.pairs)])
    rows.append(["Chance", f"{100 * min(1.0, (k + 3) / E):.2f}%", f"{100 * k / E:.2f}%", "-"])
    return head, rows


def measure_overhead(model: str, pset: PredictorSet, num_prompts: int = 4, max_new_tokens: int = 32,
                     rollout: int = 8, progress: bool = False) -> dict:
    """Predictor time per decode step as a share of the model's decode step time, measured in one run (§9.5).

    Loads ``model`` (a checkpoint directory or built-in name) offloaded at residency 1.0 (no misses, so the decode
    step is the model's compute), generates greedily for ``num_prompts`` short ShareGPT prompts without a
    predictor, with one-step prediction, and with one-step + ``rollout`` recursive steps (after a warm-up each).

    Returns:
        ``{"model", "prompts", "max_new_tokens", "modes": [{"mode", "predictor_ms_per_step",
        "decode_ms_per_step" (without predictor), "share", "same_tokens"}]}``.

    Raises:
        MoeOffloadError: as ``load_offloaded``, or if the predictor was trained for another model.
    """
    from ..testbed.resolve import resolve_model
    from ..errors import MoeOffloadError
    from ..generation.generate import run
    from ..models.loader import load_offloaded
    from ..testbed.sharegpt import human_turns
    from .runtime import PredictorRunner

    path = resolve_model(model, progress=progress)
    lm = load_offloaded(path, residency=1.0, progress=False)
    if lm.model_id != pset.header.model_id:
        raise MoeOffloadError(f"predictor was trained for model {pset.header.model_id}, not {lm.model_id}")
    pset = pset.to(lm.device)
    prompts = [t for t in human_turns(200) if 20 <= len(t) <= 300][:num_prompts]

    def measure(rollout_steps):
        runner = None
        if rollout_steps is not None:
            runner = PredictorRunner(pset, rollout=rollout_steps, rollout_every=1)
            lm.engine.observers.append(runner)
        try:
            run(lm, prompts[:1], 4)                                             # warm-up
            if runner is not None:
                runner.stats = type(runner.stats)()
            outs, st = run(lm, prompts, max_new_tokens, progress=progress)
        finally:
            if runner is not None:
                lm.engine.observers.remove(runner)
        ms = 1e3 * st.decode_s / max(1, st.decode_tokens)
        pms = 1e3 * runner.stats.decode_s / max(1, runner.stats.decode_steps) if runner else 0.0
        return [o.token_ids for o in outs], ms, pms

    base_tokens, base_ms, _ = measure(None)
    modes = []
    for name, r in (("one-step", 0), (f"one-step + {rollout} recursive", rollout)):
        toks, _, pms = measure(r)
        modes.append({"mode": name, "predictor_ms_per_step": pms, "decode_ms_per_step": base_ms,
                      "share": pms / base_ms if base_ms else float("nan"), "same_tokens": toks == base_tokens})
    return {"model": str(path), "prompts": len(prompts), "max_new_tokens": max_new_tokens, "modes": modes}


def eval_report(pset: PredictorSet, traces: list, *, control: PredictorSet | None = None, horizon: int = 8,
                long_threshold: int = 256, xl_weights: tuple[float, ...] | None = None, model: str | None = None,
                overhead_prompts: int = 4, max_new_tokens: int = 32, rollout: int = 8, progress: bool = False
                ) -> tuple[dict, EvalResult, list[str], list[list[str]]]:
    """``predictor eval``: the recall of ``pset``'s forecasts on ``traces`` (their held-out requests when they are
    its training traces, ``features.eval_split``) against the Markov, Last, popularity and (with ``control``, a
    step-shuffled predictor) control baselines; with ``model``, its time per decode step on that model
    (``measure_overhead``).

    Returns:
        ``(report, result, table head, table rows)``: ``report`` is the JSON report (``requests`` says which,
        ``recall`` per row, the predictor's memory, ``xl_blend_weights`` and ``synthetic`` where they apply,
        ``overhead``), ``result`` the raw ``EvalResult``.

    Raises:
        MoeOffloadError: ``control`` with other layer ranges than ``pset``.
    """
    from ..errors import MoeOffloadError
    from .features import eval_split

    if control is not None and [s.layers for s in control.header.specs] != [s.layers for s in pset.header.specs]:
        raise MoeOffloadError("--control must have the same layer ranges as --predictor")
    seqs, train_idx, test_idx, note = eval_split(pset.header.training, traces)
    test = [seqs[i] for i in test_idx]
    h = pset.header
    fit_on = [seqs[i] for i in train_idx] if train_idx else test
    markov = MarkovPredictor(h.num_moe_layers, h.num_experts).fit(fit_on)
    pop = popularity_counts(fit_on, h.num_moe_layers, h.num_experts)
    res = evaluate_predictor(pset, test, horizon=horizon, long_threshold=long_threshold, markov=markov,
                             popularity=pop, control=control, progress=progress, xl_weights=xl_weights)
    head, rows = recall_table(res)
    out = {"requests": note, "top_k": h.top_k, "num_experts": h.num_experts, "long_requests": res.long_requests,
           "recall": {r[0]: {"top_k_plus_3": r[1], "top_k": r[2], "pairs": r[3]} for r in rows},
           "markov_fitted_on": "training split" if train_idx else "the evaluated requests themselves (in-sample)",
           "parameters": pset.num_parameters(), "parameter_bytes": pset.parameter_bytes(),
           "state_bytes": pset.state_bytes()}
    if any(t.xl_probs is not None for t in traces):
        from .xl_weights import describe_xl_weights

        out["xl_blend_weights"] = (", ".join(f"{w:g}" for w in xl_weights) + " (--xl-weights)" if xl_weights
                                   else describe_xl_weights(pset))
    synthetic = sorted({t.header.get("xl_forecasts") or "generated" for t in traces if t.header.get("synthetic")})
    if synthetic:
        out["synthetic"] = synthetic
    if model:
        out["overhead"] = measure_overhead(model, pset, overhead_prompts, max_new_tokens, rollout, progress=progress)
    return out, res, head, rows
