"""The device tier's measurement for serving (``serve.memory``'s plan sizes the slot pool from it): the profile run of
the worst-shape request the server admits, and the CPU's allocation tracker.

Measurement: on CUDA, the caching allocator's *reserved* bytes (``torch.cuda.max_memory_reserved``: what the
allocator holds, fragmentation included, not only what tensors use) plus a measured workspace margin: device memory
the request took outside the allocator (cuBLAS / cuDNN workspaces, kernel images), from ``cudaMemGetInfo`` before
and after (``request_peak_bytes``). On the CPU,
where device and host tier share the same memory, ``DeviceTierTracker`` follows every tensor storage that an
operator allocates while generation runs (a ``TorchDispatchMode`` on the worker thread: an output whose storage is
none of the operator's inputs' is a new allocation; it stays counted until the storage is freed, checked through
a weak reference to the storage), and the static part is the bytes of the model's parameters and buffers, the
pool and the lookup table. Not seen on the CPU: scratch memory a kernel allocates internally without making a
tensor of it (e.g. a GEMM's packing buffers) and tensors made from Python data (``torch.tensor([...])``, a few
bytes of expert ids). Our native routed-experts kernel allocates outside the dispatcher too (its result and
scratch, which the tracker does not see): it counts the most one call took, and that is added to the tracker's
peak (an upper bound of what it held at the tracker's peak: one call runs at a time). Not counted either: the
results of the decode-step kernels in eager mode (``linear_rows`` at most 8 rows, ``decode_attention`` one query
per head), a few hundred KB at most, far below a prefill's peak.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import MoeOffloadError
from ..runtime.kernels import native


def _tensors(obj, out: list) -> list:
    """Tensors among ``obj`` (nested lists / tuples / dicts), appended to ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class DeviceTierTracker(TorchDispatchMode):
    """Live bytes of tensor storages allocated by operators while the mode is active (see the module docstring).

    Enter it (``with tracker:``) on the thread that runs generation; it may be entered many times, the live set
    persists between entries (a tensor kept from one request to the next stays counted).

    Args:
        device: only storages on this device are counted.

    Attributes:
        current_bytes: bytes of tracked storages alive at the last allocation check.
        peak_bytes: the largest ``current_bytes`` seen (bytes).
        allocations: storages allocated so far.
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0

    def _prune(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current_bytes -= self._live.pop(k)[1]

    def live_bytes(self) -> int:
        """Bytes of tracked storages alive now (prunes freed ones first)."""
        self._prune()
        return self.current_bytes

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak_bytes = self.live_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (list, tuple)):
            outs = _tensors(out, [])
        else:
            return out
        live = self._live
        inputs = None
        for t in outs:
            if t.device != self.device or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            key = st._cdata
            known = live.get(key)
            if known is not None and not known[0].expired():
                continue
            if inputs is None:
                inputs = {a.untyped_storage()._cdata for a in _tensors((args, kwargs), [])
                          if a.layout == torch.strided}
            if key in inputs:  # a view of an input, or an in-place / out= result: nothing new
                continue
            nbytes = st.nbytes()
            if known is not None:  # the address of a freed storage, reused
                self.current_bytes -= known[1]
            live[key] = (StorageWeakRef(st), nbytes)
            self.current_bytes += nbytes
            self.allocations += 1
            # current_bytes may still count freed storages (pruned lazily): prune before it can set a new peak
            if self.current_bytes > self.peak_bytes or len(live) > 4096:
                self._prune()
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


def storage_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct strided storages of ``tensors`` on ``device`` (a storage shared by several tensors, e.g.
    tied weights, once)."""
    seen, total = set(), 0
    for t in tensors:
        if t.device != device or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def cache_bytes(cache, device: torch.device) -> int:
    """Tensor bytes held by a transformers cache object (its ``layers``' tensors, or the legacy key/value lists)."""
    if cache is None:
        return 0
    tensors = []
    for layer in getattr(cache, "layers", None) or []:
        for v in vars(layer).values():
            _tensors(v, tensors)
    for name in ("key_cache", "value_cache"):
        if not getattr(cache, "layers", None) and hasattr(cache, name):
            _tensors(list(getattr(cache, name)), tensors)
    return storage_bytes(tensors, device)


def _profile_prompt(lm, length: int) -> list[int]:
    """``length`` token ids drawn (seed 0) from the vocabulary, the mask token excluded (diffusion models)."""
    vocab = int(lm.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (length,), generator=g)
    mask = getattr(lm.model.config, "mask_token_id", None)
    if mask is not None:
        ids[ids == int(mask)] = (int(mask) + 1) % vocab
    return ids.tolist()


