"""A benchmark model with real routing at a published expert width (issue 36): ``testbed-sparse-wide``.

testbed-sparse's routing is the most real routing this project has (routers fitted to a real model's activations,
DESIGN.md §"testbed"), but its experts are 48 neurons wide (324 KiB in float32), far from a published model's:
read sizes, the compute-to-read ratio and the experts per gigabyte are all unlike the real case. The widened
variant gives every expert Qwen3-30B-A3B's intermediate size (768) by appending **zero neurons**: rows of zeros in
the gate (``w1``) and up (``w3``) projections and columns of zeros in the down projection (``w2``). A zero neuron's
activation is ``silu(0) * 0 = 0`` and its down column adds ``0``, so the function is unchanged up to the summation
order of the GEMMs (the variant's own FullLoad is its reference, not testbed-sparse's). Everything is stored in
bfloat16, as published checkpoints are: 2.65 MB per expert (H = 576: 3 x 576 x 768 x 2 bytes; Qwen3-30B-A3B's
experts are 9.4 MB because its H is 2048), 2.55 GB of experts in all, in shards of at most ``SHARD_BYTES``.

What it is not: a trained model of that size. Its routing is testbed-sparse's (so are its hit rates), its compute
per expert is that of a 768-wide expert at H = 576, and its text is testbed-sparse's (not meaningful).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from ..errors import MoeOffloadError
from ..models.checkpoint import model_fingerprint

#: the widened intermediate size: Qwen3-30B-A3B's ``moe_intermediate_size``
WIDE_INTERMEDIATE = 768
#: largest shard of the widened checkpoint (bytes)
SHARD_BYTES = 1 << 30
_EXPERT_KEY = re.compile(r"\.experts\.\d+\.(w1|w2|w3)\.weight$")
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
           "special_tokens_map.json", "partition.pt")


def widen_expert(name: str, w: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """``w`` of tensor ``name`` with zero neurons appended up to ``intermediate_size``: ``w1``/``w3`` ``[I, H]`` ->
    ``[I', H]`` (zero rows), ``w2`` ``[H, I]`` -> ``[H, I']`` (zero columns); any other tensor unchanged.

    Raises:
        MoeOffloadError: ``intermediate_size`` is smaller than the expert's.
    """
    m = _EXPERT_KEY.search(name)
    if m is None:
        return w
    dim = 1 if m.group(1) == "w2" else 0
    extra = intermediate_size - w.shape[dim]
    if extra < 0:
        raise MoeOffloadError(f"{name} is {w.shape[dim]} neurons wide, more than the requested {intermediate_size}")
    pad = list(w.shape)
    pad[dim] = extra
    return torch.cat([w, w.new_zeros(pad)], dim=dim)


def widen_checkpoint(src: Path, dst: Path, intermediate_size: int = WIDE_INTERMEDIATE,
                     dtype: torch.dtype = torch.bfloat16, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``src`` (a Mixtral-layout checkpoint with per-expert ``w1``/``w2``/``w3`` keys) into the empty or new
    folder ``dst`` with every expert widened by zero neurons to ``intermediate_size`` (``widen_expert``) and every
    floating tensor cast to ``dtype``, in safetensors shards of at most ``shard_bytes`` with an index; tokenizer
    files are copied, ``config.json`` gets the new ``intermediate_size`` and ``dtype``, and ``testbed.json`` the
    source's model id as ``routing_model_id`` (the routers are the source's: its traces and predictors apply).

    Returns:
        ``dst``.
    Raises:
        MoeOffloadError: ``src`` is not a Mixtral-layout checkpoint, or a width below the experts'.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    source_config = dict(config)
    if config.get("model_type") != "mixtral":
        raise MoeOffloadError(f"{src}: widening needs a Mixtral-layout checkpoint (the testbed family), got "
                              f"model_type {config.get('model_type')!r}")
    files = sorted(src.glob("*.safetensors"))
    dst.mkdir(parents=True, exist_ok=True)
    plan = _plan_shards(files, intermediate_size, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    weight_map, total = {}, 0
    opened = {path: safe_open(path, "pt") for path in files}
    for i, keys in enumerate(plan):  # one shard in memory at a time
        tensors = {}
        for path, key in keys:
            t = widen_expert(key, opened[path].get_tensor(key), intermediate_size)
            tensors[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
        name = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        save_file(tensors, dst / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    opened.clear()
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    config |= {"intermediate_size": intermediate_size, "dtype": str(dtype).removeprefix("torch.")}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    info = json.loads((src / "testbed.json").read_text()) if (src / "testbed.json").is_file() else {}
    info |= {"widened_from": src.name, "expert_size": intermediate_size, "widening": "zero neurons appended "
             "(testbed/widen.py): the same function up to GEMM summation order", "dtype": config["dtype"],
             "routing_model_id": model_fingerprint(source_config)}
    (dst / "testbed.json").write_text(json.dumps(info, indent=2) + "\n")
    return dst


def _plan_shards(files: list[Path], intermediate_size: int, itemsize: int,
                 shard_bytes: int) -> list[list[tuple[Path, str]]]:
    """Shards of ``(file, key)`` of at most ``shard_bytes`` each after widening to ``intermediate_size`` and casting
    to ``itemsize`` bytes per element, planned from the headers (nothing loaded)."""
    from safetensors import safe_open

    plan: list[list[tuple[Path, str]]] = [[]]
    size = 0
    for path in files:
        with safe_open(path, "pt") as f:
            for key in f.keys():
                shape = list(f.get_slice(key).get_shape())
                m = _EXPERT_KEY.search(key)
                if m is not None:
                    shape[1 if m.group(1) == "w2" else 0] = intermediate_size
                nbytes = itemsize * math.prod(shape)
                if plan[-1] and size + nbytes > shard_bytes:
                    plan.append([])
                    size = 0
                plan[-1].append((path, key))
                size += nbytes
    return plan


def ensure_wide(progress: bool = True) -> Path:
    """The built-in ``testbed-sparse-wide`` checkpoint, built on first use from ``testbed-sparse`` (itself built
    first when missing) into the user cache (``cache.build_once``: locked, atomic).

    Raises:
        MoeOffloadError: as ``testbed.build.ensure_testbed``.
    """
    from ..common.cache import build_once, default_cache_dir
    from ..common.progress import say
    from .build import ensure_testbed

    src = ensure_testbed("testbed-sparse", progress=progress)

    def announce() -> None:
        say(f"first use of testbed-sparse-wide: widening testbed-sparse's experts to {WIDE_INTERMEDIATE} neurons "
            f"(zero neurons, bfloat16: about 2.6 GB) into {default_cache_dir() / 'testbed-sparse-wide'}; about a "
            "minute, once")

    return build_once("testbed-sparse-wide", lambda p: (p / "testbed.json").is_file()
                      and (p / "model.safetensors.index.json").is_file(),
                      lambda tmp: widen_checkpoint(src, tmp), what="the testbed-sparse-wide checkpoint",
                      announce=announce)
