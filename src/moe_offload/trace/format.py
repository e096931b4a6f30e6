"""Routing trace format (DESIGN.md §7): one safetensors file, arrays + a JSON header, no pickle.

Arrays (one row per token position the model processed, requests in order, each request's prompt tokens first):

| name | dtype | shape | meaning |
|---|---|---|---|
| ``expert_ids`` | int16 | ``[N, L, k]`` | experts the router selected for that token in each MoE layer |
| ``expert_weights`` | float16 | ``[N, L, k]`` | their routing weights (what multiplies the expert outputs) |
| ``request`` | int32 | ``[N]`` | request index |
| ``step`` | int32 | ``[N]`` | 0 for the prompt's tokens (prefill), i >= 1 for the i-th decode step |
| ``prompt_ids`` | int32 | ``[sum of prompt lengths]`` | the prompts' token ids, requests concatenated (tokenizer-free) |
| ``router_probs`` | float16 | ``[N, L, E]`` | optional: softmax of the router logits (``--router-probs``) |
| ``xl_probs`` | float32 | ``[D, L, d, E]`` | optional (``--xl-forecasts``): per decode row (the D rows with step >= 1, in order), per MoE layer l, the cross-layer forecast of layer ``l + 1 + j`` (``runtime.cross_layer``; zeros past the last layer) |

One *step* is one forward pass: the prefill of a request (all its prompt tokens, one layer execution per MoE
layer) or one decode token. The runtime and the simulator process a trace step by step and, inside a step,
MoE layer by MoE layer.

Header (safetensors metadata key ``moe_offload_trace``, JSON):
``format``, ``version``, ``model_id`` (fingerprint of the model's config.json, see ``models.checkpoint.model_fingerprint``),
``model_type``, ``num_moe_layers``, ``num_experts``, ``top_k``, ``synthetic`` (true for generated traces),
``router_probs`` (bool), ``xl_depth`` (d of ``xl_probs``, 0 without), ``requests`` (``[{"prompt_tokens": P, "decode_steps": D}]``), ``source`` (free text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MoeOffloadError

FORMAT = "moe-offload-trace"
VERSION = 1
META_KEY = "moe_offload_trace"


class HeaderGeometry:
    """The model geometry every trace header carries (``num_moe_layers``, ``num_experts``, ``top_k``)."""

    header: dict

    @property
    def num_moe_layers(self) -> int:
        return int(self.header["num_moe_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.header["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.header["top_k"])


class HookedRecorder:
    """Base of the trace recorders: holds the torch hook handles in ``_handles``; ``close()`` (or leaving the
    ``with`` block) removes them."""

    _handles: list

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_bounds(major: np.ndarray, minor: np.ndarray) -> list[tuple[int, int, int, int]]:
    """``[(major, minor, row_start, row_end)]`` of the runs of consecutive rows with equal ``(major, minor)``
    (int arrays ``[N]``, e.g. request and step), in row order."""
    key = major.astype(np.int64) * (1 << 32) + minor.astype(np.int64)
    change = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], change]).astype(np.int64)
    ends = np.concatenate([change, [len(key)]]).astype(np.int64)
    return [(int(major[s]), int(minor[s]), int(s), int(e)) for s, e in zip(starts, ends) if e > s]


def write_arrays_with_header(p: Path, arrays: dict, meta_key: str, header: dict) -> Path:
    """Write numpy ``arrays`` and the JSON ``header`` (safetensors metadata ``meta_key``) to ``p`` atomically
    (through ``p.partial``); the caller decides about overwriting. Returns ``p``."""
    from safetensors.numpy import save_file

    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".partial")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata={meta_key: json.dumps(header)})
    tmp.replace(p)
    return p


@dataclass
class Trace(HeaderGeometry):
    """An in-memory routing trace; see the module docstring for the arrays' meaning, shapes and dtypes."""

    header: dict
    expert_ids: np.ndarray
    expert_weights: np.ndarray
    request: np.ndarray
    step: np.ndarray
    prompt_ids: np.ndarray
    router_probs: np.ndarray | None = None
    xl_probs: np.ndarray | None = None
    _bounds: list[tuple[int, int, int, int]] | None = field(default=None, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.header["requests"])

    def steps(self) -> list[tuple[int, int, int, int]]:
        """``[(request, step, row_start, row_end)]`` in replay order; rows ``[row_start, row_end)`` of the arrays
        are that step's tokens (many for a prefill, one for a decode step)."""
        if self._bounds is None:
            self._bounds = run_bounds(self.request, self.step)
        return self._bounds

    def decode_rows(self) -> np.ndarray:
        """int64 ``[N]``: each row's index among the decode rows (into ``xl_probs``), -1 for prefill rows."""
        dec = self.step > 0
        return np.where(dec, np.cumsum(dec) - 1, -1)

    def check_model(self, fingerprint: str) -> None:
        """Raise MoeOffloadError unless this trace was recorded on the model with ``fingerprint``."""
        if self.header.get("model_id") != fingerprint:
            raise MoeOffloadError(f"trace was recorded on model {self.header.get('model_id')}, "
                                  f"not on the given model {fingerprint}")

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the trace to ``path`` (a new file unless ``overwrite``).

        Raises:
            MoeOffloadError: ``path`` exists and ``overwrite`` is False.
        """
        p = Path(path)
        if p.exists() and not overwrite:
            raise MoeOffloadError(f"{p} already exists; choose a new --out")
        arrays = {"expert_ids": self.expert_ids.astype(np.int16), "expert_weights": self.expert_weights.astype(np.float16),
                  "request": self.request.astype(np.int32), "step": self.step.astype(np.int32),
                  "prompt_ids": self.prompt_ids.astype(np.int32)}
        if self.router_probs is not None:
            arrays["router_probs"] = self.router_probs.astype(np.float16)
        if self.xl_probs is not None:
            arrays["xl_probs"] = self.xl_probs.astype(np.float32)
        header = dict(self.header, format=FORMAT, version=VERSION, router_probs=self.router_probs is not None,
                      xl_depth=0 if self.xl_probs is None else int(self.xl_probs.shape[2]))
        return write_arrays_with_header(p, arrays, META_KEY, header)


def read_header_and_arrays(p: Path, meta_key: str, what: str) -> tuple[dict, dict]:
    """The JSON header (safetensors metadata ``meta_key``) and the numpy arrays of a moe-offload ``what`` file
    (e.g. "trace", "diffusion trace").

    Raises:
        MoeOffloadError: missing, unreadable or truncated file, no header, a header that is not a JSON object.
    """
    from safetensors import safe_open

    if not p.is_file():
        raise MoeOffloadError(f"{what} file not found: {p}")
    try:
        with safe_open(str(p), framework="np") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise MoeOffloadError(f"{p} is not a readable {what} file ({e})") from None
    if meta_key not in meta:
        kinds = [k.removeprefix("moe_offload_").replace("_", " ") for k in meta if k.startswith("moe_offload_")]
        if kinds:
            raise MoeOffloadError(f"{p} is a moe-offload {kinds[0]}, not a moe-offload {what} (no {meta_key} header)")
        raise MoeOffloadError(f"{p} is not a moe-offload {what} (no {meta_key} header)")
    try:
        header = json.loads(meta[meta_key])
    except json.JSONDecodeError as e:
        raise MoeOffloadError(f"{p}: corrupt {what} header ({e})") from None
    if not isinstance(header, dict):
        raise MoeOffloadError(f"{p}: corrupt {what} header (not a JSON object)")
    return header, arrays


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by ``Trace.save``.

    Raises:
        MoeOffloadError: missing, corrupt or truncated file, not a moe-offload trace, another format version, or
            arrays whose shapes disagree with the header.
    """
    p = Path(path)
    header, arrays = read_header_and_arrays(p, META_KEY, "trace")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise MoeOffloadError(f"{p}: unsupported trace format {header.get('format')} v{header.get('version')}")
    need = {"expert_ids", "expert_weights", "request", "step", "prompt_ids"}
    if not need <= set(arrays):
        raise MoeOffloadError(f"{p}: trace lacks arrays {sorted(need - set(arrays))}")
    n = arrays["request"].shape[0]
    L, E, k = header["num_moe_layers"], header["num_experts"], header["top_k"]
    if arrays["expert_ids"].shape != (n, L, k) or arrays["expert_weights"].shape != (n, L, k):
        raise MoeOffloadError(f"{p}: expert arrays of shape {arrays['expert_ids'].shape}, header says [{n}, {L}, {k}]")
    probs = arrays.get("router_probs")
    if probs is not None and probs.shape != (n, L, E):
        raise MoeOffloadError(f"{p}: router_probs of shape {probs.shape}, header says [{n}, {L}, {E}]")
    xl = arrays.get("xl_probs")
    if xl is not None and xl.shape != (int((arrays["step"] > 0).sum()), L, header.get("xl_depth"), E):
        raise MoeOffloadError(f"{p}: xl_probs of shape {xl.shape}, header says [decode rows, {L}, "
                              f"{header.get('xl_depth')}, {E}]")
    return Trace(header, arrays["expert_ids"], arrays["expert_weights"], arrays["request"], arrays["step"],
                 arrays["prompt_ids"], probs, xl)


