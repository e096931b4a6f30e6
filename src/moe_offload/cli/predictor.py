"""``moe-offload predictor train|eval|calibrate-xl`` (SeqMoE §5.4, §9.4; the ``seqmoe-xl`` blend weights): the
options, the calls into ``predictor`` (``train.train_on_traces``, ``evaluate.eval_report``,
``xl_calibrate.calibrate_on_traces``) and what they print."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MoeOffloadError
from ..predictor.xl_calibrate import XL_GRID
from .args import float_ as fl
from .args import nonneg_int, positive_int, seed, split_floats


def add_parser(sub) -> None:
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


def cmd_train(args) -> int:
    """``predictor train``: load the traces, split 90/10 by request, train, save. Returns the exit status.

    Raises:
        MoeOffloadError: bad arguments, unreadable or mixed-model traces, a non-empty ``--out``.
    """
    from ..predictor.features import load_traces
    from ..predictor.train import TrainConfig, train_on_traces

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeOffloadError(f"{out} already exists and is not an empty directory; choose a new --out")
    traces = load_traces(args.traces)
    cfg = TrainConfig(epochs=args.epochs, ss_epochs=args.ss_epochs, ss_max_prob=args.ss_max_prob, lr=args.lr,
                      max_len=args.max_len, seed=args.seed)
    pset, n_train = train_on_traces(traces, [Path(p).name for p in args.traces], cfg, predictors=args.predictors,
                                    hidden_size=args.hidden_size, mamba_layers=args.mamba_layers,
                                    input_skip=not args.no_input_skip, test_fraction=args.test_fraction,
                                    shuffle_steps=args.shuffle_steps, progress=not args.quiet)
    pset.save(out)
    h = pset.header
    last = [x[-1]["loss"] for x in h.training["history"]]
    print(f"wrote {out}: {len(h.specs)} predictors (layers " + ", ".join(f"{a}-{b - 1}" for a, b in
          (s.layers for s in h.specs)) + f"), m={args.hidden_size}, {pset.num_parameters():,} parameters; "
          f"trained on {n_train} requests in {h.training['seconds']:.0f} s; final loss "
          + ", ".join(f"{x:.3f}" for x in last))
    return 0


def cmd_eval(args) -> int:
    """``predictor eval``: recall table (and overhead with ``--model``). Returns the exit status.

    Raises:
        MoeOffloadError: unreadable predictor/traces, a predictor or control of another model, mismatched ranges.
    """
    from ..predictor.evaluate import eval_report
    from ..predictor.features import load_traces
    from ..predictor.model import load_predictor
    from ..predictor.xl_weights import check_xl_weights

    traces = load_traces(args.traces)
    model_id = traces[0].header.get("model_id")
    pset = load_predictor(args.predictor, model_id=model_id)
    control = load_predictor(args.control, model_id=model_id) if args.control else None
    weights = check_xl_weights(split_floats(args.xl_weights, "--xl-weights")) if args.xl_weights else None
    out, res, head, rows = eval_report(pset, traces, control=control, horizon=args.horizon,
                                       long_threshold=args.long_threshold, xl_weights=weights, model=args.model,
                                       overhead_prompts=args.overhead_prompts, max_new_tokens=args.max_new_tokens,
                                       rollout=args.rollout, progress=not args.quiet)
    if args.json:
        print(json.dumps(out))
        return 0
    _print_eval(args, pset, res, out, head, rows)
    return 0


def _print_eval(args, pset, res, out: dict, head: list[str], rows: list[list[str]]) -> None:
    """``predictor eval``'s text report: what was evaluated, the recall table (``head``, ``rows``), the predictor's
    memory and, with ``--model``, its overhead (``out``: the JSON report's fields)."""
    from ..generation.report import format_table

    h = pset.header
    split = out["markov_fitted_on"] == "training split"
    print(f"Predictor {args.predictor} on {out['requests']}; top-{h.top_k} of {h.num_experts}, Seq-L1 = requests of "
          f">= {args.long_threshold} positions ({res.long_requests} requests); Markov/Last fitted on "
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
    """``predictor calibrate-xl``: the blend weights per layer distance, stored as ``xl_weights.json`` beside the
    predictor (``predictor.xl_calibrate.calibrate_on_traces``). Returns the exit status.

    Raises:
        MoeOffloadError: as ``calibrate_on_traces``.
    """
    from ..generation.report import format_table
    from ..predictor.xl_calibrate import calibrate_on_traces

    r = calibrate_on_traces(args.predictor, args.traces, tuple(split_floats(args.grid, "--grid")),
                            replace=args.replace, allow_synthetic=args.allow_synthetic, progress=not args.quiet)
    weights, table, k = r["weights"], r["table"], r["top_k"]
    if args.json:
        print(json.dumps({"weights": list(weights), "file": str(r["path"])} | r["record"]))
        return 0
    print(f"Blend weight of the cross-layer forecast per layer distance: recall@top-{k} / recall@top-{k + 3} of "
          f"Seq-1 blended with XL-j, on {r['note']}")
    dists = sorted(table)
    print(format_table(["weight", *(f"Seq-1+XL-{j}" for j in dists)],
                       [[f"{w:g}", *(f"{100 * table[j][w][1]:.2f}% / {100 * table[j][w][0]:.2f}%"
                                      + (" *" if weights[i] == w else "") for i, j in enumerate(dists))]
                        for w in r["grid"]]))
    print(f"wrote {r['path']}: weights {', '.join(f'{w:g}' for w in weights)} (* above)"
          + (", fitted on synthetic traces" if r["synthetic"] else "")
          + "; seqmoe-xl, simulate and predictor eval use them with this predictor")
    return 0


def run(args) -> int:
    """Dispatch ``moe-offload predictor ...``; returns the exit status."""
    if args.predictor_cmd == "calibrate-xl":
        return cmd_calibrate_xl(args)
    return cmd_train(args) if args.predictor_cmd == "train" else cmd_eval(args)
