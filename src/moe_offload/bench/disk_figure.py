"""One picture of several ``bench disk`` runs: decode tok/s against the share of the expert bytes in memory, one
panel per model, ours and llama.cpp's (issue 45, item 5; the README's figure).

``bench disk`` writes one folder per run (``disk_report.write_results``: ``results.csv`` with the columns ``row``,
``fraction``, ``status``, ``decode_tok_s``, ...; ``results.md``; ``results.json`` in recent runs) and plots that run
alone (``tok_s.png``). This module reads the ``results.csv`` of several such folders and draws them together:

- one panel per model, titled with the model's name: ``NAME=DIR`` when the folder is given so, else the ``model``
  of its ``results.json`` when the run recorded one, else the folder's name less a trailing ``-reversed`` (so that a
  run and its ``--reverse`` twin share a panel); the panel's subtitle gives the expert bytes (``results.json``'s
  ``expert_bytes`` or ``results.md``'s "Expert bytes N GB") and the folders;
- x: the share of the expert bytes in memory (%), y: decode tok/s on a log scale;
- one line per engine row (ours per policy, our mmap mode, llama.cpp): the mean of the runs that finished the cell,
  each run's value a dot;
- rows without a share (FullLoad, llama.cpp unlimited) as horizontal dashed lines at their mean, labelled;
- every cell that did not finish (status not ``ok``: a timeout, a failure) as an open marker on the panel's floor
  and in the note under the panel, with its status: never dropped.

    moe-offload bench disk-figure [NAME=]DIR [[NAME=]DIR ...] --out PNG [--force]

Bad input (a missing folder or ``results.csv``, a csv without the needed columns or with a value that is not a
number, an existing ``--out`` without ``--force``) is a ``MoeOffloadError`` with a one-line message.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import MoeOffloadError

#: the columns of ``results.csv`` the figure reads (``disk_report.COLUMNS`` has them all)
REQUIRED_COLUMNS = ("row", "fraction", "status", "decode_tok_s")
_EXPERT_GB = re.compile(r"Expert bytes ([0-9.]+) GB")
_FULL_LOAD = "FullLoad"


@dataclass(frozen=True)
class Cell:
    """One row of a ``results.csv``: ``fraction`` None for a row without a limit (FullLoad, llama.cpp unlimited);
    ``tok_s`` None when the cell did not finish."""

    row: str
    fraction: float | None
    status: str
    tok_s: float | None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Run:
    """One ``bench disk`` folder: its cells, the model it ran (the panel it goes to) and its expert bytes."""

    path: Path
    model: str
    cells: tuple[Cell, ...]
    expert_bytes: float | None


def _number(text: str, what: str, where: str) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise MoeOffloadError(f"{where}: {what} {text.strip()!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise MoeOffloadError(f"{where}: {what} {text.strip()!r} is not a finite number")
    return value


def read_cells(csv_path: Path) -> tuple[Cell, ...]:
    """The cells of one ``results.csv``.

    Raises:
        MoeOffloadError: the file is missing, has not the columns ``REQUIRED_COLUMNS``, has no rows, or a value that
            is not a number (a share outside (0, 1], an ``ok`` cell without a positive decode tok/s).
    """
    if not csv_path.is_file():
        raise MoeOffloadError(f"{csv_path.parent}: no results.csv (expected a `bench disk --out` folder)")
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise MoeOffloadError(f"{csv_path}: no column {', '.join(missing)} (a `bench disk` results.csv has "
                                  f"{', '.join(REQUIRED_COLUMNS)}, ...)")
        cells = [_cell(rec, f"{csv_path} line {reader.line_num}") for rec in reader]
    if not cells:
        raise MoeOffloadError(f"{csv_path}: no rows")
    return tuple(cells)


def _cell(rec: dict, where: str) -> Cell:
    row, status = (rec.get("row") or "").strip(), " ".join((rec.get("status") or "").split())
    if not row or not status:
        raise MoeOffloadError(f"{where}: empty row or status")
    fraction = _number(rec.get("fraction"), "fraction", where)
    if fraction is not None and not 0 < fraction <= 1:
        raise MoeOffloadError(f"{where}: fraction {fraction} is not in (0, 1]")
    tok_s = _number(rec.get("decode_tok_s"), "decode_tok_s", where)
    if status == "ok" and (tok_s is None or tok_s <= 0):
        raise MoeOffloadError(f"{where}: row {row!r} is ok but has no positive decode_tok_s")
    return Cell(row, fraction, status, tok_s if status == "ok" else None)


def _expert_bytes(folder: Path) -> float | None:
    """The run's expert bytes: ``results.json``'s ``expert_bytes``, else ``results.md``'s "Expert bytes N GB"."""
    recorded = _recorded(folder).get("expert_bytes")
    if isinstance(recorded, (int, float)) and recorded > 0:
        return float(recorded)
    md = folder / "results.md"
    found = _EXPERT_GB.search(md.read_text(errors="replace")) if md.is_file() else None
    return float(found.group(1)) * 1e9 if found else None


