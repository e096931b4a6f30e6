"""Preprocessing Psi (SeqMoE §5.2) and activation sequences from routing traces.

Psi turns one step's raw expert activation state of layers ``[l, l')`` into the predictor's input: inactive
(non-top-k) experts are set to -inf and a softmax is taken over the expert dimension, then the layer and expert
dimensions are merged into one feature vector of ``n * e`` values.

For a softmax router the masked softmax of the router logits over the active set equals the active experts'
routing probabilities renormalised to sum to 1, i.e. the routing weights renormalised (whether or not the model
itself renormalises its top-k weights). We therefore compute Psi from ``(expert_ids, expert_weights)``, which the
runtime sees at every MoE layer and every trace stores, so training (from traces) and inference (in the runtime)
use exactly the same input; traces need no ``router_probs`` for it (``psi_from_logits`` is the literal definition
and the tests check both agree).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..trace.format import Trace


def psi(expert_ids: torch.Tensor, expert_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Psi from routing decisions (SeqMoE §5.2).

    Args:
        expert_ids: ``[..., n, k]`` integer expert indices (within each layer) selected at each of n layers.
        expert_weights: ``[..., n, k]`` their routing weights (non-negative; any float dtype).
        num_experts: e, experts per layer.

    Returns:
        float32 ``[..., n * e]``: per layer, the active experts' weights renormalised to sum to 1, zeros elsewhere
        (= softmax over the experts with inactive ones at -inf), layers concatenated in order.
    """
    w = expert_weights.float()
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros(*expert_ids.shape[:-1], num_experts, dtype=torch.float32, device=expert_ids.device)
    out.scatter_(-1, expert_ids.long(), w)
    return out.flatten(-2)


def psi_from_logits(logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Psi by its definition: mask inactive experts to -inf, softmax over experts, merge layers (SeqMoE §5.2).

    Args:
        logits: ``[..., n, e]`` raw activation state (router logits, or a predictor's output logits).
        active: ``[..., n, k]`` integer indices of the active experts of each layer.

    Returns:
        float32 ``[..., n * e]``.
    """
    masked = torch.full_like(logits, float("-inf"), dtype=torch.float32)
    masked.scatter_(-1, active.long(), logits.float().gather(-1, active.long()))
    return torch.softmax(masked, dim=-1).flatten(-2)


def psi_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Psi of a prediction, the recursive input of §5.3: the predicted top-k experts of each layer are the active
    ones. ``logits [..., n, e]`` -> float32 ``[..., n * e]``."""
    return psi_from_logits(logits, logits.topk(k, dim=-1).indices)


@dataclass
class Sequence:
    """One request's activation sequence: every token position the model processed, prompt tokens first.

    Attributes:
        ids: int64 ``[T, L, k]`` selected experts per position and MoE layer.
        weights: float32 ``[T, L, k]`` their routing weights.
        prompt_len: number of prompt positions P (rows ``[0, P)``; row ``P + i - 1`` is decode step i).
        key: ``(trace_index, request)`` identity of the request.
        xl: float32 ``[T - P, L, d, E]`` or None: the cross-layer forecasts recorded at each decode step
            (``Trace.xl_probs``; row ``i - 1`` = decode step i).
    """

    ids: torch.Tensor
    weights: torch.Tensor
    prompt_len: int
    key: tuple[int, int]
    xl: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def features(self, layers: tuple[int, int], num_experts: int) -> torch.Tensor:
        """Psi of layers ``[l, l')`` at every position: float32 ``[T, (l' - l) * e]``."""
        lo, hi = layers
        return psi(self.ids[:, lo:hi], self.weights[:, lo:hi], num_experts)

    def shuffled(self, seed: int) -> "Sequence":
        """The same positions in a random order (the step-shuffled control of SeqMoE §3.1, fig. 2)."""
        perm = torch.from_numpy(np.random.default_rng(seed).permutation(len(self)))
        return Sequence(self.ids[perm], self.weights[perm], self.prompt_len, self.key)


def trace_sequences(trace: Trace, trace_index: int = 0) -> list[Sequence]:
    """Split a trace into per-request sequences (rows in trace order: the prompt's tokens, then decode steps)."""
    req = trace.request
    dec = trace.decode_rows() if trace.xl_probs is not None else None
    out = []
    bounds = np.flatnonzero(np.diff(req)) + 1
    starts = np.concatenate([[0], bounds]).astype(int)
    ends = np.concatenate([bounds, [len(req)]]).astype(int)
    for s, e in zip(starts, ends):
        if e <= s:
            continue
        steps = trace.step[s:e]
        xl = None
        if dec is not None:
            rows = dec[s:e]
            xl = torch.from_numpy(trace.xl_probs[rows[rows >= 0]])
        out.append(Sequence(ids=torch.from_numpy(trace.expert_ids[s:e].astype(np.int64)),
                            weights=torch.from_numpy(trace.expert_weights[s:e].astype(np.float32)),
                            prompt_len=int((steps == 0).sum()), key=(trace_index, int(req[s])), xl=xl))
    return out


def prefill_popularity(traces: list[Trace], keys: list[tuple[int, int]], num_moe_layers: int,
                       num_experts: int) -> list[list[int]]:
    """Offline expert popularity for prefill offloading (SeqMoE §8.4): ``[L][E]`` counts of how many prompt tokens
    the router sent to each expert, over the prefills (step 0 rows) of the requests ``keys`` =
    ``[(trace_index, request)]`` of ``traces``."""
    counts = np.zeros((num_moe_layers, num_experts), dtype=np.int64)
    want: dict[int, set[int]] = {}
    for t_i, r in keys:
        want.setdefault(t_i, set()).add(r)
    for t_i, reqs in want.items():
        tr = traces[t_i]
        rows = (tr.step == 0) & np.isin(tr.request, sorted(reqs))
        ids = tr.expert_ids[rows].astype(np.int64)  # [N, L, k]
        for p in range(num_moe_layers):
            counts[p] += np.bincount(ids[:, p, :].reshape(-1), minlength=num_experts)[:num_experts]
    return counts.tolist()


def split_requests(keys: list[tuple[int, int]], test_fraction: float = 0.1, seed: int = 0
                   ) -> tuple[list[int], list[int]]:
    """Deterministic train/test split by request (SeqMoE §5.4 uses 90/10).

    Args:
        keys: request identities, in order.
        test_fraction: share of requests held out, in (0, 1).
        seed: permutation seed.

    Returns:
        ``(train_indices, test_indices)`` into ``keys``, each sorted; the test set has
        ``max(1, round(test_fraction * len(keys)))`` requests.
    """
    n = len(keys)
    perm = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(test_fraction * n)))
    return sorted(perm[n_test:].tolist()), sorted(perm[:n_test].tolist())


