"""Hardware and model profiles for the cost model (DESIGN.md §5 "Cost model", §6; SeqMoE §9.1, Table 1, fig. 6).

Profiles are JSON data files shipped in ``moe_offload/data/profiles/{hardware,models}/<name>.json``. Every number
in them has an entry in ``sources`` (paper section / figure / spec sheet / config it comes from, or the arithmetic
it is derived by) or is listed in ``unsourced`` with a ``note`` saying what was assumed.

One hardware profile is not shipped: ``this-machine``, in ``<cache>/hardware/this-machine.json`` (cache =
``$MOE_OFFLOAD_CACHE`` or ``~/.cache/moe-offload``). Its sections are measured by different commands and each
merges only its own (issue 48): the host->device link (``bench link``: ``bench.link.measure_link``) and the disk
(``bench link --disk``: ``core.disk_link.save_disk``). A command that needs a section the file lacks says which
command measures it; one that does not need it never reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import MoeOffloadError

THIS_MACHINE = "this-machine"

_HW_FIELDS = ("name", "device_memory_gb", "link", "link_gbps")
_MODEL_FIELDS = ("name", "num_moe_layers", "num_experts", "top_k", "expert_bytes")


@dataclass(frozen=True)
class HardwareProfile:
    """One platform: device memory and the host->device link (SeqMoE §9.1 "Hardware").

    Attributes:
        name: profile name (file stem), e.g. ``"rtx4090"``.
        device_memory_gb: device memory in GB (10^9 bytes, as the spec sheets count).
        link: the host->device link in words, e.g. ``"PCIe 4.0 x16"``.
        link_gbps: effective host->device copy bandwidth for large pinned copies, GB/s (10^9 bytes per second).
        link_theoretical_gbps: the link's per-direction theoretical bandwidth, GB/s (None when measured).
        link_efficiency: ``link_gbps / link_theoretical_gbps`` as assumed (None when measured).
        sources: ``{field: where the number comes from}``.
        unsourced: fields whose values are assumptions (explained in ``note``).
        note: free text.
        extra: any other keys of the JSON file (kept for later cost-model fields).
    """

    name: str
    device_memory_gb: float
    link: str
    link_gbps: float
    link_theoretical_gbps: float | None = None
    link_efficiency: float | None = None
    description: str = ""
    sources: dict = field(default_factory=dict)
    unsourced: tuple = ()
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def link_bytes_per_s(self) -> float:
        """Effective host->device bandwidth in bytes per second."""
        return self.link_gbps * 1e9


@dataclass(frozen=True)
class ModelProfile:
    """One MoE model's offloading geometry (SeqMoE Table 1) and its measured FullLoad speeds (SeqMoE fig. 6).

    Attributes:
        name: profile name (file stem), e.g. ``"qwen3-30b-a3b-fp8"``.
        num_moe_layers: L, MoE layers (layers whose routed experts are offloaded).
        num_experts: routed experts per MoE layer (shared experts excluded: they stay on the device).
        top_k: experts each token selects per MoE layer.
        expert_bytes: bytes of one routed expert as stored (payload + quantisation scales + biases): the size of
            one host->device copy.
        full_load_tok_s: ``{hardware_name: decode tokens/s with every weight on the device}``, batch size 1
            (SeqMoE fig. 6 first row, decode length 128-1024). May be empty (then the time model needs an override).
        full_load_tok_s_long_decode: same for decode length 4096-8192 (fig. 6 second row), where known.
        paper_overlap_experts_per_layer: ``{hardware_name: experts whose transfer one layer's compute overlaps}``
            as stated by a paper (SeqMoE §2.2), recorded for calibration checks only.
        hidden_size, moe_intermediate_size, expert_dtype, model_type, description: descriptive fields.
        sources, unsourced, note: provenance, as for HardwareProfile.
        extra: any other keys of the JSON file.
    """

    name: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    full_load_tok_s: dict = field(default_factory=dict)
    full_load_tok_s_long_decode: dict = field(default_factory=dict)
    paper_overlap_experts_per_layer: dict = field(default_factory=dict)
    hidden_size: int | None = None
    moe_intermediate_size: int | None = None
    expert_dtype: str = ""
    model_type: str = ""
    description: str = ""
    sources: dict = field(default_factory=dict)
    unsourced: tuple = ()
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def accesses_per_step(self) -> int:
        """Expert accesses of one single-token decode step: ``num_moe_layers * top_k``."""
        return self.num_moe_layers * self.top_k

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of the model: ``num_moe_layers * num_experts * expert_bytes``."""
        return self.num_moe_layers * self.num_experts * self.expert_bytes


# ------------------------------------------------------------------------------------------------ locations


def cache_dir() -> Path:
    """The user cache: ``$MOE_OFFLOAD_CACHE`` if set, else ``~/.cache/moe-offload``."""
    from ..common.cache import default_cache_dir

    return default_cache_dir()


def this_machine_path() -> Path:
    """Where ``bench.link.measure_link`` writes, and ``load_hardware("this-machine")`` reads, the measured profile."""
    return cache_dir() / "hardware" / f"{THIS_MACHINE}.json"


def _data_dir(kind: str):
    return resources.files("moe_offload").joinpath("data", "profiles", kind)


def _shipped(kind: str) -> list[str]:
    d = _data_dir(kind)
    if not d.is_dir():
        return []
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


def this_machine_has_link() -> bool:
    """Whether the this-machine profile holds ``bench link``'s host->device link section (a file with only ``bench
    link --disk``'s section does not)."""
    try:
        data = json.loads(this_machine_path().read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(k in data for k in _HW_FIELDS)


def merge_this_machine(section: dict, source: str | None = None) -> Path:
    """Write ``section``'s keys into the this-machine profile, keeping every other key (another command's section:
    the link's fields, ``disk``) and their ``sources``; a profile that does not exist starts as ``{"name":
    "this-machine"}``. Written to a temporary file and moved into place, so a reader never sees half a file.

    Args:
        section: the keys this command measured (e.g. ``{"disk": {...}}``, or the link's fields).
        source: a ``sources`` entry for each of ``section``'s keys (None: the section brings its own ``sources``).
    Returns:
        The profile's path.
    """
    path = this_machine_path()
    try:
        profile = json.loads(path.read_text())
        if not isinstance(profile, dict):
            profile = {}
    except (OSError, ValueError):
        profile = {}
    profile.setdefault("name", THIS_MACHINE)
    sources = {**profile.get("sources", {}), **section.get("sources", {})}
    profile.update({k: v for k, v in section.items() if k != "sources"})
    if source is not None:
        sources.update(dict.fromkeys((k for k in section if k != "sources"), source))
    profile["sources"] = sources
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    tmp.replace(path)
    return path


def list_hardware() -> list[str]:
    """Names accepted by :func:`load_hardware`: the shipped profiles plus ``"this-machine"`` (measured)."""
    return _shipped("hardware") + [THIS_MACHINE]


def list_models() -> list[str]:
    """Names accepted by :func:`load_model_profile` (the shipped model profiles)."""
    return _shipped("models")


def _read_json(path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MoeOffloadError(f"cannot read {what} profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise MoeOffloadError(f"{what} profile {path} is not a JSON object")
    return data


def _split(data: dict, cls, required: tuple, path) -> dict:
    missing = [k for k in required if k not in data]
    if missing:
        raise MoeOffloadError(f"profile {path} lacks fields {missing}")
    known = set(cls.__dataclass_fields__) - {"extra"}
    kw = {k: v for k, v in data.items() if k in known}
    kw["extra"] = {k: v for k, v in data.items() if k not in known}
    if "unsourced" in kw:
        kw["unsourced"] = tuple(kw["unsourced"])
    return kw


# ------------------------------------------------------------------------------------------------ loading


def load_hardware(name: str) -> HardwareProfile:
    """Load a hardware profile by name (see :func:`list_hardware`).

    ``"this-machine"`` reads the file ``bench.link.measure_link`` wrote into the user cache.

    Raises:
        MoeOffloadError: unknown name (the message lists the known ones), a missing this-machine measurement
            ("run `moe-offload bench link` first"), or an unreadable / incomplete file.
    """
    if name == THIS_MACHINE:
        path = this_machine_path()
        if not path.is_file():
            raise MoeOffloadError(f"no measured profile for this machine at {path}: run `moe-offload bench link` first")
        data = _read_json(path, "hardware")
        if not all(k in data for k in _HW_FIELDS[1:]):
            has = ", ".join(k for k in data if k not in ("name", "sources")) or "nothing"
            raise MoeOffloadError(f"the this-machine profile at {path} holds no host->device link measurement (it has: "
                                  f"{has}): run `moe-offload bench link` first")
    else:
        known = _shipped("hardware")
        if name not in known:
            raise MoeOffloadError(f"unknown hardware profile {name!r}; known: {', '.join(known + [THIS_MACHINE])}")
        path = _data_dir("hardware").joinpath(f"{name}.json")
        data = _read_json(path, "hardware")
    kw = _split(data, HardwareProfile, _HW_FIELDS, path)
    kw["device_memory_gb"] = float(kw["device_memory_gb"])
    kw["link_gbps"] = float(kw["link_gbps"])
    if kw["link_gbps"] <= 0:
        raise MoeOffloadError(f"hardware profile {path}: link_gbps must be > 0, got {kw['link_gbps']}")
    return HardwareProfile(**kw)


def load_model_profile(name: str) -> ModelProfile:
    """Load a model profile by name (see :func:`list_models`).

    Raises:
        MoeOffloadError: unknown name (the message lists the known ones) or an unreadable / incomplete file.
    """
    known = _shipped("models")
    if name not in known:
        raise MoeOffloadError(f"unknown model profile {name!r}; known: {', '.join(known)}")
    path = _data_dir("models").joinpath(f"{name}.json")
    kw = _split(_read_json(path, "model"), ModelProfile, _MODEL_FIELDS, path)
    for k in ("num_moe_layers", "num_experts", "top_k", "expert_bytes"):
        kw[k] = int(kw[k])
    return ModelProfile(**kw)


def model_profile_for(num_moe_layers: int, num_experts: int, top_k: int, model_type: str | None = None) -> str | None:
    """The shipped model profile with this routing geometry (and, when given, this ``model_type``), or None when
    there is not exactly one."""
    found = []
    for name in list_models():
        mp = load_model_profile(name)
        if (mp.num_moe_layers, mp.num_experts, mp.top_k) != (num_moe_layers, num_experts, top_k):
            continue
        if model_type and mp.model_type and mp.model_type != model_type:
            continue
        found.append(name)
    return found[0] if len(found) == 1 else None


def default_hardware(model: ModelProfile) -> tuple[str, str]:
    """The hardware profile to use with ``model`` when none is named, and why: a platform the model profile has a
    measured FullLoad speed on (rtx4090 first), else the measured ``this-machine`` profile if ``bench link`` wrote
    its link section (``bench link --disk`` alone does not), else rtx4090."""
    if model.full_load_tok_s:
        name = "rtx4090" if "rtx4090" in model.full_load_tok_s else sorted(model.full_load_tok_s)[0]
        return name, f"{model.name} has a measured FullLoad speed on it"
    if this_machine_has_link():
        return THIS_MACHINE, f"{model.name} runs on this machine; measured by `moe-offload bench link`"
    return "rtx4090", "default; `moe-offload bench link` would measure this machine"
