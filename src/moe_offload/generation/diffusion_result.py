"""Results of the block-diffusion loop (``generation.diffusion``): per block, per request, and totals over requests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockStats:
    """One generated block: ``index`` (0 = the first block holding mask tokens), ``start`` (its first position in
    the sequence), ``masks`` (mask tokens it started with), ``committed`` (tokens committed at each of its diffusion
    steps; ``len(committed)`` is its number of steps), ``forward_tokens`` (tokens of each step's forward: the block,
    plus at its first step the positions cached then; the whole prefix without the prefix cache), ``seconds``
    (wall time of its steps)."""

    index: int
    start: int
    masks: int
    committed: list[int] = field(default_factory=list)
    forward_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.committed)


@dataclass
class DiffusionResult:
    """One request's block-diffusion result.

    ``token_ids``: generated ids (the prompt excluded), cut after the first EOS (kept) and to ``max_new_tokens``;
    ``prompt_tokens``; ``blocks``: per-block stats; ``step_seconds``: wall time of every diffusion step in order;
    ``first_block_s``: seconds until the first block was complete (the first final tokens; TTFT's analogue);
    ``seconds``: total wall time.
    """

    token_ids: list[int]
    prompt_tokens: int
    blocks: list[BlockStats]
    step_seconds: list[float]
    first_block_s: float
    seconds: float

    @property
    def steps(self) -> int:
        """Diffusion steps (forward passes) run."""
        return sum(b.steps for b in self.blocks)

    @property
    def tokens_per_step(self) -> list[int]:
        """Tokens committed at every diffusion step, in order (global across blocks)."""
        return [c for b in self.blocks for c in b.committed]

    @property
    def steps_per_block(self) -> list[int]:
        return [b.steps for b in self.blocks]

    def decode_tokens(self, block_length: int) -> int:
        """Generated tokens after the first block (the diffusion analogue of decode tokens): those beyond the
        generated positions of the first block, which the prompt's block shares with the prompt."""
        first = self.blocks[0].start + block_length - self.prompt_tokens if self.blocks else 0
        return max(0, len(self.token_ids) - first)


def diffusion_summary(results: list[DiffusionResult], block_length: int, steps: int, threshold: float,
                      prefix_cache: bool = True) -> dict:
    """Totals over requests for ``--json`` and the text report: blocks, diffusion steps, tokens, tokens per step,
    mean steps per block, tokens per forward (mean), seconds, output tokens per second, diffusion steps per second,
    and the loop's parameters (``prefix_cache``: whether the block-prefix KV cache was used)."""
    n_steps = sum(r.steps for r in results)
    committed = sum(sum(r.tokens_per_step) for r in results)
    blocks = sum(len(r.blocks) for r in results)
    seconds = sum(r.seconds for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    forward = sum(t for r in results for b in r.blocks for t in b.forward_tokens)
    return {"block_length": block_length, "steps": steps, "threshold": threshold, "prefix_cache": prefix_cache,
            "blocks": blocks,
            "diffusion_steps": n_steps, "committed_tokens": committed, "output_tokens": tokens,
            "tokens_per_step": committed / n_steps if n_steps else 0.0,
            "steps_per_block": n_steps / blocks if blocks else 0.0,
            "tokens_per_forward": forward / n_steps if n_steps else 0.0,
            "seconds": seconds, "output_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "steps_per_s": n_steps / seconds if seconds > 0 else 0.0,
            "tokens_per_step_each": [r.tokens_per_step for r in results],
            "steps_per_block_each": [r.steps_per_block for r in results]}
