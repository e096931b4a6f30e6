"""Time models: turn a replay's per-step hit/miss counts into projected decode time (DESIGN.md §5 cost model, §6).

A time model is separate from the replay (``sim.simulator.replay`` only counts hits and misses) so it can be
replaced: this module's :class:`OnDemandTimeModel` charges the simplest SeqMoE-style cost,

* compute: every decode step runs all ``L`` MoE layers at FullLoad speed, ``t_layer = 1 / (full_load_tok_s * L)``
  (the whole decode step's time — attention, router, experts — is attributed evenly to the ``L`` MoE layers, so
  that a replay without misses reproduces the measured FullLoad decode speed, SeqMoE fig. 6);
* on-demand stalls: each miss copies one expert over the link with nothing overlapping it,
  ``t_load = expert_bytes / link_bandwidth`` (SeqMoE §1/§9.5: on-demand loading exposes memory I/O on the critical
  path).

Later models (prefetch overlap on the link, host fallback compute, predictor time) subclass it and override
:meth:`OnDemandTimeModel.step_seconds`, which maps one step's (profile-scale) hits and misses to compute and stall
seconds; everything else (projection between geometries, the summary) is shared.

Prefill (step 0) is excluded: decode tok/s is the paper's metric (SeqMoE §9.1 "Metrics"; prefill is reported as
TTFT and handled by a different offloading scheme, §8.4). ``decode_time`` reports how many prefill steps it
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MoeOffloadError
from ..core.profiles import HardwareProfile, ModelProfile, load_hardware, load_model_profile


@dataclass(frozen=True)
class Geometry:
    """Routing geometry of a trace or model: MoE layers, top-k, and (when known) experts per layer."""

    num_moe_layers: int
    top_k: int
    num_experts: int | None = None

    @property
    def accesses_per_step(self) -> int:
        """Expert accesses of a single-token step: ``num_moe_layers * top_k``."""
        return self.num_moe_layers * self.top_k

    def as_dict(self) -> dict:
        return {"num_moe_layers": self.num_moe_layers, "top_k": self.top_k, "num_experts": self.num_experts}


def as_geometry(g) -> Geometry:
    """Coerce a geometry: a :class:`Geometry`, a ``Trace`` / ``ModelProfile`` (anything with ``num_moe_layers``,
    ``top_k`` and optionally ``num_experts`` attributes), a dict with those keys, or a tuple ``(L, k[, E])``."""
    if isinstance(g, Geometry):
        return g
    if isinstance(g, dict):
        return Geometry(int(g["num_moe_layers"]), int(g["top_k"]),
                        None if g.get("num_experts") is None else int(g["num_experts"]))
    if isinstance(g, (tuple, list)):
        if len(g) not in (2, 3):
            raise MoeOffloadError(f"geometry tuple must be (layers, top_k[, experts]), got {g!r}")
        return Geometry(int(g[0]), int(g[1]), int(g[2]) if len(g) == 3 else None)
    if hasattr(g, "num_moe_layers") and hasattr(g, "top_k"):
        e = getattr(g, "num_experts", None)
        return Geometry(int(g.num_moe_layers), int(g.top_k), None if e is None else int(e))
    raise MoeOffloadError(f"cannot read a routing geometry from {type(g).__name__}")


class OnDemandTimeModel:
    """Compute at FullLoad speed plus a non-overlapped stall of ``expert_bytes / link`` per miss.

    Args:
        hardware: a HardwareProfile or its name (``profiles.load_hardware``).
        model: a ModelProfile or its name (``profiles.load_model_profile``).
        full_load_tok_s: FullLoad decode tokens/s to calibrate compute against; default the model profile's value
            for this hardware (SeqMoE fig. 6).

    Attributes:
        full_load_tok_s: tokens/s (float).
        t_layer_s: seconds of one MoE layer's share of a decode step, ``1 / (full_load_tok_s * L)``.
        t_load_s: seconds of one on-demand expert copy, ``expert_bytes / (link_gbps * 1e9)``.

    Raises:
        MoeOffloadError: no FullLoad speed for this model on this hardware and no override, or a non-positive one.
    """

    name = "on-demand"

    def __init__(self, hardware: HardwareProfile | str, model: ModelProfile | str,
                 full_load_tok_s: float | None = None):
        self.hardware = load_hardware(hardware) if isinstance(hardware, str) else hardware
        self.model = load_model_profile(model) if isinstance(model, str) else model
        if full_load_tok_s is None:
            full_load_tok_s = self.model.full_load_tok_s.get(self.hardware.name)
            if full_load_tok_s is None:
                have = ", ".join(sorted(self.model.full_load_tok_s)) or "none"
                raise MoeOffloadError(
                    f"model profile {self.model.name!r} has no FullLoad speed on {self.hardware.name!r} "
                    f"(it has: {have}); pass full_load_tok_s")
        if full_load_tok_s <= 0:
            raise MoeOffloadError(f"full_load_tok_s must be > 0, got {full_load_tok_s}")
        self.full_load_tok_s = float(full_load_tok_s)
        self.t_layer_s = 1.0 / (self.full_load_tok_s * self.model.num_moe_layers)
        self.t_load_s = self.model.expert_bytes / self.hardware.link_bytes_per_s

    @property
    def experts_per_layer_compute(self) -> float:
        """How many expert copies fit in one layer's compute time: ``t_layer_s / t_load_s`` (SeqMoE §2.2's 1.39)."""
        return self.t_layer_s / self.t_load_s

    # -------------------------------------------------------------------------------- the replaceable part

    def step_seconds(self, hits: np.ndarray, misses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Compute and stall seconds of each decode step, from profile-scale counts.

        Args:
            hits, misses: float64 ``[num_decode_steps]``, expert accesses per step already projected onto the model
                profile's geometry (they sum to ``L_p * k_p`` for a single-token step).

        Returns:
            ``(compute_s, stall_s)``, float64 ``[num_decode_steps]`` each, seconds. Here compute is
            ``L_p * t_layer_s`` per step and the stall is ``misses * t_load_s`` (no overlap). Subclasses override
            this to add prefetch overlap, host fallback, predictor time.
        """
        compute = np.full(len(misses), self.model.num_moe_layers * self.t_layer_s)
        return compute, misses * self.t_load_s

    # -------------------------------------------------------------------------------- shared

    def project(self, per_step, trace_geometry) -> tuple[np.ndarray, np.ndarray, str]:
        """Decode-step counts of a replay, on the model profile's geometry.

        Args:
            per_step: ``StepCounts`` (``request``, ``step``, ``hits``, ``misses`` arrays ``[num_steps]``).
            trace_geometry: geometry of the replayed trace (see :func:`as_geometry`).

        Returns:
            ``(hits, misses, projection)``: float64 arrays over the decode steps (``step > 0``) and ``"exact"`` when
            the trace's geometry equals the profile's (layers, top-k and, when the trace states it, experts), else
            ``"miss-rate"``: each step's miss fraction ``misses / (hits + misses)`` times the profile's accesses per
            step ``L_p * k_p`` (and hits the rest).
        """
        g = as_geometry(trace_geometry)
        decode = np.asarray(per_step.step) > 0
        hits = np.asarray(per_step.hits, dtype=np.float64)[decode]
        misses = np.asarray(per_step.misses, dtype=np.float64)[decode]
        m = self.model
        exact = (g.num_moe_layers == m.num_moe_layers and g.top_k == m.top_k
                 and (g.num_experts is None or g.num_experts == m.num_experts))
        if exact:
            return hits, misses, "exact"
        acc = hits + misses
        frac = np.divide(misses, acc, out=np.zeros_like(misses), where=acc > 0)
        per = float(m.accesses_per_step)
        return per - frac * per, frac * per, "miss-rate"

    def decode_time(self, per_step, trace_geometry) -> dict:
        """Projected decode speed of a replay (batch size 1, one token per decode step).

        Args:
            per_step: ``StepCounts`` of ``replay`` (step 0 = prefill, ignored; step i >= 1 = one decoded token).
            trace_geometry: the replayed trace's geometry (a Trace, dict, tuple, see :func:`as_geometry`).

        Returns:
            dict with ``time_model``, ``model``, ``hardware``, ``projection`` (``"exact"`` / ``"miss-rate"``),
            ``trace_geometry``, ``profile_geometry``, ``decode_steps``, ``prefill_steps_ignored``,
            ``full_load_tok_s``, ``t_layer_s``, ``t_load_s``, ``decode_miss_rate`` (trace counts),
            ``misses_per_step`` (mean, profile scale), ``compute_s``, ``stall_s``, ``decode_s`` (totals, seconds),
            ``stall_s_per_step`` (mean seconds), ``stall_s_steps`` (float64 ``[decode_steps]``),
            ``projected_tok_s`` (decode_steps / decode_s) and ``fraction_of_full_load``.

        Raises:
            MoeOffloadError: the counts contain no decode step.
        """
        steps = np.asarray(per_step.step)
        n = int((steps > 0).sum())
        if n == 0:
            raise MoeOffloadError("the replay has no decode steps (step > 0); nothing to project")
        hits, misses, projection = self.project(per_step, trace_geometry)
        compute, stall = self.step_seconds(hits, misses)
        compute_s, stall_s = float(compute.sum()), float(stall.sum())
        decode_s = compute_s + stall_s
        tok_s = n / decode_s
        decode = steps > 0
        raw_h = int(np.asarray(per_step.hits)[decode].sum())
        raw_m = int(np.asarray(per_step.misses)[decode].sum())
        return {
            "time_model": self.name,
            "model": self.model.name,
            "hardware": self.hardware.name,
            "projection": projection,
            "trace_geometry": as_geometry(trace_geometry).as_dict(),
            "profile_geometry": as_geometry(self.model).as_dict(),
            "decode_steps": n,
            "prefill_steps_ignored": int((steps == 0).sum()),
            "full_load_tok_s": self.full_load_tok_s,
            "t_layer_s": self.t_layer_s,
            "t_load_s": self.t_load_s,
            "decode_miss_rate": raw_m / (raw_h + raw_m) if raw_h + raw_m else 0.0,
            "misses_per_step": float(misses.mean()),
            "compute_s": compute_s,
            "stall_s": stall_s,
            "decode_s": decode_s,
            "stall_s_per_step": stall_s / n,
            "stall_s_steps": stall,
            "projected_tok_s": tok_s,
            "fraction_of_full_load": tok_s / self.full_load_tok_s,
        }


