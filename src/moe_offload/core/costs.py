"""TIDE cost model: the seconds a diffusion-step refresh planner trades against each other (DESIGN.md §5 "Cost
model"; TIDE "I/O-aware scheduling": "total_time = (num_intervals x swap_time) + (num_fallbacks x fallback_time)",
which "explicitly accounts for hardware characteristics — PCIe bandwidth, CPU vs GPU compute speed").

Units: bytes, seconds, GB/s = 10^9 bytes/s, FLOP/s. A *token-expert* is one (token, routed expert) pair of one MoE
layer's forward; an *active expert* is an expert with at least one token in that forward.

==========================  ===============================================================================
operation                   seconds
==========================  ===============================================================================
swap (one expert)           ``swap_s = expert_bytes / link_bytes_per_s`` (host->device copy; eviction is free:
                            the host store keeps every expert)
device compute, one expert  ``device_expert_s + tokens * device_token_s`` (weights read once from device memory,
                            then the tokens' FLOPs)
host fallback, one expert   ``fallback_expert_s + tokens * fallback_token_s`` (weights streamed from host memory
                            plus the call's fixed overhead, then the tokens' FLOPs on the CPU)
non-expert work, one step   ``nonexpert_step_s`` (attention, routers, shared experts, dense layers, LM head of one
                            diffusion step's forward)
==========================  ===============================================================================

Two ways to build one:

* :meth:`TideCosts.from_profiles` derives every number from a hardware profile and a model profile
  (``core.profiles``; the JSON files name the source of each input, or list it as unsourced). The derivations are
  written next to each field below; every efficiency factor and host-side rate is an assumption (listed in the
  profiles' ``unsourced``), so numbers built this way are modelled, not measured;
* :meth:`TideCosts.from_numbers` takes explicit numbers, e.g. the runtime's calibration on this machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..errors import MoeOffloadError

#: hardware profile keys the TIDE cost model reads (besides ``link_gbps``)
HW_KEYS = ("device_mem_bw_gbps", "device_bf16_tflops", "device_mem_efficiency", "device_compute_efficiency",
           "host_stream_gbps", "host_bf16_gflops", "host_call_overhead_us", "layer_overhead_us")
#: model profile keys the TIDE cost model reads (besides ``expert_bytes``, ``num_moe_layers``, ...)
MODEL_KEYS = ("num_layers", "nonexpert_params", "flops_per_token_expert", "flops_per_token_nonexpert",
              "block_length", "param_bytes")


@dataclass(frozen=True)
class TideCosts:
    """Costs of swaps, device compute, host fallback and non-expert work (see the module docstring).

    Attributes:
        expert_bytes: bytes of one routed expert (one swap copies this many bytes).
        swap_s: seconds of one expert's host->device copy.
        device_expert_s: device seconds per active expert (reading its weights), >= 0.
        device_token_s: device seconds per token-expert (its FLOPs), >= 0.
        fallback_expert_s: host seconds per active expert computed on the host (streaming its weights from host
            memory plus the fixed cost of one host call), >= 0.
        fallback_token_s: host seconds per token-expert computed on the host, >= 0.
        nonexpert_step_s: device seconds of one diffusion step's non-expert work, >= 0.
        num_moe_layers, num_experts, top_k: geometry (informative; 0 when unknown).
        overlap_host: True when host fallback runs concurrently with the device's expert compute of the same layer
            (a layer then costs ``max(device, host)``), as ``runtime.refresh_engine.RefreshEngine`` runs it by default
            (``runtime.host_fallback``; its calibrated costs and ``bench diffusion``'s say True); False (this
            dataclass's default, and ``simulate-diffusion`` without ``--overlap-host``) when it is serial, as in the
            TIDE authors' reference code (its per-expert loop computes CPU and GPU experts one after another).
        provenance: ``{field: how it was obtained}`` (profile derivations or "given").

    Raises:
        MoeOffloadError: (at construction) a negative number or a non-positive ``swap_s``.
    """

    expert_bytes: int
    swap_s: float
    device_expert_s: float = 0.0
    device_token_s: float = 0.0
    fallback_expert_s: float = 0.0
    fallback_token_s: float = 0.0
    nonexpert_step_s: float = 0.0
    num_moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    overlap_host: bool = False
    provenance: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.swap_s > 0:
            raise MoeOffloadError(f"swap_s must be > 0 seconds, got {self.swap_s}")
        for k in ("device_expert_s", "device_token_s", "fallback_expert_s", "fallback_token_s", "nonexpert_step_s"):
            v = getattr(self, k)
            if not v >= 0:
                raise MoeOffloadError(f"{k} must be >= 0 seconds, got {v}")
        if self.expert_bytes < 0:
            raise MoeOffloadError(f"expert_bytes must be >= 0, got {self.expert_bytes}")

    # ---------------------------------------------------------------------------------------------- operations

    def swap_time(self, n_experts: float) -> float:
        """Seconds to copy ``n_experts`` experts host->device, one after another on the link."""
        return float(n_experts) * self.swap_s

    def device_time(self, tokens: float, experts: float) -> float:
        """Device seconds to compute ``experts`` active experts holding ``tokens`` token-experts in total."""
        return float(experts) * self.device_expert_s + float(tokens) * self.device_token_s

    def fallback_time(self, tokens: float, experts: float) -> float:
        """Host seconds to compute ``experts`` missed experts holding ``tokens`` token-experts in total."""
        return float(experts) * self.fallback_expert_s + float(tokens) * self.fallback_token_s

    def layer_time(self, device_s: float, host_s: float) -> float:
        """Seconds of one MoE layer's expert work: ``max`` when host and device overlap, else their sum."""
        return max(device_s, host_s) if self.overlap_host else device_s + host_s

    def with_overrides(self, **kw) -> "TideCosts":
        """A copy with some fields replaced (their provenance becomes "given")."""
        prov = dict(self.provenance)
        prov.update({k: "given" for k in kw})
        return replace(self, provenance=prov, **kw)

    def as_dict(self) -> dict:
        """All fields as a JSON-serialisable dict."""
        return asdict(self)

    # ---------------------------------------------------------------------------------------------- builders

    @classmethod
    def from_numbers(cls, expert_bytes: int, *, swap_s: float | None = None, link_gbps: float | None = None,
                     fallback_token_s: float = 0.0, fallback_expert_s: float = 0.0, device_token_s: float = 0.0,
                     device_expert_s: float = 0.0, nonexpert_step_s: float = 0.0, num_moe_layers: int = 0,
                     num_experts: int = 0, top_k: int = 0, overlap_host: bool = False) -> "TideCosts":
        """Costs from explicit numbers (e.g. measured by the runtime on this machine).

        Args:
            expert_bytes: bytes of one expert.
            swap_s: seconds of one expert swap; or give ``link_gbps`` (GB/s) and it is ``expert_bytes / link``.
            fallback_token_s, fallback_expert_s: host seconds per token-expert and per missed expert.
            device_token_s, device_expert_s: device seconds per token-expert and per active expert.
            nonexpert_step_s: seconds of one step's non-expert work.
            num_moe_layers, num_experts, top_k, overlap_host: see the class attributes.

        Raises:
            MoeOffloadError: neither or both of ``swap_s`` and ``link_gbps``, a non-positive link or swap time,
                a negative cost.
        """
        if (swap_s is None) == (link_gbps is None):
            raise MoeOffloadError("give exactly one of swap_s (seconds per expert) and link_gbps (GB/s)")
        if swap_s is None:
            if not link_gbps > 0:
                raise MoeOffloadError(f"link_gbps must be > 0, got {link_gbps}")
            swap_s = expert_bytes / (link_gbps * 1e9)
        return cls(expert_bytes=int(expert_bytes), swap_s=float(swap_s), device_expert_s=float(device_expert_s),
                   device_token_s=float(device_token_s), fallback_expert_s=float(fallback_expert_s),
                   fallback_token_s=float(fallback_token_s), nonexpert_step_s=float(nonexpert_step_s),
                   num_moe_layers=int(num_moe_layers), num_experts=int(num_experts), top_k=int(top_k),
                   overlap_host=bool(overlap_host), provenance={"all": "given"})

    @classmethod
    def from_profiles(cls, hardware, model, tokens_per_step: int | None = None, overlap_host: bool = False,
                      **overrides) -> "TideCosts":
        """Costs derived from a hardware profile and a model profile (names or loaded profiles).

        Derivations (``hw.x`` = hardware profile key, ``m.x`` = model profile key; missing keys raise):

        * ``swap_s = m.expert_bytes / (hw.link_gbps * 1e9)``;
        * ``device_expert_s = m.expert_bytes / (hw.device_mem_bw_gbps * 1e9 * hw.device_mem_efficiency)``;
        * ``device_token_s = m.flops_per_token_expert / (hw.device_bf16_tflops * 1e12 *
          hw.device_compute_efficiency)``;
        * ``fallback_expert_s = m.expert_bytes / (hw.host_stream_gbps * 1e9) + hw.host_call_overhead_us * 1e-6``;
        * ``fallback_token_s = m.flops_per_token_expert / (hw.host_bf16_gflops * 1e9)``;
        * ``nonexpert_step_s = max(m.nonexpert_params * m.param_bytes / device bandwidth, tokens_per_step *
          m.flops_per_token_nonexpert / device FLOP rate) + m.num_layers * hw.layer_overhead_us * 1e-6`` (a roofline
          of one forward of ``tokens_per_step`` tokens — default ``m.block_length`` — over the non-expert weights,
          plus a per-layer launch overhead; attention over the cached prefix is not modelled).

        Args:
            hardware: a ``HardwareProfile`` or its name (``core.profiles.load_hardware``).
            model: a ``ModelProfile`` or its name (``core.profiles.load_model_profile``).
            tokens_per_step: tokens of one diffusion step's forward (default the model profile's block_length).
            overlap_host: see the class attributes.
            **overrides: any field to replace after the derivation (recorded as "given").

        Raises:
            MoeOffloadError: a profile lacks a key listed in ``HW_KEYS`` / ``MODEL_KEYS`` (the message names it), or
                a derived number is invalid.
        """
        from .profiles import load_hardware, load_model_profile

        hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
        m = load_model_profile(model) if isinstance(model, str) else model
        get = _profile_number
        bw = get(hw, "device_mem_bw_gbps", "hardware") * 1e9 * get(hw, "device_mem_efficiency", "hardware")
        rate = get(hw, "device_bf16_tflops", "hardware") * 1e12 * get(hw, "device_compute_efficiency", "hardware")
        f_tok = get(m, "flops_per_token_expert", "model")
        tokens = float(tokens_per_step if tokens_per_step is not None else get(m, "block_length", "model"))
        nonexp_bytes = get(m, "nonexpert_params", "model") * get(m, "param_bytes", "model")
        nonexp = (max(nonexp_bytes / bw, tokens * get(m, "flops_per_token_nonexpert", "model") / rate)
                  + get(m, "num_layers", "model") * get(hw, "layer_overhead_us", "hardware") * 1e-6)
        out = cls(
            expert_bytes=m.expert_bytes,
            swap_s=m.expert_bytes / hw.link_bytes_per_s,
            device_expert_s=m.expert_bytes / bw,
            device_token_s=f_tok / rate,
            fallback_expert_s=(m.expert_bytes / (get(hw, "host_stream_gbps", "hardware") * 1e9)
                               + get(hw, "host_call_overhead_us", "hardware") * 1e-6),
            fallback_token_s=f_tok / (get(hw, "host_bf16_gflops", "hardware") * 1e9),
            nonexpert_step_s=nonexp,
            num_moe_layers=m.num_moe_layers, num_experts=m.num_experts, top_k=m.top_k, overlap_host=overlap_host,
            provenance=_profile_provenance(hw.name, m.name, tokens))
        return out.with_overrides(**overrides) if overrides else out


def _profile_number(obj, key: str, kind: str) -> float:
    """Profile ``obj``'s ``key`` (an attribute, else an entry of its ``extra``) as a float.

    Raises:
        MoeOffloadError: the ``kind`` ("hardware" or "model") profile lacks it (the message names it).
    """
    v = getattr(obj, key, None)
    if v is None:
        v = obj.extra.get(key)
    if v is None:
        raise MoeOffloadError(f"{kind} profile {obj.name!r} lacks {key!r}, needed by the TIDE cost model")
    return float(v)


def _profile_provenance(hw: str, m: str, tokens: float) -> dict[str, str]:
    """``TideCosts.provenance`` of ``TideCosts.from_profiles`` for hardware profile ``hw`` and model profile ``m``."""
    return {
        "swap_s": f"{m}.expert_bytes / {hw}.link_gbps",
        "device_expert_s": f"{m}.expert_bytes / ({hw}.device_mem_bw_gbps x device_mem_efficiency)",
        "device_token_s": f"{m}.flops_per_token_expert / ({hw}.device_bf16_tflops x device_compute_efficiency)",
        "fallback_expert_s": f"{m}.expert_bytes / {hw}.host_stream_gbps + host_call_overhead_us",
        "fallback_token_s": f"{m}.flops_per_token_expert / {hw}.host_bf16_gflops",
        "nonexpert_step_s": f"roofline of {tokens:g} tokens over {m}.nonexpert_params on {hw} + "
                            "num_layers x layer_overhead_us",
        "note": "modelled from profiles; efficiencies and host rates are assumptions (profiles' unsourced)",
    }
