"""Block-diffusion generation (LLaDA2.0's loop; DESIGN.md §4, TIDE "Temporal stability in diffusion").

The sequence is cut into **blocks** of ``block_length`` positions, aligned at position 0 as in LLaDA2's reference
``generate``: the prompt fills the first blocks, the block holding the prompt's tail is completed with **mask
tokens**, and further blocks of mask tokens are appended one at a time until ``max_new_tokens`` positions after
the prompt are covered. Attention is block-causal: a token sees every token of its own block and of all earlier
blocks, never a later block (``block_causal_mask``). Each block is refined over at most ``steps`` **diffusion
steps**; one step is one forward pass (``generation.diffusion_forward.StepForward``: by default over the current block
only, against the **block-prefix KV cache** of the prompt's complete blocks and the committed blocks, which is
exact under block-causal attention; with ``prefix_cache=False`` over the whole prefix, the reference loop), which
yields, for every masked position of the current block, a token and its confidence (``sampling.choose``: the
sampler of every generation path, the same rules at its edges — greedy below ``sampling.GREEDY_TEMPERATURE`` or at
top-k 1, else temperature + top-k + top-p sampling; the confidence is the token's probability: under the plain
softmax when greedy, under the sampled distribution otherwise). The step commits every masked token whose confidence
exceeds ``threshold``; when fewer than the step's scheduled count do, it commits the scheduled count of most
confident ones instead. The schedule (``transfer_schedule``) splits ``block_length`` evenly over ``steps``
(remainder to the first steps), so a block always completes within ``steps`` steps and threshold commits only make
it finish sooner. After a block completes, generation stops if it holds an EOS token; the output is cut after the
first EOS and to ``max_new_tokens``.

Hooks: before every diffusion step the offload engine (if any) gets ``engine.begin_step(request, step)`` with a
step index global over the request's blocks (0 = the first step, whose forward also covers the prompt), and
``engine.begin_diffusion_step(request, block, step_in_block)`` when it has one (a block begins exactly when
``step_in_block == 0``); then ``on_step(block, step_in_block, global_step)`` is called; after the step,
``on_step_end`` with the same arguments (e.g. a trace recorder's ``end_step``), then ``engine.end_diffusion_step()``
when the engine has one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import MoeOffloadError
from ..runtime.emulated_clock import now
from .sampling import choose
from .diffusion_forward import StepForward
from .diffusion_result import BlockStats, DiffusionResult, diffusion_summary  # noqa: F401 (re-exported)
from ..models.loader import LoadedModel


def is_diffusion(lm_or_config) -> bool:
    """Whether a ``LoadedModel`` or a transformers config is a block-diffusion LM (an ``Architecture`` flagged
    ``diffusion``, e.g. ``llada2_moe``)."""
    from ..models.registry import DIFFUSION

    arch = getattr(lm_or_config, "arch", None)
    if arch is not None:
        return bool(arch.diffusion)
    return (getattr(lm_or_config, "model_type", None) or "") in DIFFUSION


def check_params(max_new_tokens: int, block_length: int, steps: int, threshold: float) -> None:
    """Validate the loop's parameters.

    Raises:
        MoeOffloadError: ``max_new_tokens <= 0``, ``block_length <= 0``, ``steps`` outside ``[1, block_length]``,
            or ``threshold`` outside ``(0, 1]``.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise MoeOffloadError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if not isinstance(block_length, int) or block_length <= 0:
        raise MoeOffloadError(f"--block-length must be a positive integer, got {block_length}")
    if not isinstance(steps, int) or not 1 <= steps <= block_length:
        raise MoeOffloadError(f"--steps must be an integer in [1, --block-length = {block_length}], got {steps}")
    if not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:  # NaN fails too
        raise MoeOffloadError(f"--threshold must be in (0, 1], got {threshold}")


