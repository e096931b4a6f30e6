"""Simulation reports: CSV, a markdown table and PNG plots in the papers' figure formats (DESIGN.md §6).

* ``hit_rate.png``: hit rate vs residency, one line per policy, one panel per trace (SeqMoE fig. 3 / fig. 7);
* ``decode_speed.png``: projected decode tok/s vs residency, one line per policy, a dashed FullLoad line, one panel
  per trace (SeqMoE fig. 6).

A report made from a synthetic trace says so in its title (markdown and plots): its numbers describe the generator,
not a model.
"""

from __future__ import annotations

import csv
import math
import textwrap
from pathlib import Path

from ..errors import MoeOffloadError

#: preferred column order; other keys follow in first-seen order
COLUMNS = ("trace", "synthetic", "model", "hardware", "policy", "residency", "slots", "hit_rate", "decode_hit_rate",
           "hits", "misses", "decode_misses", "accesses", "projection", "projected_tok_s", "full_load_tok_s",
           "fraction_of_full_load", "stall_s_per_step")

_PERCENT = {"residency", "hit_rate", "decode_hit_rate", "fraction_of_full_load"}


def _is_synthetic(rows) -> bool:
    return any(bool(r.get("synthetic")) for r in rows)


def _columns(rows) -> list[str]:
    seen = [c for c in COLUMNS if any(c in r for r in rows)]
    for r in rows:
        for c in r:
            if c not in seen:
                seen.append(c)
    return seen


def _fmt(col: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if col in _PERCENT:
            return f"{100 * v:.2f}%"
        if col.endswith("tok_s"):
            return f"{v:.1f}"
        return f"{v:.4g}"
    return str(v)


def _prepare_out(out_dir) -> Path:
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise MoeOffloadError(f"{out} exists and is not a directory; choose a new output directory")
        if any(out.iterdir()):
            raise MoeOffloadError(f"{out} is not empty; choose a new output directory (reports never overwrite files)")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_csv(rows: list[dict], path: Path, cols: list[str] | None = None) -> Path:
    """Write ``rows`` as CSV with columns ``cols`` (default ``_columns(rows)``; missing cells empty); returns
    ``path``."""
    cols = cols or _columns(rows)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in cols})
    return path


def table_lines(rows: list[dict], cols: list[str]) -> list[str]:
    """Markdown table lines (header, rule, one line per row) of ``rows`` restricted to ``cols``, cells formatted
    by ``_fmt`` (pipes escaped)."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, r.get(c)).replace("|", "\\|") for c in cols) + " |")
    return lines


def write_report(rows: list[dict], out_dir, title: str) -> list[Path]:
    """Write ``results.csv``, ``results.md``, ``hit_rate.png`` and (when rows carry ``projected_tok_s``)
    ``decode_speed.png`` into ``out_dir``.

    Args:
        rows: one dict per (trace, policy, residency) run. Keys used: ``trace`` (str), ``policy`` (str),
            ``residency`` (fraction of all routed experts in device slots, 0..1), ``slots`` (int), ``hit_rate`` and
            ``decode_hit_rate`` (0..1), ``misses`` (int), ``projected_tok_s`` (tokens/s), ``full_load_tok_s``,
            ``fraction_of_full_load`` (0..1), ``synthetic`` (bool); any other keys become extra columns.
        out_dir: a directory that does not exist yet or is empty (created).
        title: the report's title; " — SYNTHETIC trace" is appended when any row's trace is synthetic.

    Returns:
        The written files' paths.

    Raises:
        MoeOffloadError: no rows, or ``out_dir`` exists and is a file or not empty (never overwrites).
    """
    if not rows:
        raise MoeOffloadError("no results to report")
    out = _prepare_out(out_dir)
    if _is_synthetic(rows):
        title = f"{title} — SYNTHETIC trace"
    cols = _columns(rows)
    written = []

    written.append(write_csv(rows, out / "results.csv", cols))

    p = out / "results.md"
    lines = [f"# {title}", ""]
    if _is_synthetic(rows):
        lines += ["Rows marked synthetic replay a trace with generated parts: a generated routing "
                  "(`moe_offload.trace.synthetic`: they measure the simulator and the generator, not a model), or a "
                  "recorded routing with what-if cross-layer forecasts (`trace xl-accuracy`: only the xl policies' "
                  "forecasts are made up; see `trace info`).", ""]
    lines += table_lines(rows, cols)
    p.write_text("\n".join(lines) + "\n")
    written.append(p)

    written += _plots(rows, out, title)
    return written


def _panels(rows) -> dict:
    """``{trace: {policy: [(residency, row), ...] sorted}}``."""
    out: dict = {}
    for r in rows:
        if r.get("residency") is None or r.get("policy") is None:
            continue
        out.setdefault(str(r.get("trace", "")), {}).setdefault(str(r["policy"]), []).append((float(r["residency"]), r))
    for pols in out.values():
        for v in pols.values():
            v.sort(key=lambda x: x[0])
    return out


def _plots(rows, out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    if not panels:
        return []
    written = []
    key = "decode_hit_rate" if all(r.get("decode_hit_rate") is not None for r in rows) else "hit_rate"
    specs = [("hit_rate.png", key, f"{'decode ' if key == 'decode_hit_rate' else ''}hit rate (%)", 100.0)]
    if any(r.get("projected_tok_s") is not None for r in rows):
        specs.append(("decode_speed.png", "projected_tok_s", "projected decode (tok/s)", 1.0))
    for fname, ykey, ylabel, scale in specs:
        n = len(panels)
        fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 0.6, 3.9), squeeze=False)
        for ax, (trace, pols) in zip(axes[0], panels.items()):
            for pol, pts in pols.items():
                pts = [(x, r[ykey]) for x, r in pts if r.get(ykey) is not None]
                if pts:
                    ax.plot([100 * x for x, _ in pts], [scale * y for _, y in pts], marker="o", label=pol)
            if ykey == "projected_tok_s":
                full = {r.get("full_load_tok_s") for p in pols.values() for _, r in p} - {None}
                for fl in sorted(full):
                    ax.axhline(fl, color="black", linestyle="--", linewidth=1)
                    ax.annotate(f"Full-load {fl:g}", (0.02, fl), xycoords=("axes fraction", "data"),
                                va="bottom", fontsize=8)
                top = max([float(f) for f in full] + [ax.get_ylim()[1]])
                ax.set_ylim(0, top * 1.12)
            ax.set_title(trace, fontsize=9)
            ax.set_xlabel("residency (% of experts loaded)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(textwrap.fill(title, width=int(42 * n + 6)), fontsize=10)
        fig.tight_layout()
        p = out / fname
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written
