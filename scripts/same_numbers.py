#!/usr/bin/env python3
"""Do two source trees print the same numbers? The deterministic outputs of ``generate``, ``trace collect``,
``predictor train`` / ``eval``, ``simulate`` and ``bench decode`` on the same inputs (one intra-op thread, greedy),
run against a tree's ``src`` and compared between two runs. Used for a change that must not change behaviour
(issue 45: the house rebuilt; docs/benchmarks.md, "The same numbers after the house was rebuilt").

    python scripts/same_numbers.py run SRC OUT      # e.g. SRC = a worktree's src of the commit before, OUT a new folder
    python scripts/same_numbers.py compare OUT_A OUT_B

``run`` needs the built-in testbed and testbed-sparse (built on first use) and takes about two minutes here.
``compare`` prints one line per output: ``same``, or what differs; it exits 1 when anything differs. Compared:
generated token ids and hit / miss / byte counts (not seconds), the trace and predictor files byte for byte (the
predictor's header less its training seconds), the simulator's CSVs, the hit rates, bytes loaded and token checks of
``bench decode``'s rows, and the printed text of ``trace collect``, ``predictor train`` and ``predictor eval`` less
progress bars and seconds.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

COMMANDS = [
    ("gen_lfu.json", ["generate", "--residency", "0.25", "--policy", "lfu", "--max-new-tokens", "16", "--json"]),
    ("gen_auto.json", ["generate", "--residency", "0.25", "--max-new-tokens", "16", "--json"]),
    ("trace.out", ["trace", "collect", "--model", "testbed-sparse", "--sharegpt", "4", "--max-new-tokens", "24",
                   "--xl-forecasts", "--router-probs", "--out", "sparse4.trace"]),
    ("sim.out", ["simulate", "--trace", "sparse4.trace", "--residency", "0.25,0.45", "--policy",
                 "lru,lfu,lfru,prefill-hot,belady,belady-8,xl", "--hardware", "rtx4090", "--model-profile",
                 "qwen3-30b-a3b-fp8", "--out", "sim"]),
    ("bench.out", ["bench", "decode", "--model", "testbed-sparse", "--residencies", "0.45,0.25", "--policy",
                   "lru,lfu,xl", "--sharegpt", "2", "--max-new-tokens", "16"]),
    ("pred.out", ["predictor", "train", "--traces", "sparse4.trace", "--out", "pred", "--epochs", "2", "--ss-epochs",
                  "1", "--seed", "0", "--quiet"]),
    ("simpred.out", ["simulate", "--trace", "sparse4.trace", "--predictor", "pred", "--residency", "0.25,0.45",
                     "--policy", "lru,seqmoe,seqmoe-cacheonly,seqmoe-xl", "--hardware", "rtx4090", "--model-profile",
                     "qwen3-30b-a3b-fp8", "--out", "simpred"]),
    ("benchpred.out", ["bench", "decode", "--model", "testbed-sparse", "--residencies", "0.45", "--policy", "seqmoe",
                       "--predictor", "pred", "--sharegpt", "2", "--max-new-tokens", "16"]),
    ("predeval.out", ["predictor", "eval", "--predictor", "pred", "--traces", "sparse4.trace"]),
]


def run(src: Path, out: Path) -> int:
    """Every command of ``COMMANDS`` with ``src`` first on the path, in ``out`` (new), each one's output kept."""
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    for name, argv in COMMANDS:
        with open(out / name, "w") as f:
            r = subprocess.run([sys.executable, "-m", "moe_offload.cli", *argv], cwd=out, env=env, stdout=f,
                               stderr=subprocess.STDOUT if name.endswith(".out") else subprocess.DEVNULL)
        print(f"{name}: exit {r.returncode}")
    return 0


def _generated(path: Path):
    d = json.loads(path.read_text())
    s = d["stats"]
    return ([o["token_ids"] for o in d["outputs"]],
            {k: s.get(k) for k in ("hits", "misses", "policy", "slots", "bytes_loaded", "hit_rate")},
            s.get("auto_policy", {}).get("choice"), s.get("auto_policy", {}).get("simulated_hit_rates"))


def _text(path: Path) -> list[str]:
    text = re.sub(r"[^\n]*\r", "", path.read_text())  # progress bars redraw with carriage returns
    text = re.sub(r"in \d+ s", "in N s", text)
    return [ln.rstrip() for ln in text.splitlines() if "it/s" not in ln and "%|" not in ln and ln.strip()]


def _decode_rows(path: Path):
    """``bench decode``'s rows: policy, residency, slots, hit rate, MiB loaded, same tokens (not the speeds)."""
    rows = []
    for ln in path.read_text().splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if ln.startswith("|") and len(cells) == 11 and not ln.startswith("|---"):
            rows.append((cells[0], cells[1], cells[2], cells[6], cells[7], cells[9]))
    return rows


def _predictor_header(path: Path) -> dict:
    d = json.loads(path.read_text())
    d.get("training", {}).pop("seconds", None)
    return d


def compare(a: Path, b: Path) -> int:
    """One line per compared output; 1 when any differs."""
    checks = {
        "generate lfu": lambda d: _generated(d / "gen_lfu.json"),
        "generate auto": lambda d: _generated(d / "gen_auto.json"),
        "trace file": lambda d: (d / "sparse4.trace").read_bytes(),
        "trace collect text": lambda d: _text(d / "trace.out"),
        "predictor weights": lambda d: (d / "pred" / "predictor.safetensors").read_bytes(),
        "predictor header": lambda d: _predictor_header(d / "pred" / "predictor.json"),
        "predictor train text": lambda d: _text(d / "pred.out"),
        "predictor eval text": lambda d: _text(d / "predeval.out"),
        "simulate csv": lambda d: list(csv.reader(open(d / "sim" / "results.csv"))),
        "simulate --predictor csv": lambda d: list(csv.reader(open(d / "simpred" / "results.csv"))),
        "bench decode rows": lambda d: _decode_rows(d / "bench.out"),
        "bench decode seqmoe rows": lambda d: _decode_rows(d / "benchpred.out"),
    }
    bad = 0
    for name, get in checks.items():
        try:
            x, y = get(a), get(b)
        except (OSError, ValueError, KeyError) as e:
            print(f"{name}: missing ({e})")
            bad += 1
            continue
        same = x == y
        bad += not same
        print(f"{name}: {'same' if same else 'DIFFERS'}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "run":
        return run(Path(argv[1]), Path(argv[2]))
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
