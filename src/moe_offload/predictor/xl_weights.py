"""The blend weights of ``seqmoe-xl`` (``predictor.blend``): the default ``XL_WEIGHTS``, and the calibrated ones
stored beside a predictor (``xl_weights.json``, written by ``predictor calibrate-xl``, ``predictor.xl_calibrate``)
that ``load_predictor`` reads into ``PredictorSet.xl_weights``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import MoeOffloadError

#: w_j, the cross-layer forecast's blend weight at layer distance j = 1, 2, 3, ... (the last one for larger
#: distances); measured on training prompts (docs/notes/benchmark-history.md, "Cross-layer forecasts (issue 21)")
XL_WEIGHTS = (0.3, 0.25, 0.2)
#: the file beside ``predictor.json`` holding the calibrated blend weights
XL_WEIGHTS_NAME = "xl_weights.json"


def check_xl_weights(weights, what: str = "--xl-weights") -> tuple[float, ...]:
    """``weights`` as a tuple of floats, each in ``[0, 1]`` (one per layer distance, at least one).

    Raises:
        MoeOffloadError: none, not numbers, or a weight outside ``[0, 1]``.
    """
    try:
        out = tuple(float(w) for w in weights)
    except (TypeError, ValueError):
        raise MoeOffloadError(f"{what} must be numbers, got {weights!r}") from None
    if not out:
        raise MoeOffloadError(f"{what} is empty")
    bad = [w for w in out if not (math.isfinite(w) and 0.0 <= w <= 1.0)]
    if bad:
        raise MoeOffloadError(f"{what} must be in [0, 1], got {bad[0]}")
    return out


def read_xl_weights(directory: str | Path) -> tuple[tuple[float, ...], str] | None:
    """The calibrated weights stored in a predictor ``directory`` (``XL_WEIGHTS_NAME``) and a note saying where they
    come from (the file; "fitted on synthetic traces" when they were), or None when there are none.

    Raises:
        MoeOffloadError: an unreadable or malformed file.
    """
    p = Path(directory) / XL_WEIGHTS_NAME
    if not p.exists():
        return None
    try:
        j = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeOffloadError(f"{p}: unreadable blend weights ({e})") from None
    if not isinstance(j, dict) or not isinstance(j.get("weights"), list):
        raise MoeOffloadError(f"{p}: malformed blend weights (needs a list \"weights\")")
    note = str(p) + (", fitted on synthetic traces" if j.get("synthetic") else "")
    return check_xl_weights(j["weights"], f"{p} \"weights\""), note


def describe_xl_weights(pset) -> str:
    """``"w1, w2, ... (where from)"``: the blend weights ``seqmoe-xl`` uses with ``pset`` (its calibrated ones, or
    ``XL_WEIGHTS`` "(default)"), for reports."""
    w = getattr(pset, "xl_weights", None)
    note = getattr(pset, "xl_weights_note", None) if w else "default"
    return ", ".join(f"{x:g}" for x in (w or XL_WEIGHTS)) + f" ({note or 'set by the caller'})"


def write_xl_weights(directory: str | Path, weights, record: dict, replace: bool = False) -> Path:
    """Store ``weights`` (and ``record``: how they were chosen) as ``directory/xl_weights.json``.

    Raises:
        MoeOffloadError: the file exists and ``replace`` is False (nothing is overwritten), or it cannot be written.
    """
    p = Path(directory) / XL_WEIGHTS_NAME
    if p.exists() and not replace:
        raise MoeOffloadError(f"{p} already exists; pass --replace to recalibrate (nothing was overwritten)")
    tmp = p.with_name(p.name + ".partial")
    try:
        tmp.write_text(json.dumps({"weights": list(check_xl_weights(weights))} | record, indent=1) + "\n")
        tmp.replace(p)
    except OSError as e:
        raise MoeOffloadError(f"cannot write {p}: {e.strerror or e}") from None
    return p
