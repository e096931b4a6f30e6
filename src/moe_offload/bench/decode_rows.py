"""The rows of ``moe-offload bench decode``: one measured configuration each, the medians of several interleaved
rounds (``--rounds``), and the markdown tables.

Why rounds: on this project's 2-core machine one configuration's decode speed moved by 10-30% between two runs
of the same command (the disk's bandwidth, the host's other tenants), which is as much as the differences between
policies that issue 47 measures. With ``rounds`` N > 1 every configuration is measured N times; the rows run in the
given order in rounds 1, 3, ... and in the reverse order in rounds 2, 4, ... (so a drift over the run weighs on
every row alike), FullLoad first in each. A row then shows the median of its rounds' decode tok/s with their range,
the median of its per-round ratios to FullLoad, and beside the baseline policy (``lru`` when listed, else the first
one) the median over rounds of its tok/s over the baseline's at the same residency *in the same round*: the pair
was measured minutes apart, not a whole run apart.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from ..core.policy_spec import PolicySpec


@dataclass
class DecodeRow:
    """One measured configuration of ``bench decode``: FullLoad, or a policy at a residency.

    Attributes:
        policy: the policy's name (``auto``: its choice, e.g. ``auto:lfu``); requested: the policy asked for (a
            ``PolicySpec``; ``FullLoad`` for the reference row).
        residency: fraction of the experts in the slot pool (None for FullLoad); slots: slot count (None: all).
        tok_s: decode tokens per second (with rounds: the median); ratio: ``tok_s`` / FullLoad's in the same run
            (with rounds: the median of the rounds' ratios, each to the same round's FullLoad).
        hit_rate: expert hit rate (prefill included; None for FullLoad); bytes_loaded: host->device bytes.
        ttft_s: mean time to first token (s); same: tokens equal FullLoad's (with rounds: in every round);
        device_bytes: bytes of expert weights on the device.
        simulated: the simulator's decode fraction of FullLoad for the same requests under the same link model
            (None where it does not apply: no emulated link, ``auto``, tokens that differ from FullLoad's).
        tok_s_range: with rounds, the lowest and highest decode tok/s of the rounds (None: one round).
        vs_baseline: with rounds, the median over rounds of ``tok_s`` over the baseline policy's at the same
            residency in the same round (None: one round, or no baseline).
    """

    policy: str
    requested: PolicySpec | str
    residency: float | None
    slots: int | None
    tok_s: float
    ratio: float
    hit_rate: float | None
    bytes_loaded: int
    ttft_s: float
    same: bool
    device_bytes: int
    simulated: float | None = None
    tok_s_range: tuple[float, float] | None = None
    vs_baseline: float | None = None


def baseline_policy(policies: list[PolicySpec]) -> PolicySpec | None:
    """The policy the others are set against: ``lru`` when listed (the field's baseline, whatever the order of the
    rows), else the first one; None when only one policy is measured."""
    if len({p.name for p in policies}) < 2:
        return None
    return next((p for p in policies if p.name == "lru"), policies[0])


def round_order(cells: list, round_index: int) -> list:
    """The order ``cells`` run in round ``round_index`` (0-based): as given in even rounds, reversed in odd ones."""
    return list(cells) if round_index % 2 == 0 else list(reversed(cells))


def median_round(tok_s: list[float]) -> int:
    """The index of the round whose tok/s is the median (the lower middle one for an even count; ties in round
    order): the round whose other measurements (hit rate, time breakdown, CPU account) a row shows.

    Raises:
        ValueError: no rounds."""
    if not tok_s:
        raise ValueError("no rounds")
    order = sorted(range(len(tok_s)), key=lambda k: (tok_s[k], k))
    return order[(len(tok_s) - 1) // 2]


def median_rows(cells: list[list[tuple[DecodeRow, dict]]], full_tok_s: list[float],
                baseline: PolicySpec | None = None) -> list[tuple[DecodeRow, dict]]:
    """One row per configuration from its rounds (module docstring).

    Args:
        cells: ``cells[c][k]``: configuration c's row (its ``ratio`` unused) and time breakdown in round k; every
            configuration has one entry per round (at least one).
        full_tok_s: FullLoad's decode tok/s in each round (> 0), same length as each ``cells[c]``.
        baseline: the policy other rows are set against (``vs_baseline``; its own rows get 1.0), or None.
    Returns:
        ``[(row, breakdown)]`` in ``cells``' order: the median round's row and breakdown (``median_round``), with
        ``tok_s`` the median over rounds, ``ratio`` the median of the rounds' ``tok_s / full_tok_s``, ``same``
        true only when true in every round, ``tok_s_range`` and ``vs_baseline`` set when there are several rounds.
    Raises:
        ValueError: a configuration with no rounds, or with another count of rounds than ``full_tok_s``.
    """
    n = len(full_tok_s)
    if any(len(c) != n or not c for c in cells):
        raise ValueError(f"every configuration needs {n} rounds (one per FullLoad measurement)")
    base_of = {}  # residency -> the baseline's tok/s in each round
    for c in cells:  # a residency listed twice: its first cell
        if baseline is not None and c[0][0].requested == baseline:
            base_of.setdefault(c[0][0].residency, [r.tok_s for r, _ in c])
    out = []
    for c in cells:
        speeds = [r.tok_s for r, _ in c]
        row, breakdown = c[median_round(speeds)]
        row = replace(row)
        row.tok_s = statistics.median(speeds)
        row.ratio = statistics.median(s / f for s, f in zip(speeds, full_tok_s))
        row.same = all(r.same for r, _ in c)
        if n > 1:
            row.tok_s_range = (min(speeds), max(speeds))
            base = base_of.get(row.residency)
            if base is not None:
                row.vs_baseline = statistics.median(s / b for s, b in zip(speeds, base))
        out.append((row, breakdown))
    return out


def rounds_note(rounds: int, baseline: str | None) -> str:
    """The sentence under the table that says how ``rounds`` rounds were run and merged (module docstring)."""
    vs = (f"; vs {baseline}: the median over rounds of a row's tok/s over {baseline}'s at the same residency in "
          "the same round" if baseline else "")
    return (f"each row measured in {rounds} rounds (in the order above in rounds 1, 3, ..., reversed in rounds 2, "
            f"4, ...; FullLoad first in each): decode tok/s and vs FullLoad are medians over the rounds (each taken "
            f"on its own, so two rows may rank differently by them){vs}; same tokens: in every round; the other "
            "columns and the tables below are the row's median round's")


def table(rows: list[DecodeRow], baseline: str | None = None) -> list[str]:
    """The markdown lines of the main table (decode tok/s, MiB loaded and device expert MiB in MiB = 2^20 bytes,
    mean TTFT in seconds); with rounds (a row's ``tok_s_range`` set) also each row's range of tok/s and, given the
    ``baseline`` policy's name, its median ratio to it."""
    rounds = any(r.tok_s_range is not None for r in rows)
    extra = ["tok/s min-max"] if rounds else []
    vs = [f"vs {baseline}"] if rounds and baseline else []
    head = (["policy", "residency", "slots", "decode tok/s", *extra, "vs FullLoad", *vs, "simulated vs FullLoad",
             "hit rate", "MiB loaded", "mean TTFT s", "same tokens", "device expert MiB"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.policy, "-" if r.residency is None else f"{r.residency:.2f}", "all" if r.slots is None else
                 str(r.slots), f"{r.tok_s:.2f}"]
        if rounds:
            cells.append("-" if r.tok_s_range is None else f"{r.tok_s_range[0]:.2f}-{r.tok_s_range[1]:.2f}")
        cells.append(f"{r.ratio:.3f}")
        if vs:
            cells.append("-" if r.vs_baseline is None else f"{r.vs_baseline:.3f}")
        cells += ["-" if r.simulated is None else f"{r.simulated:.3f}",
                  "-" if r.hit_rate is None else f"{r.hit_rate:.4f}", f"{r.bytes_loaded / 2**20:.1f}",
                  f"{r.ttft_s:.3f}", "yes" if r.same else "NO", f"{r.device_bytes / 2**20:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def breakdown_table(rows: list[tuple[str, float, dict]]) -> list[str]:
    """Markdown lines: per (policy, residency) the decode step time split into the phases of
    ``runtime.breakdown`` (ms per step, share in parentheses), measured by the engine's lap timers."""
    from ..runtime.breakdown import PHASES

    out = ["| policy | residency | ms per decode step | " + " | ".join(p.replace("_", " ") for p in PHASES) + " |",
           "|---|---|---|" + "---|" * len(PHASES)]
    for pol, r, b in rows:
        ms = b["ms_per_step"]
        out.append(f"| {pol} | {r:.2f} | {sum(ms.values()):.2f} | "
                   + " | ".join(f"{ms[p]:.2f} ({b['shares'][p]:.0%})" for p in PHASES) + " |")
    return out
