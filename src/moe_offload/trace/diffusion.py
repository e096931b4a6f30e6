"""Diffusion routing traces (DESIGN.md §7, TIDE): per request, per block, per diffusion step, per MoE layer, how many
tokens of the step's forward the router sent to each expert. One safetensors file: arrays + a JSON header, no
pickle.

A masked-diffusion LLM (LLaDA2.0) generates a block of ``block_length`` masked tokens by refining it over several
*diffusion steps*; each step is one forward of the model over the block and commits some tokens. With the
block-prefix KV cache (``generation.diffusion_forward``, the default) a forward covers the block, plus at a block's first
step the block committed just before (at a request's first step the prompt's complete blocks); without it, the whole
prefix. ``tokens`` records what each step's forward routed, so the simulator replays either loop as it ran. TIDE refreshes the device working set per block at intervals of steps, so the planner's input
is, per step and layer, a count vector over the layer's experts (``core.refresh``).

Arrays (one row per diffusion step, rows ordered by request, then block, then step):

==============  ========  ==============  ===============================================================
name            dtype     shape           meaning
==============  ========  ==============  ===============================================================
``counts``      uint16    ``[N, L, E]``   tokens of the step's forward routed to each expert of each MoE
                                          layer (each token selects ``top_k`` distinct experts, so a row of
                                          a layer sums to ``tokens * top_k`` and no entry exceeds ``tokens``)
``request``     int32     ``[N]``         request index (0..)
``block``       int32     ``[N]``         block index within the request (0.., non-decreasing)
``step``        int32     ``[N]``         diffusion step within the block: 0, 1, 2, ... consecutive
``tokens``      int32     ``[N]``         tokens of the step's forward (>= 1)
``committed``   int32     ``[N]``         tokens the step committed (unmasked); their sum is the generated
                                          length used for throughput (>= 0)
==============  ========  ==============  ===============================================================

Header (safetensors metadata key ``moe_offload_diffusion_trace``, JSON): ``format``, ``version``, ``model_id``,
``model_type``, ``num_moe_layers``, ``num_experts``, ``top_k``, ``block_length``, ``synthetic`` (true for generated
traces), ``source`` (free text), optional ``generator`` (the synthetic generator's parameters).

A collector from the runtime builds one with :meth:`DiffusionTrace.from_steps` from per-step ``[L, E]`` count
arrays. ``trace.diffusion_synthetic.synthetic_diffusion_trace`` generates one (see its docstring for the model and
its calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MoeOffloadError
from .format import HeaderGeometry, HookedRecorder, read_header_and_arrays, run_bounds, write_arrays_with_header

FORMAT = "moe-offload-diffusion-trace"
VERSION = 1
META_KEY = "moe_offload_diffusion_trace"
_ROW_ARRAYS = ("request", "block", "step", "tokens", "committed")


@dataclass
class DiffusionTrace(HeaderGeometry):
    """An in-memory diffusion routing trace; see the module docstring for the arrays (shapes, dtypes, meaning).

    Construct with :meth:`from_steps`, :func:`load_diffusion_trace` or
    ``trace.diffusion_synthetic.synthetic_diffusion_trace``; the constructor itself only stores the arrays (call
    :meth:`validate`).
    """

    header: dict
    counts: np.ndarray
    request: np.ndarray
    block: np.ndarray
    step: np.ndarray
    tokens: np.ndarray
    committed: np.ndarray
    _blocks: list | None = field(default=None, repr=False)

    # ---------------------------------------------------------------------------------------------- geometry


    @property
    def block_length(self) -> int:
        return int(self.header.get("block_length", 0))

    @property
    def num_steps(self) -> int:
        """Rows (diffusion steps) of the trace."""
        return int(self.counts.shape[0])

    @property
    def synthetic(self) -> bool:
        return bool(self.header.get("synthetic"))

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """``[(request, block, row_start, row_end)]`` in order; rows ``[row_start, row_end)`` are the block's steps
        0, 1, ... (validated traces only)."""
        if self._blocks is None:
            self._blocks = run_bounds(self.request, self.block)
        return self._blocks

    # ---------------------------------------------------------------------------------------------- building

    @classmethod
    def from_steps(cls, counts, block, step, request=None, tokens=None, committed=None, *, top_k: int,
                   model_id: str = "unknown", model_type: str = "unknown", block_length: int | None = None,
                   synthetic: bool = False, source: str = "", generator: dict | None = None) -> "DiffusionTrace":
        """Build and validate a trace from per-step count arrays (what a runtime collector records).

        Args:
            counts: sequence of N integer arrays ``[L, E]`` (or one array ``[N, L, E]``): tokens routed to each
                expert of each MoE layer in that step's forward.
            block, step: length-N block index and diffusion step within the block of each row.
            request: length-N request index (default all 0).
            tokens: length-N tokens per forward (default inferred: ``counts[n, 0].sum() / top_k``).
            committed: length-N tokens committed by each step (default 0 everywhere except the block's last step,
                which gets ``block_length``, or the block's tokens when ``block_length`` is None).
            top_k: experts per token.
            model_id, model_type, block_length, synthetic, source, generator: header fields.

        Returns:
            A validated DiffusionTrace.

        Raises:
            MoeOffloadError: inconsistent shapes or values (see :meth:`validate`), or counts that cannot be stored
                as uint16.
        """
        c = np.asarray(counts if not isinstance(counts, (list, tuple)) else
                       (np.stack([np.asarray(x) for x in counts]) if len(counts) else np.zeros((0, 0, 0))))
        if c.ndim != 3:
            raise MoeOffloadError(f"counts must be N arrays [layers, experts], got shape {c.shape}")
        if c.size and (c.min() < 0 or c.max() > np.iinfo(np.uint16).max):
            raise MoeOffloadError("counts must be integers in [0, 65535]")
        n, L, E = c.shape
        k = int(top_k)
        if k < 1:
            raise MoeOffloadError(f"top_k must be >= 1, got {top_k}")
        blk = np.asarray(block, dtype=np.int64)
        stp = np.asarray(step, dtype=np.int64)
        req = np.zeros(n, np.int64) if request is None else np.asarray(request, dtype=np.int64)
        if tokens is None:
            tok = c[:, 0, :].sum(axis=1) // k if L else np.zeros(n, np.int64)
        else:
            tok = np.asarray(tokens, dtype=np.int64)
        if committed is None:
            com = np.zeros(n, np.int64)
            if n:
                key = req * (1 << 32) + blk
                last = np.flatnonzero(np.append(np.diff(key) != 0, True))
                com[last] = block_length if block_length is not None else tok[last]
        else:
            com = np.asarray(committed, dtype=np.int64)
        header = {"format": FORMAT, "version": VERSION, "model_id": model_id, "model_type": model_type,
                  "num_moe_layers": L, "num_experts": E, "top_k": k,
                  "block_length": int(block_length) if block_length is not None else int(tok.max() if n else 0),
                  "synthetic": bool(synthetic), "source": source}
        if generator is not None:
            header["generator"] = generator
        tr = cls(header, c.astype(np.uint16), req.astype(np.int32), blk.astype(np.int32), stp.astype(np.int32),
                 tok.astype(np.int32), com.astype(np.int32))
        tr.validate()
        return tr

    # ---------------------------------------------------------------------------------------------- checks

    def validate(self, where: str = "trace") -> None:
        """Check shapes, dtypes-compatible values and ordering.

        Raises:
            MoeOffloadError: ``counts`` not ``[N, L, E]`` as the header says; a row array not of length N; an
                empty trace; tokens < 1 or committed < 0; a layer's counts not summing to ``tokens * top_k`` or an
                entry above ``tokens``; rows not ordered by (request, block) or steps of a block not 0, 1, 2, ...
        """
        h = self.header
        for key in ("num_moe_layers", "num_experts", "top_k"):
            if not isinstance(h.get(key), int) or h[key] < 1:
                raise MoeOffloadError(f"{where}: header field {key} must be a positive integer, got {h.get(key)!r}")
        L, E, k = self.num_moe_layers, self.num_experts, self.top_k
        if k > E:
            raise MoeOffloadError(f"{where}: top_k {k} exceeds num_experts {E}")
        c = self.counts
        if c.ndim != 3 or c.shape[1:] != (L, E):
            raise MoeOffloadError(f"{where}: counts of shape {c.shape}, header says [N, {L}, {E}]")
        n = c.shape[0]
        if n == 0:
            raise MoeOffloadError(f"{where}: the trace has no diffusion step")
        for name in _ROW_ARRAYS:
            a = getattr(self, name)
            if a.shape != (n,):
                raise MoeOffloadError(f"{where}: {name} of shape {a.shape}, expected ({n},)")
        tok = self.tokens.astype(np.int64)
        if tok.min() < 1:
            raise MoeOffloadError(f"{where}: tokens per step must be >= 1")
        if self.committed.min() < 0:
            raise MoeOffloadError(f"{where}: committed tokens must be >= 0")
        sums = c.sum(axis=2, dtype=np.int64)  # [N, L]
        bad = np.argwhere(sums != tok[:, None] * k)
        if len(bad):
            r, layer = bad[0]
            raise MoeOffloadError(f"{where}: row {r} layer {layer}: counts sum to {sums[r, layer]}, expected tokens x "
                                  f"top_k = {tok[r]} x {k}")
        over = np.argwhere(c.max(axis=2) > tok[:, None])
        if len(over):
            r, layer = over[0]
            raise MoeOffloadError(f"{where}: row {r} layer {layer}: an expert has more tokens than the forward "
                                  f"({tok[r]})")
        req, blk, stp = (self.request.astype(np.int64), self.block.astype(np.int64), self.step.astype(np.int64))
        if req.min() < 0 or blk.min() < 0 or stp.min() < 0:
            raise MoeOffloadError(f"{where}: request, block and step must be >= 0")
        key = req * (1 << 32) + blk
        dk = np.diff(key)
        if (dk < 0).any():
            raise MoeOffloadError(f"{where}: rows must be ordered by request, then block")
        new_block = np.concatenate([[True], dk != 0])
        expect = np.where(new_block, 0, np.concatenate([[0], stp[:-1] + 1]))
        if (stp != expect).any():
            r = int(np.flatnonzero(stp != expect)[0])
            raise MoeOffloadError(f"{where}: row {r}: diffusion step {stp[r]}, expected {expect[r]} (steps of a "
                                  "block are 0, 1, 2, ...)")

    # ---------------------------------------------------------------------------------------------- I/O

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the trace to ``path`` (safetensors; a new file unless ``overwrite``).

        Raises:
            MoeOffloadError: ``path`` exists and ``overwrite`` is False, or the trace is invalid.
        """
        self.validate()
        p = Path(path)
        if p.exists() and not overwrite:
            raise MoeOffloadError(f"{p} already exists; choose a new path")
        arrays = {"counts": self.counts.astype(np.uint16)}
        arrays.update({name: getattr(self, name).astype(np.int32) for name in _ROW_ARRAYS})
        return write_arrays_with_header(p, arrays, META_KEY, dict(self.header, format=FORMAT, version=VERSION))


def load_diffusion_trace(path: str | Path) -> DiffusionTrace:
    """Read and validate a trace written by :meth:`DiffusionTrace.save`.

    Raises:
        MoeOffloadError: missing, corrupt or truncated file, not a diffusion trace (e.g. an autoregressive routing
            trace), another format version, missing arrays, or contents failing :meth:`DiffusionTrace.validate`.
    """
    p = Path(path)
    header, arrays = read_header_and_arrays(p, META_KEY, "diffusion trace")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise MoeOffloadError(f"{p}: unsupported diffusion trace format {header.get('format')} v{header.get('version')}")
    missing = sorted({"counts", *_ROW_ARRAYS} - set(arrays))
    if missing:
        raise MoeOffloadError(f"{p}: diffusion trace lacks arrays {missing}")
    tr = DiffusionTrace(header, arrays["counts"], *(arrays[n] for n in _ROW_ARRAYS))
    tr.validate(str(p))
    return tr


# ------------------------------------------------------------------------------------------------ statistics


def stability_profile(trace: DiffusionTrace, budget: int, max_distance: int = 8) -> dict:
    """How stable the routing is within blocks: the measure TIDE's interval refresh relies on.

    For every pair of steps ``(r, r + d)`` of one block, with ``S_r`` = the ``budget`` experts with the most tokens
    at step ``r`` (ties: lower id), ``coverage(d)`` = token-experts of step ``r + d`` whose expert is in ``S_r``
    divided by all token-experts of step ``r + d`` (pooled over layers, blocks and requests). Also the Jaccard
    overlap of the active expert sets of consecutive steps and the mean active experts per layer and step.

    Args:
        trace: a diffusion trace.
        budget: experts per layer kept (``1 <= budget <= num_experts``).
        max_distance: largest ``d`` reported.

    Returns:
        dict: ``coverage`` (list of floats for d = 0..max_distance, None where no pair exists), ``jaccard_next``
        (mean over layers and consecutive steps), ``active_per_layer_step``, ``steps_per_block`` (mean),
        ``budget``.

    Raises:
        MoeOffloadError: a budget out of range.
    """
    E = trace.num_experts
    if not 1 <= budget <= E:
        raise MoeOffloadError(f"budget must be in [1, {E}], got {budget}")
    cov_num = np.zeros(max_distance + 1)
    cov_den = np.zeros(max_distance + 1)
    jac = []
    for _, _, a, b in trace.blocks():
        c = trace.counts[a:b].astype(np.float64)  # [s, L, E]
        order = np.lexsort((np.broadcast_to(np.arange(E), c.shape), -c), axis=-1)
        top = np.zeros(c.shape, dtype=bool)
        np.put_along_axis(top, order[..., :budget], True, axis=-1)
        top &= c > 0
        for d in range(min(max_distance, b - a - 1) + 1):
            cov_num[d] += (c[d:] * top[:b - a - d]).sum()
            cov_den[d] += c[d:].sum()
        act = c > 0
        if b - a > 1:
            inter = (act[1:] & act[:-1]).sum(-1)
            union = (act[1:] | act[:-1]).sum(-1)
            jac.append((inter / np.maximum(union, 1)).ravel())
    coverage = [float(n / d) if d else None for n, d in zip(cov_num, cov_den)]
    return {"budget": int(budget), "coverage": coverage,
            "jaccard_next": float(np.concatenate(jac).mean()) if jac else None,
            "active_per_layer_step": float((trace.counts > 0).sum(axis=-1).mean()),
            "steps_per_block": trace.num_steps / len(trace.blocks())}


# ------------------------------------------------------------------------------------------------ collection


class DiffusionTraceRecorder(HookedRecorder):
    """Records a diffusion trace while ``generation.diffusion.run_diffusion`` runs (pass it as ``recorder=``).

    A forward pre-hook on every experts module reads the ``top_k_index [T, k]`` it receives — the same routing for
    FullLoad and for every offloaded engine (they are lossless) — and counts tokens per expert; ``end_step`` closes
    one diffusion step's row ``[L, E]``. The block, step-in-block and committed tokens of every row come from the
    run's ``DiffusionResult``s (:meth:`trace`).

    Args:
        lm: a loaded diffusion model (``load_full`` or ``load_offloaded``).
        block_length: the run's block length (stored in the header).
        source: free text stored in the header.
    Call ``close()`` (or use it as a context manager) to remove the hooks.

    Raises:
        MoeOffloadError: a model without experts modules.
    """

    def __init__(self, lm, block_length: int, source: str = ""):
        from ..models.loader import experts_modules

        mods = experts_modules(lm.model)
        if not mods:
            raise MoeOffloadError("the model has no experts modules to record")
        self.lm, self.source, self.block_length = lm, source, int(block_length)
        self.L, self.E, self.k = len(mods), lm.num_experts, lm.top_k
        self._cur = np.zeros((self.L, self.E), np.int64)
        self._seen = np.zeros(self.L, bool)
        self._rows: list[np.ndarray] = []
        self._req: list[int] = []
        self._request = -1
        self._handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, (_, m) in enumerate(mods)]

    def _hook(self, layer: int):
        import torch

        def hook(module, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self._cur[layer] += torch.bincount(idx.reshape(-1).cpu(), minlength=self.E).numpy()
            self._seen[layer] = True
        return hook

    def start_request(self, index: int, prompt_ids: list[int]) -> None:
        """Request ``index`` begins (its prompt ids are not stored: diffusion traces hold counts only). Routing the
        hooks saw outside a recorded run (e.g. a warm-up request before it) is dropped."""
        self._request = index
        self._cur[:] = 0
        self._seen[:] = False

    def end_step(self, step: int) -> None:
        """A diffusion step's forward finished: its counts become one row.

        Raises:
            RuntimeError: some MoE layer did not report its routing.
        """
        if not self._seen.all():
            raise RuntimeError("a diffusion step finished without every MoE layer reporting its routing")
        self._rows.append(self._cur.copy())
        self._req.append(self._request)
        self._cur[:] = 0
        self._seen[:] = False

    def trace(self, results) -> DiffusionTrace:
        """The trace of the run whose ``DiffusionResult``s (one per request, in order) are ``results``.

        Raises:
            MoeOffloadError: the recorded steps do not match the results' steps.
        """
        block, step, committed = [], [], []
        for res in results:
            for b in res.blocks:
                for s, c in enumerate(b.committed):
                    block.append(b.index)
                    step.append(s)
                    committed.append(c)
        if len(block) != len(self._rows):
            raise MoeOffloadError(f"recorded {len(self._rows)} diffusion steps but the results hold {len(block)}")
        lm = self.lm
        return DiffusionTrace.from_steps(np.stack(self._rows) if self._rows else np.zeros((0, self.L, self.E)),
                                         block, step, request=self._req, committed=committed, top_k=self.k,
                                         model_id=lm.model_id, model_type=lm.arch.model_type,
                                         block_length=self.block_length, source=self.source)