def _recorded(folder: Path) -> dict:
    """``results.json`` without its cells ({} when absent or unreadable: the csv is the data)."""
    try:
        data = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_run(spec: Path | str) -> Run:
    """One ``bench disk`` folder, given as ``DIR`` or ``NAME=DIR`` (NAME: the model, the panel's title; a path that
    exists as written is a folder even if it holds ``=``).

    Raises:
        MoeOffloadError: no such folder, or ``read_cells``'s errors.
    """
    text = str(spec)
    name = None
    if not Path(text).exists() and "=" in text:
        name, text = text.split("=", 1)
        name = name.strip() or None
    folder = Path(text)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder}: no such folder (expected a `bench disk --out` folder)")
    model = name or _recorded(folder).get("model")
    if not isinstance(model, str) or not model.strip():
        model = re.sub(r"-reversed$", "", folder.resolve().name)
    return Run(folder, model.strip(), read_cells(folder / "results.csv"), _expert_bytes(folder))


def panels(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs by model, in the order the models first appear."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.model, []).append(run)
    return out


def engine(row: str) -> str:
    """A row's engine, its colour: the label before its first parenthesis (``llama.cpp (mmap, unlimited)`` and
    ``llama.cpp (mmap)`` are one engine)."""
    return row.split(" (", 1)[0].strip()


@dataclass
class _Series:
    """One panel's data: per limited row its finished values by share, its unfinished cells by (share, status
    kind), and the rows without a limit."""

    runs: int
    finished: dict[str, dict[float, list[float]]]
    unfinished: dict[str, dict[tuple[float | None, str], int]]
    unlimited: dict[str, list[float]]


def _series(runs: Sequence[Run]) -> _Series:
    """The cells of one panel's runs, sorted into ``_Series`` (a row with a limit is listed even if no cell of it
    finished, so that its unfinished cells get its colour and a legend entry)."""
    s = _Series(len(runs), {}, {}, {})
    for run in runs:
        for c in run.cells:
            if not c.ok:
                key = (c.fraction, c.status.split(":", 1)[0].strip())
                bucket = s.unfinished.setdefault(c.row, {})
                bucket[key] = bucket.get(key, 0) + 1
            elif c.fraction is None:
                s.unlimited.setdefault(c.row, []).append(c.tok_s)
            else:
                s.finished.setdefault(c.row, {}).setdefault(c.fraction, []).append(c.tok_s)
            if c.fraction is not None:
                s.finished.setdefault(c.row, {})
    return s


def _note(s: _Series) -> str:
    """The cells that did not finish, one line per row and status kind (the status before its first colon), e.g.
    "llama.cpp (mmap), timeout: 25% (2 of 2 runs), 10% (1 of 2 runs)"; "every cell finished" when none."""
    lines = []
    for row, cells in s.unfinished.items():
        kinds: dict[str, list[str]] = {}
        for (fraction, kind), n in cells.items():
            where = "unlimited" if fraction is None else f"{fraction:.0%}"
            kinds.setdefault(kind, []).append(where + (f" ({n} of {s.runs} runs)" if s.runs > 1 else ""))
        lines += [f"{row}, {kind}: {', '.join(places)}" for kind, places in kinds.items()]
    if not lines:
        return "every cell finished"
    return "did not finish (open markers on the floor):\n" + "\n".join(lines)


def _draw_panel(ax, model: str, runs: Sequence[Run], colors: dict[str, str]) -> None:
    from matplotlib.transforms import blended_transform_factory

    s = _series(runs)
    floor = blended_transform_factory(ax.transData, ax.transAxes)
    level = 0
    for row, by_share in s.finished.items():
        color = colors[engine(row)]
        shares = sorted(by_share)
        means = [sum(by_share[f]) / len(by_share[f]) for f in shares]
        ax.plot([f * 100 for f in shares], means, marker="o", color=color, label=row,
                linestyle="-" if "(ours" in row else "-.")
        for f in shares:
            ax.plot([f * 100] * len(by_share[f]), by_share[f], ".", color=color, markersize=5)
        failed = sorted({f for (f, _kind) in s.unfinished.get(row, {}) if f is not None})
        if failed:  # each row its own height on the floor, so that rows failing at one share do not hide each other
            ax.plot([f * 100 for f in failed], [0.035 + 0.045 * level] * len(failed), marker="o", linestyle="none",
                    markersize=7, markerfacecolor="none", markeredgecolor=color, transform=floor, clip_on=False)
            level += 1
    for row, values in s.unlimited.items():
        mean = sum(values) / len(values)
        full = row.startswith(_FULL_LOAD)
        ax.axhline(mean, color="grey" if full else colors[engine(row)], linestyle="--", linewidth=1.2)
        ax.text(99, mean * 1.03, f"{row}: {mean:.2f} tok/s", ha="right", va="bottom", fontsize=7,
                color="dimgrey" if full else colors[engine(row)])
    _axes(ax, model, runs, s, level)


def _axes(ax, model: str, runs: Sequence[Run], s: _Series, floor_levels: int) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    gb = next((r.expert_bytes for r in runs if r.expert_bytes), None)
    ax.set_title(model + ("" if gb is None else f": {gb / 1e9:.2f} GB of experts"), fontsize=10)
    ax.set_yscale("log")
    values = [v for rows in s.finished.values() for vs in rows.values() for v in vs]
    values += [v for vs in s.unlimited.values() for v in vs]
    if values:  # the floor's open markers below the lowest value
        low, high = min(values), max(values)
        ax.set_ylim(low / (1.6 + floor_levels), high * 1.25)
    label = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.yaxis.set_major_formatter(label)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlim(0, 100)
    shares = sorted({f for rows in s.finished.values() for f in rows}
                    | {f for cells in s.unfinished.values() for (f, _k) in cells if f is not None})
    ax.set_xticks(sorted({0, 100} | {round(f * 100) for f in shares}))
    ax.set_xlabel("expert bytes in memory (% of all)")
    ax.set_ylabel("decode tok/s")
    ax.grid(alpha=0.3, which="both")
    extra = [Line2D([], [], color="grey", linestyle="--"), Line2D([], [], color="black", marker=".", linestyle="none"),
             Line2D([], [], color="black", marker="o", linestyle="none", markerfacecolor="none")]
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles + extra, labels + ["no limit (all in memory)", "each run (line: their mean)",
                                         "did not finish (on the floor)"], loc="lower right", fontsize=7)
    runs_line = f"{len(runs)} run{'s' if len(runs) > 1 else ''}: {', '.join(r.path.name for r in runs)}"
    ax.text(0, -0.16, runs_line + "\n" + _note(s), transform=ax.transAxes, ha="left", va="top", fontsize=7)


