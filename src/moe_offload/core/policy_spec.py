"""A policy, parsed once: ``--policy`` text -> a typed ``PolicySpec`` (its family, its parameters, what it needs).

Every command parses its policy names here (``parse_policy``, ``parse_policies``) at the edge; everything below
takes the spec and asks it, so each rule about policies is written once, as a property of the spec:

| family | kind | parameters | needs | prefetch scheduler | where |
|---|---|---|---|---|---|
| ``lru``, ``lfu``, ``prefill-hot`` | history | - | - | - | runtime, simulator |
| ``lfru`` | history | ``half_life`` H decode steps (``lfru-H``, default 8) | - | - | runtime, simulator |
| ``auto`` | auto | - | - | - | runtime (the best history policy on the first prompt's routing) |
| ``belady`` | oracle | ``window`` K decode steps (``belady-K``; none: the whole future) | the future | - | simulator |
| ``seqmoe-cacheonly`` | forecast | - | a predictor | - | runtime, simulator (SeqMoE §7.1) |
| ``seqmoe`` | forecast | - | a predictor | JSD (SeqMoE Algorithm 1) | runtime, simulator |
| ``seqmoe-infinity`` | forecast | - | a predictor | MoE-Infinity's order | runtime, simulator |
| ``xl`` | forecast | - | cross-layer forecasts | JSD | runtime, simulator |
| ``seqmoe-xl`` | forecast | - | a predictor, cross-layer forecasts | JSD | runtime, simulator |
| ``xl-oracle`` | forecast | - | cross-layer forecasts (replaced by the future) | JSD | simulator |
| ``seqmoe-oracle`` | forecast | - | a predictor (its forecasts replaced by the future) | JSD | simulator |
| ``reactive``, ``tide`` | refresh | - | a diffusion model | - | runtime, diffusion simulator (TIDE) |
| ``tide-fixed`` | refresh | ``interval`` T (``tide-fixed-T<n>``; none: the caller's) | a diffusion model | - | the same |

Forecast-driven policies evict by probabilistic Belady over their forecasts (SeqMoE §7.1, c = 8, lambda 0.5). A
prefetching policy written with ``+gate`` (``xl+gate``, ``seqmoe+gate``) queues only the prefetch tasks whose
expected saving exceeds their cost (``core.prefetch_cost``; the runtime measures both as it runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import MoeOffloadError

#: LFRU's default half-life in decode steps
LFRU_HALF_LIFE_STEPS = 8
#: family -> kind (see the module table)
KINDS = {"lru": "history", "lfu": "history", "lfru": "history", "prefill-hot": "history", "auto": "auto",
         "belady": "oracle", "seqmoe-cacheonly": "forecast", "seqmoe": "forecast", "seqmoe-infinity": "forecast",
         "xl": "forecast", "seqmoe-xl": "forecast", "seqmoe-oracle": "forecast", "xl-oracle": "forecast",
         "reactive": "refresh", "tide-fixed": "refresh", "tide": "refresh"}
#: forecast-driven family -> its prefetch scheduler (``core.prefetch.make_scheduler``); None: eviction only
PREFETCH = {"seqmoe-cacheonly": None, "seqmoe": "jsd", "seqmoe-infinity": "moe-infinity", "xl": "jsd",
            "seqmoe-xl": "jsd", "seqmoe-oracle": "jsd", "xl-oracle": "jsd"}
#: the families a trained predictor drives
PREDICTOR = ("seqmoe-cacheonly", "seqmoe", "seqmoe-infinity", "seqmoe-xl", "seqmoe-oracle")
#: the families fed cross-layer forecasts (the model's own routers on earlier layers' inputs)
CROSS_LAYER = ("xl", "seqmoe-xl", "xl-oracle")
#: the families only the simulator can run (they read the future)
SIMULATOR_ONLY = ("belady", "seqmoe-oracle", "xl-oracle")
#: the families whose forecasts the simulator replaces by the true future (``sim.forecasts.oracle_stream``): upper
#: bounds of what a better predictor (``seqmoe-oracle``) or better cross-layer forecasts (``xl-oracle``) could give
ORACLE = ("seqmoe-oracle", "xl-oracle")
#: the families graph mode runs as tensor ops (``runtime.graph.cache``)
GRAPH = ("lru", "lfu", "seqmoe-cacheonly", "seqmoe")
#: the written forms, for messages
CHOICES = ("auto, lru, lfu, lfru[-H], prefill-hot; with a predictor: seqmoe-cacheonly, seqmoe, seqmoe-infinity, "
           "seqmoe-xl; no predictor: xl; simulator only: belady[-K], seqmoe-oracle, xl-oracle; diffusion models: "
           "reactive, tide-fixed[-T<n>], tide; a prefetching policy+gate: only prefetches worth their cost")

_PARAM = re.compile(r"(lfru)-(\d+(?:\.\d+)?)|(belady)-(\d+)|(tide-fixed)-t(\d+)")


@dataclass(frozen=True)
class PolicySpec:
    """One policy: ``family`` (a key of ``KINDS``) and its parameter, if it has one.

    Attributes:
        family: the policy's family, lower case.
        half_life: ``lfru``'s half-life in decode steps (default ``LFRU_HALF_LIFE_STEPS``).
        window: ``belady``'s future window in decode steps (None: the whole future).
        interval: ``tide-fixed``'s refresh interval in diffusion steps (None: the caller's ``interval``).
    """

    family: str
    half_life: float | None = None
    window: int | None = None
    interval: int | None = None
    gated: bool = False

    @property
    def name(self) -> str:
        """The canonical written form (``parse_policy(spec.name) == spec``)."""
        if self.family == "lfru" and self.half_life is not None:
            return f"lfru-{self.half_life:g}"
        if self.family == "belady" and self.window is not None:
            return f"belady-{self.window}"
        if self.family == "tide-fixed" and self.interval is not None:
            return f"tide-fixed-T{self.interval}"
        return self.family + ("+gate" if self.gated else "")

    def __str__(self) -> str:
        return self.name

    @property
    def kind(self) -> str:
        """``history``, ``auto``, ``oracle``, ``forecast`` or ``refresh`` (the module table)."""
        return KINDS[self.family]

    @property
    def forecast_driven(self) -> bool:
        """Evicts by probabilistic Belady over forecasts (SeqMoE §7.1)."""
        return self.kind == "forecast"

    @property
    def prefetch(self) -> str | None:
        """The prefetch scheduler's name (``core.prefetch.make_scheduler``), or None: no prefetching."""
        return PREFETCH.get(self.family)

    @property
    def needs_predictor(self) -> bool:
        """A trained predictor drives it (``--predictor DIR``)."""
        return self.family in PREDICTOR

    @property
    def cross_layer(self) -> bool:
        """It is fed cross-layer forecasts (``predictor.cross_layer``; traces collected with ``--xl-forecasts``)."""
        return self.family in CROSS_LAYER

    @property
    def oracle(self) -> bool:
        """Its forecasts are the true future (``ORACLE``): the simulator's upper bound for its forecast family."""
        return self.family in ORACLE

    @property
    def simulator_only(self) -> bool:
        """Reads the future: the simulator runs it, the runtime cannot."""
        return self.family in SIMULATOR_ONLY

    @property
    def refresh(self) -> bool:
        """A diffusion refresh planner (TIDE, ``core.refresh``): for diffusion models only."""
        return self.kind == "refresh"

    @property
    def graph(self) -> bool:
        """Graph mode runs it (``generate --graph``; not gated: its prefetcher has no cost meter)."""
        return self.family in GRAPH and not self.gated

    @property
    def lfru_half_life(self) -> float:
        """``lfru``'s half-life in decode steps, its default filled in."""
        return LFRU_HALF_LIFE_STEPS if self.half_life is None else self.half_life