def loop_params(arch, block_length: int | None, steps: int | None, threshold: float | None,
                max_new_tokens: int = 1, what: str = "the model", prefix_cache: bool = True) -> dict | None:
    """The block-diffusion loop's keyword arguments from optional ``--block-length/--steps/--threshold`` values
    (defaults block 32, steps = block length, threshold 0.95) and ``--no-prefix-cache`` (``prefix_cache=False``),
    validated; None for an autoregressive ``arch`` (a ``models.registry.Architecture``; ``what`` names the model in
    messages).

    Raises:
        MoeOffloadError: one of the options given for an autoregressive model, or a bad value (``check_params``).
    """
    given = [f"--{n}" for n, v in (("block-length", block_length), ("steps", steps), ("threshold", threshold))
             if v is not None] + ([] if prefix_cache else ["--no-prefix-cache"])
    if not arch.diffusion:
        if given:
            raise MoeOffloadError(f"{', '.join(given)} only apply to diffusion models; {what} is {arch.name} "
                                  "(autoregressive)")
        return None
    block = 32 if block_length is None else block_length
    params = {"block_length": block, "steps": block if steps is None else steps,
              "threshold": 0.95 if threshold is None else threshold}
    check_params(max_new_tokens, **params)
    return dict(params, prefix_cache=bool(prefix_cache))


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens to commit at each diffusion step of a block at least: ``block_length`` split evenly over ``steps``,
    the remainder going to the first steps (LLaDA2's ``_get_num_transfer_tokens``); sums to ``block_length``."""
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def block_causal_mask(length: int, block_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[length, length]`` bool mask, True where query ``i`` may attend key ``j``: ``j // block_length <=
    i // block_length`` (own block and all earlier blocks; blocks aligned at position 0)."""
    blk = torch.arange(length, device=device) // block_length
    return blk[None, :] <= blk[:, None]


def _mask_token_id(lm: LoadedModel) -> int:
    mid = getattr(lm.model.config, "mask_token_id", None)
    if mid is None and lm.tokenizer is not None:
        mid = getattr(lm.tokenizer, "mask_token_id", None)
    if mid is None:
        raise MoeOffloadError(f"{lm.arch.name} checkpoint names no mask token (config mask_token_id)")
    return int(mid)


def commit_positions(confidence: torch.Tensor, masked: torch.Tensor, scheduled: int, threshold: float) -> torch.Tensor:
    """Which positions of a block one diffusion step commits.

    Args:
        confidence: ``[B]`` float, the chosen token's probability at each position of the block.
        masked: ``[B]`` bool, positions still holding the mask token.
        scheduled: the step's scheduled count (``transfer_schedule``).
        threshold: confidence threshold in (0, 1].
    Returns:
        ``[B]`` bool: every masked position whose confidence exceeds ``threshold`` if there are at least
        ``scheduled`` of them, else the ``min(scheduled, masked.sum())`` most confident masked positions.
    """
    conf = confidence.float().masked_fill(~masked, -math.inf)
    high = conf > threshold
    if int(high.sum()) >= scheduled:
        return high
    k = min(scheduled, int(masked.sum()))
    out = torch.zeros_like(masked)
    out[torch.topk(conf, k=k).indices] = True
    return out


@torch.no_grad()
def diffusion_generate_ids(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int, *, block_length: int = 32,
                           steps: int | None = None, threshold: float = 0.95, temperature: float = 0.0,
                           top_p: float = 1.0, top_k: int = 0, seed: int | None = None, request: int = 0,
                           prefix_cache: bool = True,
                           on_step: Callable[[int, int, int], None] | None = None,
                           on_step_end: Callable[[int, int, int], None] | None = None,
                           on_block: Callable[[list[int]], bool | None] | None = None) -> DiffusionResult:
    """Block-diffusion generation of up to ``max_new_tokens`` tokens after ``prompt_ids`` (see the module docstring).

    Args:
        lm: a loaded diffusion model (``load_full`` or ``load_offloaded``); its forward must accept
            ``attention_mask [1, 1, Q, K]`` bool (True = may attend), ``position_ids`` and, with the prefix cache,
            ``past_key_values`` (``generation.diffusion_forward.StepForward``).
        prompt_ids: prompt token ids (at least one).
        max_new_tokens: > 0.
        block_length: positions per block (LLaDA2: 32).
        steps: diffusion steps per block, in ``[1, block_length]``; default ``block_length`` (LLaDA2's default).
        threshold: commit every masked token whose confidence exceeds it, in (0, 1] (1.0: only the schedule).
        temperature, top_p, top_k, seed: the shared sampler's settings (``moe_offload.generation.sampling``): a temperature
            below ``GREEDY_TEMPERATURE`` (default 0) or ``top_k`` 1 is greedy; else sampling with this generator
            seed, ``top_p`` keeping at least the most probable token, ``top_k`` 0 off.
        request: request number given to ``engine.begin_step``.
        prefix_cache: keep the keys and values of the prompt's complete blocks and of every committed block and run
            each step over the current block only (default; exact under block-causal attention, the same tokens);
            False recomputes the whole prefix at every step (the reference loop).
        on_step / on_step_end: called before / after every diffusion step with ``(block, step_in_block,
            global_step)``; ``block`` counts generated blocks from 0, ``global_step`` the request's steps from 0.
        on_block: called after every completed block with the output tokens that became final in it (the
            generated positions of the block, cut after the first EOS and to ``max_new_tokens``; possibly empty),
            e.g. to stream block by block; when it returns True, generation stops after that block and the result
            holds the tokens given so far.

    The mask token is excluded from the choices (a trained LLaDA2 gives it ~zero probability; a random test model
    might otherwise commit it and leave its block unfinished).

    Returns:
        ``DiffusionResult`` (tokens, per-block and per-step stats, times).

    Generation stops at the model's position limit: whole blocks within ``max_position_embeddings``
    (``generate.token_budget``).

    Raises:
        MoeOffloadError: bad parameters (``check_params``), an empty prompt, a prompt that leaves no room for a block
            within the model's position limit, no mask token in the config, or the prefix cache for a model that
            takes no ``past_key_values``.
        ValueError: a NaN or infinite ``temperature`` or ``top_p`` (``sampling.is_greedy``).
    """
    steps = block_length if steps is None else steps
    check_params(max_new_tokens, block_length, steps, threshold)
    if not prompt_ids:
        raise MoeOffloadError("the prompt encodes to no token")
    from .generate import eos_ids, token_budget
    from ..common.seeds import make_generator

    max_new_tokens = token_budget(lm, len(prompt_ids), max_new_tokens, block_length)
    mask_id = _mask_token_id(lm)
    eos = eos_ids(lm)
    dev = lm.device
    prompt_len = len(prompt_ids)
    num_blocks = -(-(prompt_len + max_new_tokens) // block_length)
    total = num_blocks * block_length
    x = torch.full((1, total), mask_id, dtype=torch.long, device=dev)
    x[0, :prompt_len] = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
    forward = StepForward(lm.model, total, block_length, block_causal_mask(total, block_length, dev), prefix_cache)
    loop = _BlockLoop(lm, x, forward, mask_id, transfer_schedule(block_length, steps), threshold, request,
                      (temperature, top_p, make_generator(seed), top_k), on_step, on_step_end)
    first_block_s = 0.0
    emitted = 0  # output tokens handed to on_block so far
    end = prompt_len
    for b in range(prompt_len // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        loop.run_block(start, end)
        if len(loop.blocks) == 1:
            first_block_s = now() - loop.t_start
        if on_block is not None:
            final = _cut_after_eos(x[0, prompt_len:min(end, prompt_len + max_new_tokens)].tolist(), eos)
            stop = bool(on_block(final[emitted:]))
            emitted = len(final)
            if stop:
                break
        if any(t in eos for t in x[0, prompt_len:end].tolist()):
            break
    new = _cut_after_eos(x[0, prompt_len:min(end, prompt_len + max_new_tokens)].tolist(), eos)
    return DiffusionResult(new, prompt_len, loop.blocks, loop.step_seconds, first_block_s,
                           now() - loop.t_start)


class _BlockLoop:
    """The diffusion steps of one request's blocks (``diffusion_generate_ids``): hooks, forward, choice, commit;
    ``sampling`` is ``(temperature, top_p, generator, top_k)`` (``sampling.choose``'s arguments)."""

    def __init__(self, lm, x, forward: StepForward, mask_id: int, schedule: list[int], threshold: float,
                 request: int, sampling: tuple, on_step, on_step_end):
        self.lm, self.x, self.forward, self.mask_id = lm, x, forward, mask_id
        self.schedule, self.threshold, self.request, self.sampling = schedule, threshold, request, sampling
        self.on_step, self.on_step_end = on_step, on_step_end
        self.blocks: list[BlockStats] = []
        self.step_seconds: list[float] = []
        self.global_step = 0
        self.t_start = now()

    def run_block(self, start: int, end: int) -> BlockStats:
        """Refine block ``[start, end)`` until no mask token is left (at most ``len(schedule)`` steps)."""
        from .generate import sync_device

        block = self.x[0, start:end]  # a view: commits write into x
        stats = BlockStats(index=len(self.blocks), start=start, masks=int((block == self.mask_id).sum()))
        engine = self.lm.engine
        t_block = now()
        for s, scheduled in enumerate(self.schedule):
            masked = block == self.mask_id
            if not bool(masked.any()):
                break
            t0 = now()
            if engine is not None:
                engine.begin_step(self.request, self.global_step)
                if hasattr(engine, "begin_diffusion_step"):  # refresh planners (TIDE) need the block and step
                    engine.begin_diffusion_step(self.request, stats.index, s)
            if self.on_step is not None:
                self.on_step(stats.index, s, self.global_step)
            logits = self.forward(self.x, start, end).clone()
            logits[:, self.mask_id] = -math.inf  # the mask token is never an output
            tok, conf = choose(logits, *self.sampling)
            chosen = commit_positions(conf, masked, scheduled, self.threshold)
            block[chosen] = tok[chosen]
            stats.committed.append(int(chosen.sum()))
            stats.forward_tokens.append(self.forward.tokens)
            if self.on_step_end is not None:
                self.on_step_end(stats.index, s, self.global_step)
            sync_device(self.lm.device)
            if engine is not None and hasattr(engine, "end_diffusion_step"):
                engine.end_diffusion_step()
            self.step_seconds.append(now() - t0)
            self.global_step += 1
        stats.seconds = now() - t_block
        self.blocks.append(stats)
        return stats


def _cut_after_eos(ids: list[int], eos: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS id (all of them when there is none)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def run_diffusion(lm: LoadedModel, prompts: list[str], max_new_tokens: int, *, block_length: int = 32,
                  steps: int | None = None, threshold: float = 0.95, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int | None = None, progress: bool = False, recorder=None,
                  prefix_cache: bool = True):
    """Block-diffusion generation for each prompt in turn, with the autoregressive ``generate.run``'s outputs and
    totals so the same reports apply.

    Returns:
        ``(outputs, run_stats, results)``: ``generate.Output`` per prompt (``ttft_s`` = seconds to the first complete
        block, ``decode_s`` = the rest), ``generate.RunStats`` (engine counters; ``decode_tokens`` = tokens after
        the first block) and the ``DiffusionResult`` per prompt (blocks, steps, tokens per step).
        ``recorder``: optional ``trace.diffusion.DiffusionTraceRecorder``; its ``end_step`` gets the global diffusion
        step. ``prefix_cache``, ``temperature`` / ``top_p`` / ``top_k`` / ``seed``: see ``diffusion_generate_ids``.

    Raises:
        MoeOffloadError: see ``diffusion_generate_ids``; also a checkpoint without a tokenizer.
    """
    from .generate import run_requests

    steps = block_length if steps is None else steps
    check_params(max_new_tokens, block_length, steps, threshold)
    if lm.tokenizer is None:
        raise MoeOffloadError(f"{lm.path} has no tokenizer: cannot encode prompts")
    results = []

    def one(i, pids):
        res = diffusion_generate_ids(lm, pids, max_new_tokens, block_length=block_length, steps=steps,
                                     threshold=threshold, temperature=temperature, top_p=top_p, top_k=top_k,
                                     seed=seed, request=i,
                                     prefix_cache=prefix_cache,
                                     on_step_end=(lambda _b, _s, g: recorder.end_step(g)) if recorder else None)
        results.append(res)
        return res.token_ids, res.first_block_s, res.seconds - res.first_block_s, res.decode_tokens(block_length)

    outputs, stats = run_requests(lm, prompts, one, max_new_tokens=max_new_tokens, block_length=block_length,
                                  progress=progress, recorder=recorder)
    return outputs, stats, results
