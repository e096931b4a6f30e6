"""The outputs of ``bench disk`` (issue 36): the markdown table, csv, json and the plot of decode tok/s against the
share of expert bytes in memory."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MoeOffloadError
from ..runtime.cpu_account import account_table

COLUMNS = ("row", "fraction", "limit_bytes", "status", "decode_tok_s", "vs_own_unlimited", "hit_rate",
           "mb_read_per_token", "mb_read_per_token_at_least", "read_gbps", "physical_limit_tok_s", "tokens_equal_full_load", "peak_bytes", "wall_s",
           "cached_before_bytes", "page_cached_expert_bytes", "slot_bytes")


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec) if isinstance(v, float) else str(v)


def markdown(result: dict) -> str:
    """The table of one ``run_bench`` result (module docstring: the columns)."""
    head = ("| row | experts in memory | held at end | limit (GB) | decode tok/s | vs own unlimited | hit rate | "
            "MB read / token | read GB/s | physical limit tok/s | tokens == FullLoad | status |")
    lines = [head, "|" + "---|" * 12]
    for c in result["cells"]:
        lines.append("| " + " | ".join([
            c["row"], "all" if c["fraction"] is None else f"{c['fraction']:.0%}", _held(c, result),
            "none" if c["limit_bytes"] is None else f"{c['limit_bytes'] / 1e9:.2f}",
            _fmt(c["decode_tok_s"]), _fmt(c["vs_own_unlimited"], ".3f"), _fmt(c["hit_rate"], ".3f"),
            _fmt(c["mb_read_per_token"], ".1f") or (f">= {c['mb_read_per_token_at_least']:.1f}"
                                                     if c.get("mb_read_per_token_at_least") is not None else ""), _fmt(c["read_gbps"], ".3f"), _fmt(c["physical_limit_tok_s"]),
            _fmt(c["tokens_equal_full_load"]), c["status"]]) + " |")
    b = result["baselines"]
    lines.append("")
    lines.append(f"Expert bytes {result['expert_bytes'] / 1e9:.3f} GB (GGUF: "
                 f"{_fmt(result['gguf_expert_bytes'] and result['gguf_expert_bytes'] / 1e9, '.3f') or 'n/a'} GB); "
                 f"baselines (limit = baseline + share x expert bytes): ours {b['ours'] / 1e9:.3f} GB, ours mmap "
                 f"{'n/a' if b.get('ours mmap') is None else format(b['ours mmap'] / 1e9, '.3f')} GB, llama.cpp "
                 f"{'n/a' if b['llama.cpp'] is None else format(b['llama.cpp'] / 1e9, '.3f')} GB; "
                 f"{result['max_new_tokens']} new tokens per cell, greedy; order "
                 f"{'reversed' if result['reverse'] else 'forward'}.")
    accounts = [(f"{c['row']} at {'all' if c['fraction'] is None else format(c['fraction'], '.0%')}",
                 c["cpu_account"]) for c in result["cells"] if c.get("cpu_account")]
    if accounts:
        lines += ["", "Decode step CPU by role, our offloaded rows (ms per step; copies: CPU (wall), every thread):",
                  "", *account_table(accounts)]
    return "\n".join(lines)


def _held(cell: dict, result: dict) -> str:
    """The share of the expert bytes a cell held when its run ended: its slots plus the experts' pages the kernel
    still cached (llama.cpp: the GGUF's expert pages), or "" when not measured."""
    cached = cell.get("page_cached_expert_bytes")
    if cached is None or cell["fraction"] is None or cell["status"] != "ok":
        return ""
    llama = cell["row"].startswith("llama.cpp")
    total = result.get("gguf_expert_bytes") if llama else result["expert_bytes"]
    held = cached + (0 if llama else cell.get("slot_bytes") or 0)
    return f"{held / total:.0%}" if total else ""


def write_results(result: dict, out: Path) -> list[Path]:
    """``results.md``, ``results.csv``, ``results.json`` and ``tok_s.png`` (decode tok/s against the share of expert
    bytes in memory, one line per row) in the new folder ``out``.

    Raises:
        MoeOffloadError: ``out`` exists (nothing is overwritten).
    """
    import csv

    if out.exists():
        raise MoeOffloadError(f"{out} already exists; choose a new --out")
    out.mkdir(parents=True)
    (out / "results.md").write_text(markdown(result) + "\n")
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["cells"])
    _plot(result, out / "tok_s.png")
    return [out / n for n in ("results.md", "results.csv", "results.json", "tok_s.png")]


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows: dict[str, list] = {}
    for c in result["cells"]:
        if c["fraction"] is not None and c["status"] == "ok":
            rows.setdefault(c["row"], []).append((c["fraction"], c["decode_tok_s"]))
    for row, pts in rows.items():
        pts.sort()
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=row)
    full = next((c for c in result["cells"] if c["fraction"] is None and c["row"].startswith("FullLoad")), None)
    if full is not None and full["decode_tok_s"]:
        ax.axhline(full["decode_tok_s"], color="grey", linestyle="--", label="FullLoad (ours, in memory)")
    ax.set_xlabel("expert bytes in memory (% of all)")
    ax.set_ylabel("decode tok/s")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
