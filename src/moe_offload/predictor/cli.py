"""``moe-offload predictor train|eval|calibrate-xl`` (SeqMoE §5.4, §9.4; the ``seqmoe-xl`` blend weights)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..common.cliargs import seed
from ..errors import MoeOffloadError
from .xl_calibrate import XL_GRID


def add_parser(sub, positive_int, nonneg_int, fl) -> None:
    """Add the ``predictor`` command group to the top-level subparsers ``sub``."""
    pr = sub.add_parser("predictor", help="SeqMoE's seq2seq expert-activation predictor: train, eval, calibrate-xl")
    psub = pr.add_subparsers(dest="predictor_cmd", required=True)
    t = psub.add_parser("train", help="train predictors on traces (90/10 split by request)")
    t.add_argument("--traces", nargs="+", required=True, metavar="FILE", help="trace files of one model")
    t.add_argument("--out", required=True, help="new directory for predictor.safetensors + predictor.json")
    t.add_argument("--predictors", type=positive_int, default=2, help="number of layer ranges (default 2)")
    t.add_argument("--hidden-size", type=positive_int, default=128, help="Mamba2 hidden size m (default 128)")
    t.add_argument("--mamba-layers", type=positive_int, default=1, help="stacked Mamba2 blocks (default 1)")
    t.add_argument("--no-input-skip", action="store_true",
                   help="the paper's exact Linear -> Mamba2 -> Linear, without our input skip (docs/predictor.md)")
    t.add_argument("--epochs", type=positive_int, default=6, help="teacher-forcing epochs (default 6)")
    t.add_argument("--ss-epochs", type=nonneg_int, default=3, help="scheduled-sampling epochs after them (default 3)")
    t.add_argument("--ss-max-prob", type=fl, default=0.5,
                   help="final scheduled-sampling replacement probability (default 0.5)")
    t.add_argument("--lr", type=fl, default=3e-3, help="AdamW learning rate")
    t.add_argument("--max-len", type=positive_int, default=256, help="positions kept per request (its last ones)")
    t.add_argument("--test-fraction", type=fl, default=0.1, help="requests held out for eval (default 0.1)")
    t.add_argument("--seed", type=seed, default=0, help="seed of the request split and the shuffles")
    t.add_argument("--shuffle-steps", action="store_true",
                   help="train the step-shuffled control (SeqMoE §3.1): every request's positions permuted")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    e = psub.add_parser("eval", help="recall of top-(k+3) forecasts vs baselines; overhead")
    e.add_argument("--predictor", required=True, help="predictor directory")
    e.add_argument("--traces", nargs="+", required=True, metavar="FILE",
                   help="the training traces (their held-out requests are used) or other traces (all requests)")
    e.add_argument("--control", help="a predictor trained with --shuffle-steps on the same traces (default: none)")
    e.add_argument("--horizon", type=positive_int, default=8, help="h of the Seq-h row (default 8)")
    e.add_argument("--long-threshold", type=positive_int, default=256, help="positions for Seq-L1 (default 256)")
    e.add_argument("--model", help="also measure the predictor's time per decode step on this model (default: "
                   "no overhead run)")
    e.add_argument("--overhead-prompts", type=positive_int, default=4, help="prompts of the overhead run")
    e.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per prompt in the overhead run")
    e.add_argument("--rollout", type=nonneg_int, default=8, help="recursive steps in the overhead run (default 8)")
    e.add_argument("--xl-weights", metavar="W1,W2,...",
                   help="traces collected with --xl-forecasts: blend weights of the cross-layer forecast at layer "
                   "distance 1, 2, ... for the Seq-1+XL-j rows (default: the seqmoe-xl policy's: the "
                   "predictor's calibrated ones, else predictor.xl_weights.XL_WEIGHTS)")
    e.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    c = psub.add_parser("calibrate-xl", help="fit the seqmoe-xl blend weights of a predictor to its model's "
                        "cross-layer forecasts (stored as xl_weights.json beside the predictor)")
    c.add_argument("--predictor", required=True, help="predictor directory")
    c.add_argument("--traces", nargs="+", required=True, metavar="FILE",
                   help="traces collected with --xl-forecasts, on prompts other than those you will measure on "
                   "(docs/benchmarks.md uses 12 of the predictor's training prompts)")
    c.add_argument("--grid", default=",".join(f"{w:g}" for w in XL_GRID), metavar="W1,W2,...",
                   help="candidate weights in [0, 1] (default: 0, 0.1, ..., 1)")
    c.add_argument("--replace", action="store_true", help="replace the predictor's existing xl_weights.json")
    c.add_argument("--allow-synthetic", action="store_true",
                   help="calibrate on synthetic traces (e.g. trace xl-accuracy's what-if copies); the weights "
                   "file then says so, and so does every run that uses it")
    c.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    c.add_argument("--quiet", action="store_true", help="no progress bars")


def _load_traces(paths: list[str]):
    """Load trace files, requiring one model id across them."""
    from ..trace.format import load_trace

    traces = [load_trace(p) for p in paths]
    ids = {t.header.get("model_id") for t in traces}
    if len(ids) > 1:
        raise MoeOffloadError(f"the traces come from different models: {sorted(map(str, ids))}")
    return traces


def _sequences(traces):
    from .features import trace_sequences

    seqs = []
    for i, t in enumerate(traces):
        seqs += trace_sequences(t, i)
    return seqs


def _split(pset, traces) -> tuple[list, list[int], list[int], str]:
    """``(requests, train indices, test indices, note)``: when ``traces`` are the predictor's training traces, its
    training split (evaluate on the held-out requests), else no training requests and every request to evaluate."""
    from .features import training_split

    seqs = _sequences(traces)
    split = training_split(pset.header.training, traces, [s.key for s in seqs])
    if split is not None:
        train_idx, test_idx = split
        return seqs, train_idx, test_idx, \
            f"held-out {len(test_idx)} of {len(seqs)} requests (the predictor's training split)"
    return seqs, [], list(range(len(seqs))), \
        f"all {len(seqs)} requests (these trace files are not the predictor's training trace files)"


def cmd_train(args) -> int:
    """``predictor train``: load the traces, split 90/10 by request, train, save. Returns the exit status.

    Raises:
        MoeOffloadError: bad arguments, unreadable or mixed-model traces, a non-empty ``--out``.
    """
    from .features import prefill_popularity, split_requests, trace_digest
    from .model import PredictorHeader, PredictorSpec, default_ranges
    from .train import TrainConfig, train_predictors

    if not 0 < args.test_fraction < 1:
        raise MoeOffloadError(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    traces = _load_traces(args.traces)
    h0 = traces[0].header
    seqs = _sequences(traces)
    if len(seqs) < 2:
        raise MoeOffloadError("need at least 2 requests in the traces to split into train and test")
    train_idx, test_idx = split_requests([s.key for s in seqs], args.test_fraction, args.seed)
    train = [seqs[i] for i in train_idx]
    if args.shuffle_steps:
        train = [s.shuffled(args.seed + 1 + i) for i, s in enumerate(train)]
    L = int(h0["num_moe_layers"])
    specs = [PredictorSpec(layers=r, hidden_size=args.hidden_size, num_mamba_layers=args.mamba_layers,
                           input_skip=not args.no_input_skip)
             for r in default_ranges(L, args.predictors)]
    header = PredictorHeader(model_id=h0["model_id"], model_type=h0.get("model_type", ""), num_moe_layers=L,
                             num_experts=int(h0["num_experts"]), top_k=int(h0["top_k"]), specs=specs,
                             shuffled_control=args.shuffle_steps,
                             training={"split": {"seed": args.seed, "test_fraction": args.test_fraction,
                                                 "traces": [{"name": Path(p).name, "digest": trace_digest(t)}
                                                            for p, t in zip(args.traces, traces)]},
                                       "test_requests": len(test_idx)},
                             prefill_popularity=prefill_popularity(traces, [seqs[i].key for i in train_idx], L,
                                                                   int(h0["num_experts"])))
    if not 0 <= args.ss_max_prob <= 1:
        raise MoeOffloadError(f"--ss-max-prob must be in [0, 1], got {args.ss_max_prob}")
    cfg = TrainConfig(epochs=args.epochs, ss_epochs=args.ss_epochs, ss_max_prob=args.ss_max_prob, lr=args.lr,
                      max_len=args.max_len, seed=args.seed)
    pset = train_predictors(header, train, cfg, progress=not args.quiet)
    pset.save(out)
    last = [h[-1]["loss"] for h in header.training["history"]]
    print(f"wrote {out}: {len(specs)} predictors (layers " + ", ".join(f"{a}-{b - 1}" for a, b in
          (s.layers for s in specs)) + f"), m={args.hidden_size}, {pset.num_parameters():,} parameters; "
          f"trained on {len(train)} requests in {header.training['seconds']:.0f} s; final loss "
          + ", ".join(f"{x:.3f}" for x in last))
    return 0


def cmd_eval(args) -> int:
    """``predictor eval``: recall table (and overhead with ``--model``). Returns the exit status.

    Raises:
        MoeOffloadError: unreadable predictor/traces, a predictor or control of another model, mismatched ranges.
    """
    from .baselines import MarkovPredictor
    from .evaluate import evaluate_predictor, popularity_counts, recall_table
    from .model import load_predictor

    traces = _load_traces(args.traces)
    model_id = traces[0].header.get("model_id")
    pset = load_predictor(args.predictor, model_id=model_id)
    control = load_predictor(args.control, model_id=model_id) if args.control else None
    if control is not None and [s.layers for s in control.header.specs] != [s.layers for s in pset.header.specs]:
        raise MoeOffloadError("--control must have the same layer ranges as --predictor")
    seqs, train_idx, test_idx, note = _split(pset, traces)
    test = [seqs[i] for i in test_idx]
    h = pset.header
    fit_on = [seqs[i] for i in train_idx] if train_idx else test
    markov = MarkovPredictor(h.num_moe_layers, h.num_experts).fit(fit_on)
    pop = popularity_counts(fit_on, h.num_moe_layers, h.num_experts)
    weights = None
    if args.xl_weights:
        from ..common.cliargs import split_floats
        from .xl_weights import check_xl_weights

        weights = check_xl_weights(split_floats(args.xl_weights, "--xl-weights"))
    res = evaluate_predictor(pset, test, horizon=args.horizon, long_threshold=args.long_threshold, markov=markov,
                             popularity=pop, control=control, progress=not args.quiet, xl_weights=weights)
    head, rows = recall_table(res)
    out = {"requests": note, "top_k": h.top_k, "num_experts": h.num_experts, "long_requests": res.long_requests,
           "recall": {r[0]: {"top_k_plus_3": r[1], "top_k": r[2], "pairs": r[3]} for r in rows},
           "markov_fitted_on": "training split" if train_idx else "the evaluated requests themselves (in-sample)",
           "parameters": pset.num_parameters(), "parameter_bytes": pset.parameter_bytes(),
           "state_bytes": pset.state_bytes()}
    if any(t.xl_probs is not None for t in traces):
        from .xl_weights import describe_xl_weights

        out["xl_blend_weights"] = (", ".join(f"{w:g}" for w in weights) + " (--xl-weights)" if weights
                                   else describe_xl_weights(pset))
    synthetic = sorted({t.header.get("xl_forecasts") or "generated" for t in traces if t.header.get("synthetic")})
    if synthetic:
        out["synthetic"] = synthetic
    if args.model:
        from .evaluate import measure_overhead

        out["overhead"] = measure_overhead(args.model, pset, args.overhead_prompts, args.max_new_tokens,
                                           args.rollout, progress=not args.quiet)
    if args.json:
        print(json.dumps(out))
        return 0
    _print_eval(args, pset, note, res, out, bool(train_idx), head, rows)
    return 0


def _print_eval(args, pset, note: str, res, out: dict, split: bool, head: list[str], rows: list[list[str]]) -> None:
    """``predictor eval``'s text report: what was evaluated, the recall table (``head``, ``rows``), the predictor's
    memory and, with ``--model``, its overhead (``out``: the JSON report's fields; ``split``: the Markov and Last
    baselines were fitted on a training split)."""
    from ..generation.report import format_table

    h = pset.header
    print(f"Predictor {args.predictor} on {note}; top-{h.top_k} of {h.num_experts}, Seq-L1 = requests of >= "
          f"{args.long_threshold} positions ({res.long_requests} requests); Markov/Last fitted on "
          f"{'the ' if split else ''}{out['markov_fitted_on']}")
    if "xl_blend_weights" in out:
        print(f"Seq-1+XL-j: Seq-1 blended with XL-j at the weights {out['xl_blend_weights']}")
    for what in out.get("synthetic", ()):
        print(f"SYNTHETIC trace: {what}")
    print(format_table(head, rows))
    print(f"predictor memory: {pset.num_parameters():,} parameters = {pset.parameter_bytes() / 2**20:.2f} MiB; "
          f"recurrent state {pset.state_bytes() / 2**10:.1f} KiB per request")
    if "overhead" in out:
        ov = out["overhead"]
        print(format_table(["predictor mode", "ms / decode step", "decode step ms (without predictor)", "share"],
                           [[m["mode"], f"{m['predictor_ms_per_step']:.2f}", f"{m['decode_ms_per_step']:.2f}",
                             f"{100 * m['share']:.2f}%"] for m in ov["modes"]]))


def cmd_calibrate_xl(args) -> int:
    """``predictor calibrate-xl``: per layer distance, the grid weight with the best blended recall
    (``predictor.xl_calibrate.calibrate_xl_weights``), stored as ``xl_weights.json`` in the predictor directory.
    Returns the exit status.

    Raises:
        MoeOffloadError: unreadable predictor or traces, traces without cross-layer forecasts, a bad grid, an
            existing ``xl_weights.json`` without ``--replace``.
    """
    from ..common.cliargs import split_floats
    from ..generation.report import format_table
    from .model import load_predictor
    from .xl_calibrate import calibrate_xl_weights
    from .xl_weights import XL_WEIGHTS_NAME, check_xl_weights, write_xl_weights

    grid = tuple(sorted(set(check_xl_weights(split_floats(args.grid, "--grid"), "--grid"))))
    if (Path(args.predictor) / XL_WEIGHTS_NAME).exists() and not args.replace:
        raise MoeOffloadError(f"{Path(args.predictor) / XL_WEIGHTS_NAME} already exists; pass --replace to "
                              "recalibrate (nothing was overwritten)")
    if len({Path(p).resolve() for p in args.traces}) < len(args.traces):
        raise MoeOffloadError("--traces names the same file twice")
    traces = _load_traces(args.traces)
    for p, t in zip(args.traces, traces):
        if t.xl_probs is None:
            raise MoeOffloadError(f"{p} has no cross-layer forecasts: calibration needs traces collected with "
                                  "--xl-forecasts")
    synthetic = [(p, t.header.get("xl_forecasts") or "a generated trace")
                 for p, t in zip(args.traces, traces) if t.header.get("synthetic")]
    if synthetic and not args.allow_synthetic:
        raise MoeOffloadError(f"{synthetic[0][0]} is synthetic ({synthetic[0][1]}); weights fitted on it would drive "
                              "real runs: pass --allow-synthetic if that is what you want")
    pset = load_predictor(args.predictor, model_id=traces[0].header.get("model_id"))
    seqs, _, test_idx, note = _split(pset, traces)
    seqs = [seqs[i] for i in test_idx]
    weights, table = calibrate_xl_weights(pset, seqs, grid, progress=not args.quiet)
    record = {"grid": list(grid), "requests": note, "traces": [str(Path(p).resolve()) for p in args.traces],
              "synthetic": bool(synthetic),
              "recall": {f"XL-{j}": {f"{w:g}": {"top_k": round(v[1], 6), "top_k_plus_3": round(v[0], 6)}
                                     for w, v in t.items()} for j, t in table.items()}}
    path = write_xl_weights(args.predictor, weights, record, replace=args.replace)
    if args.json:
        print(json.dumps({"weights": list(weights), "file": str(path)} | record))
        return 0
    k = pset.header.top_k
    print(f"Blend weight of the cross-layer forecast per layer distance: recall@top-{k} / recall@top-{k + 3} of "
          f"Seq-1 blended with XL-j, on {note}")
    dists = sorted(table)
    print(format_table(["weight", *(f"Seq-1+XL-{j}" for j in dists)],
                       [[f"{w:g}", *(f"{100 * table[j][w][1]:.2f}% / {100 * table[j][w][0]:.2f}%"
                                      + (" *" if weights[i] == w else "") for i, j in enumerate(dists))]
                        for w in grid]))
    print(f"wrote {path}: weights {', '.join(f'{w:g}' for w in weights)} (* above)"
          + (", fitted on synthetic traces" if synthetic else "")
          + "; seqmoe-xl, simulate and predictor eval use them with this predictor")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch ``moe-offload predictor ...``; returns the exit status."""
    if args.predictor_cmd == "calibrate-xl":
        return cmd_calibrate_xl(args)
    return cmd_train(args) if args.predictor_cmd == "train" else cmd_eval(args)