def trace_digest(trace: Trace) -> str:
    """Identity of a trace's content for train/test bookkeeping: 16 hex digits of the SHA-256 of its header
    (which lists every request's prompt and decode lengths) and its row count."""
    import hashlib
    import json

    canon = json.dumps(trace.header, sort_keys=True) + f"|{len(trace.request)}"
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def training_split(training: dict, traces: list[Trace], keys: list[tuple[int, int]]
                   ) -> tuple[list[int], list[int]] | None:
    """The predictor's own train/test split of ``keys`` when ``traces`` are exactly its training traces.

    Args:
        training: a predictor header's ``training`` dict (its ``split``: seed, test_fraction, trace digests).
        traces: the traces at hand, in order.
        keys: the request keys of those traces' sequences, in order (``Sequence.key``).

    Returns:
        ``(train_indices, test_indices)`` into ``keys`` as ``split_requests`` made them at training time, or None
        when the traces differ from the training traces (by ``trace_digest``): then none of them was held out.
    """
    split = training.get("split", {})
    if [t.get("digest") for t in split.get("traces", [])] != [trace_digest(t) for t in traces]:
        return None
    return split_requests(keys, split["test_fraction"], split["seed"])


def load_traces(paths: list) -> list[Trace]:
    """The trace files ``paths``, which must all come from one model.

    Raises:
        MoeOffloadError: an unreadable trace, or traces of different models (by their header's ``model_id``)."""
    from ..errors import MoeOffloadError
    from ..trace.format import load_trace

    traces = [load_trace(p) for p in paths]
    ids = {t.header.get("model_id") for t in traces}
    if len(ids) > 1:
        raise MoeOffloadError(f"the traces come from different models: {sorted(map(str, ids))}")
    return traces


def traces_sequences(traces: list[Trace]) -> list[Sequence]:
    """Every request of ``traces`` as a ``Sequence`` (keys ``(trace index, request)``), traces in order."""
    seqs: list[Sequence] = []
    for i, t in enumerate(traces):
        seqs += trace_sequences(t, i)
    return seqs


def eval_split(training: dict, traces: list[Trace]) -> tuple[list[Sequence], list[int], list[int], str]:
    """``(requests, train indices, test indices, note)`` for evaluating a predictor (its header's ``training``) on
    ``traces``: when they are its training traces, its own split (evaluate on the held-out requests), else no
    training requests and every request to evaluate; ``note`` says which."""
    seqs = traces_sequences(traces)
    split = training_split(training, traces, [s.key for s in seqs])
    if split is not None:
        train_idx, test_idx = split
        return seqs, train_idx, test_idx, \
            f"held-out {len(test_idx)} of {len(seqs)} requests (the predictor's training split)"
    return seqs, [], list(range(len(seqs))), \
        f"all {len(seqs)} requests (these trace files are not the predictor's training trace files)"