def _check_out(out: Path, force: bool) -> None:
    if out.suffix.lower() != ".png":
        raise MoeOffloadError(f"--out {out}: expected a .png file name")
    if out.exists() and not out.is_file():
        raise MoeOffloadError(f"--out {out} exists and is not a file")
    if out.exists() and not force:
        raise MoeOffloadError(f"--out {out} already exists; pass --force to overwrite it")


def share_figure(result_dirs: Sequence[Path | str], out: Path, *, force: bool = False) -> Path:
    """Draw decode tok/s against the share of expert bytes in memory for the ``bench disk`` folders
    ``result_dirs`` (each ``DIR`` or ``NAME=DIR``; module docstring: panels, lines, unfinished cells) into the PNG
    ``out`` (its folder made if needed; written whole or not at all) and return ``out``.

    Raises:
        MoeOffloadError: no folder given, a folder or its ``results.csv`` missing or malformed (``read_cells``),
            ``out`` not a ``.png`` name, or ``out`` existing without ``force`` (or existing and not a file).
    """
    out = Path(out)
    _check_out(out, force)
    if not result_dirs:
        raise MoeOffloadError("no `bench disk` folder given")
    runs = [read_run(d) for d in result_dirs]
    groups = panels(runs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    engines = list(dict.fromkeys(engine(c.row) for r in runs for c in r.cells if not c.row.startswith(_FULL_LOAD)))
    colors = {e: palette[i % len(palette)] for i, e in enumerate(engines)}
    fig, axes = plt.subplots(1, len(groups), figsize=(6.2 * len(groups), 4.8), squeeze=False)
    for ax, (model, group) in zip(axes[0], groups.items()):
        _draw_panel(ax, model, group, colors)
    fig.suptitle("Decode tok/s against the share of the expert bytes in memory (`bench disk`: each engine in a "
                 "memory cgroup of its baseline + the share)", fontsize=10)
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out