def calibration_check(model: str = "qwen3-30b-a3b-fp8", hardware: str = "rtx4090") -> dict:
    """Compare the profiles' implied compute/transfer ratio with SeqMoE §2.2's statement that on Qwen3-30B-FP8 with
    an RTX 4090 over PCIe 4.0 "one layer's computation overlaps the transfer of only 1.39 experts on average".

    Nothing is tuned: the check reports how far the FullLoad-calibrated layer time (fig. 6) and the link profile
    are from the paper's ratio, and which link bandwidth or layer time would reproduce it.

    Returns:
        dict: ``t_layer_us`` (1 / (tok/s * L), microseconds), ``t_load_us`` (expert_bytes / link), ``experts_per_layer``
        (their ratio), ``paper_experts_per_layer`` (1.39, or None if the profile has no paper value),
        ``ratio_to_paper``, ``implied_link_gbps`` (bandwidth giving the paper's ratio at this layer time),
        ``implied_layer_us`` and ``implied_full_load_tok_s`` (layer time / speed giving it at this link), ``note``.
    """
    tm = OnDemandTimeModel(hardware, model)
    paper = tm.model.paper_overlap_experts_per_layer.get(tm.hardware.name)
    ours = tm.experts_per_layer_compute
    out = {
        "model": tm.model.name, "hardware": tm.hardware.name, "full_load_tok_s": tm.full_load_tok_s,
        "expert_bytes": tm.model.expert_bytes, "link_gbps": tm.hardware.link_gbps,
        "t_layer_us": tm.t_layer_s * 1e6, "t_load_us": tm.t_load_s * 1e6, "experts_per_layer": ours,
        "paper_experts_per_layer": paper,
    }
    if paper is None:
        out["note"] = "no paper value recorded for this model and hardware"
        return out
    implied_link = paper * tm.model.expert_bytes / tm.t_layer_s / 1e9
    implied_layer = paper * tm.t_load_s
    out.update({
        "ratio_to_paper": ours / paper,
        "implied_link_gbps": implied_link,
        "implied_layer_us": implied_layer * 1e6,
        "implied_full_load_tok_s": 1.0 / (implied_layer * tm.model.num_moe_layers),
    })
    theo = tm.hardware.link_theoretical_gbps
    out["note"] = (
        f"FullLoad-calibrated layer time {out['t_layer_us']:.1f} us and a {tm.hardware.link_gbps:g} GB/s link give "
        f"{ours:.2f} experts per layer vs the paper's {paper}. Reproducing {paper} at this layer time needs "
        f"{implied_link:.1f} GB/s"
        + (f", above the link's theoretical {theo:g} GB/s" if theo and implied_link > theo else "")
        + f"; at this link it needs a {out['implied_layer_us']:.0f} us layer, i.e. a whole-model decode speed of "
        f"{out['implied_full_load_tok_s']:.1f} tok/s. Inference (not stated by the paper): the paper's ratio cannot "
        f"come from the {tm.full_load_tok_s:g} tok/s FullLoad layer time with this expert size over this link; it "
        "fits a slower per-layer compute such as an offloading runtime's. No number was tuned; the time model stays "
        "calibrated to FullLoad.")
    return out