def merge_requests(parts: list[tuple[Trace, list[int]]], source: str = "") -> Trace:
    """One trace made of chosen requests of one or more traces of the same model, renumbered 0.. in order.

    Args:
        parts: ``[(trace, request indices)]``; requests keep their rows (prompt then decode steps) unchanged.
        source: free text for the new header's ``source``.

    Returns:
        A ``Trace`` (router probabilities, cross-layer forecasts kept only when every part has them).

    Raises:
        MoeOffloadError: no request chosen, traces of different models, or a request index out of range.
    """
    ids_l, w_l, req_l, step_l, pid_l, probs_l, xl_l, reqs_meta = [], [], [], [], [], [], [], []
    first = None
    keep_probs = all(t.router_probs is not None for t, _ in parts)
    keep_xl = all(t.xl_probs is not None for t, _ in parts)
    for tr, requests in parts:
        if first is None:
            first = tr
        elif tr.header.get("model_id") != first.header.get("model_id"):
            raise MoeOffloadError("cannot merge traces of different models")
        plen = [int(r["prompt_tokens"]) for r in tr.header["requests"]]
        pstart = np.concatenate([[0], np.cumsum(plen)]).astype(np.int64)
        for r in requests:
            if not 0 <= r < len(plen):
                raise MoeOffloadError(f"request {r} is not in the trace ({len(plen)} requests)")
            rows = np.flatnonzero(tr.request == r)
            new = len(reqs_meta)
            ids_l.append(tr.expert_ids[rows])
            w_l.append(tr.expert_weights[rows])
            req_l.append(np.full(len(rows), new, np.int32))
            step_l.append(tr.step[rows])
            pid_l.append(tr.prompt_ids[pstart[r]:pstart[r + 1]])
            if keep_probs:
                probs_l.append(tr.router_probs[rows])
            if keep_xl:
                dec = tr.decode_rows()[rows]
                xl_l.append(tr.xl_probs[dec[dec >= 0]])
            reqs_meta.append(dict(tr.header["requests"][r]))
    if not reqs_meta:
        raise MoeOffloadError("no request to merge")
    header = dict(first.header, requests=reqs_meta, source=source or first.header.get("source", ""))
    return Trace(header, np.concatenate(ids_l), np.concatenate(w_l), np.concatenate(req_l), np.concatenate(step_l),
                 np.concatenate(pid_l), np.concatenate(probs_l) if keep_probs else None,
                 np.concatenate(xl_l) if keep_xl else None)