def parse_policy(text) -> PolicySpec:
    """``text`` (``lru``, ``lfru-4``, ``tide-fixed-T2``, ...; case-insensitive) as a ``PolicySpec``; a spec is
    returned as it is.

    Raises:
        MoeOffloadError: an unknown name or a malformed parameter (one line, naming the choices).
    """
    if isinstance(text, PolicySpec):
        return text
    key = str(text).strip().lower()
    if key.endswith("+gate"):
        base = parse_policy(key[:-len("+gate")])
        if base.prefetch is None:
            raise MoeOffloadError(f"{text!r}: +gate applies to policies that prefetch (seqmoe, seqmoe-infinity, xl, "
                                  "seqmoe-xl, seqmoe-oracle, xl-oracle)")
        return PolicySpec(base.family, gated=True)
    if key in KINDS:
        return PolicySpec(key)
    m = _PARAM.fullmatch(key)
    if m and m.group(1):
        return PolicySpec("lfru", half_life=float(m.group(2)))
    if m and m.group(3):
        return PolicySpec("belady", window=int(m.group(4)))
    if m and m.group(5):
        return PolicySpec("tide-fixed", interval=int(m.group(6)))
    if key.startswith("tide-fixed"):
        raise MoeOffloadError(f"unknown policy {text!r}; tide-fixed takes an interval as tide-fixed-T<n>")
    raise MoeOffloadError(f"unknown policy {text!r}; choose one of: {CHOICES}")


def parse_policies(text: str) -> list[PolicySpec]:
    """A comma-separated list of policies (``lru,lfu,seqmoe``), each ``parse_policy``'d, empty items skipped.

    Raises:
        MoeOffloadError: an unknown policy, or no policy at all.
    """
    specs = [parse_policy(p) for p in str(text).split(",") if p.strip()]
    if not specs:
        raise MoeOffloadError(f"no policy in {text!r}; choose from: {CHOICES}")
    return specs


def require_predictor(policies, predictor) -> None:
    """The one check that a predictor is given where a policy needs one (``PolicySpec.needs_predictor``).

    Args:
        policies: a ``PolicySpec`` or several.
        predictor: the predictor given (a directory, an object), or None.
    Raises:
        MoeOffloadError: some policy needs a predictor and none is given (one line naming the policies).
    """
    specs = [policies] if isinstance(policies, PolicySpec) else list(policies)
    wants = [s.name for s in specs if s.needs_predictor]
    if wants and not predictor:
        raise MoeOffloadError(f"--policy {','.join(wants)} needs --predictor DIR (a trained SeqMoE predictor drives "
                              f"{'it' if len(wants) == 1 else 'them'})")