@torch.no_grad()
def _profile_autoregressive(lm, max_context: int) -> int:
    """Prefill ``max_context - 1`` tokens and one sampled decode step; returns the KV cache bytes at the end."""
    import inspect

    from ..generation.sampling import pick

    cache_kw = "cache" if "cache" in inspect.signature(lm.model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([_profile_prompt(lm, max_context - 1)], dtype=torch.long, device=lm.device)
    eng = lm.engine
    if eng is not None:
        eng.begin_step(-1, 0)
    out = lm.model(input_ids=ids, use_cache=True)
    tok = pick(out.logits[:, -1], 1.0, 0.5, gen)
    past = out.get(cache_kw)
    del out
    if eng is not None:
        eng.begin_step(-1, 1)
    out = lm.model(input_ids=tok.view(1, 1), use_cache=True, **{cache_kw: past})
    past = out.get(cache_kw)
    pick(out.logits[:, -1], 1.0, 0.5, gen)
    return cache_bytes(past, lm.device)


def _profile_diffusion(lm, max_context: int, block_length: int) -> int:
    """One sampled diffusion step over ``max_context`` rounded up to whole blocks: its forward covers the whole
    context either way (with the block-prefix KV cache, the prompt's blocks are computed in that first step and
    their key/value buffers are part of the measured peak); returns 0 (no KV cache counted apart)."""
    from ..generation.diffusion import diffusion_generate_ids

    padded = -(-max_context // block_length) * block_length
    if lm.max_positions is not None:  # requests use whole blocks within the position limit (generate.token_budget)
        padded = max(block_length, min(padded, lm.max_positions // block_length * block_length))
    prompt = max(1, padded - block_length)
    diffusion_generate_ids(lm, _profile_prompt(lm, prompt), padded - prompt, block_length=block_length, steps=1,
                           threshold=1.0, temperature=1.0, top_p=0.5, seed=0, request=-1)
    return 0


@dataclass
class RequestProfile:
    """Measured device-tier bytes of the profile run: ``peak_bytes`` above the static part (KV cache +
    activations + workspace), ``kv_cache_bytes`` (the KV cache at ``max_context``; 0 for diffusion models)."""

    peak_bytes: int
    kv_cache_bytes: int

    @property
    def activation_bytes(self) -> int:
        """Peak bytes other than the KV cache (activations and workspace)."""
        return max(0, self.peak_bytes - self.kv_cache_bytes)


def request_peak_bytes(reserved_before: int, reserved_peak: int, reserved_after: int, free_before: int,
                       free_after: int) -> int:
    """A request's CUDA device-memory peak (bytes): the caching allocator's reserved peak above what it held
    before, plus the workspace margin — memory the device lost outside the allocator meanwhile, ``(free_before -
    free_after) - (reserved_after - reserved_before)``, at least 0 (cuBLAS workspaces, lazily loaded kernels)."""
    outside = (free_before - free_after) - (reserved_after - reserved_before)
    return max(0, reserved_peak - reserved_before) + max(0, outside)


def profile_request(lm, max_context: int, block_length: int | None = None) -> RequestProfile:
    """Run the worst-shape request the server admits (module docstring) and measure its device-tier peak.

    Args:
        lm: a loaded model (``models.loader.LoadedModel``).
        max_context: the server's maximum context (prompt + new tokens), >= 2 tokens.
        block_length: diffusion models: positions per block; None for autoregressive models.
    Returns:
        ``RequestProfile`` (bytes). The engine's counters are reset afterwards.
    Raises:
        MoeOffloadError: ``max_context < 2``; on CUDA, running out of device memory (the budget is too small).
    """
    if max_context < 2:
        raise MoeOffloadError(f"--max-context must be at least 2 tokens, got {max_context}")
    dev = lm.device
    gc.collect()
    try:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base, free_before = torch.cuda.memory_reserved(dev), torch.cuda.mem_get_info(dev)[0]
            torch.cuda.reset_peak_memory_stats(dev)
            kv = (_profile_diffusion(lm, max_context, block_length) if block_length
                  else _profile_autoregressive(lm, max_context))
            torch.cuda.synchronize(dev)
            peak = request_peak_bytes(base, torch.cuda.max_memory_reserved(dev), torch.cuda.memory_reserved(dev),
                                      free_before, torch.cuda.mem_get_info(dev)[0])
        else:
            tracker, kernels = DeviceTierTracker(dev), native()
            if kernels is not None:
                kernels.workspace_peak_bytes(True)
            with tracker:
                kv = (_profile_diffusion(lm, max_context, block_length) if block_length
                      else _profile_autoregressive(lm, max_context))
            peak = tracker.peak_bytes + (kernels.workspace_peak_bytes(True) if kernels is not None else 0)
    except torch.OutOfMemoryError:
        raise MoeOffloadError(f"out of device memory in the profile run at --max-context {max_context}: lower "
                              "--max-context or raise the budget") from None
    if lm.engine is not None:
        lm.engine.reset_stats()
    return RequestProfile(int(peak), int(kv))
