"""Command-line building blocks shared by every ``moe-offload`` command: the parser class (one-line errors, every
option's default in ``--help``), argument types with their ranges, the model and prompt options (the prompts
themselves: ``testbed.prompts``)."""

from __future__ import annotations

import argparse
import math

from ..errors import MoeOffloadError
from ..common.seeds import seed_problem



class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default: ``(default: X)`` is appended unless the help text already says it
    (options whose default is None or a flag's False explain their default in words)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required
                or action.default is None or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message>`` (and a pointer to ``--help``), exit status 2,
    instead of the usage block (subcommand parsers inherit the class and ``HelpFormatter``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s}")
    return v


def nonneg_int(s: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s}")
    return v


def int_in(lo: int, hi: int):
    """An argparse type: an integer in ``[lo, hi]``."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {s}")
        return v

    parse.__name__ = f"int in [{lo}, {hi}]"
    return parse


def seed(s: str) -> int:
    """argparse type: a seed (``moe_offload.common.seeds``: an integer in [0, 2**32 - 1]); the message is the server's."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    problem = seed_problem(v)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return v


def float_(s: str) -> float:
    """argparse type: a number."""
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None


def finite_float(s: str) -> float:
    """argparse type: a finite number (``nan``, ``inf``, ``-inf`` and overflowing ``1e999`` are refused: a sampling
    setting that is not a number has no defined meaning, and range checks let NaN through)."""
    v = float_(s)
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def split_floats(text: str, what: str) -> list[float]:
    """Comma-separated numbers of option ``what``.

    Raises:
        MoeOffloadError: not numbers, none, or an empty entry (``1,,2``, ``1,``)."""
    parts = [x.strip() for x in text.split(",")]
    if not any(parts):
        raise MoeOffloadError(f"{what} is empty")
    if not all(parts):
        raise MoeOffloadError(f"{what} has an empty entry in {text!r}")
    try:
        return [float(x) for x in parts]
    except ValueError:
        raise MoeOffloadError(f"{what} must be comma-separated numbers, got {text!r}") from None


def parse_intervals(text: str) -> list[int]:
    """``--intervals``: ``'A-B'`` or comma-separated integers >= 1.

    Raises:
        MoeOffloadError: anything else."""
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            vals = list(range(a, b + 1))
        else:
            vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MoeOffloadError(f"--intervals must be 'A-B' or comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise MoeOffloadError(f"--intervals must be integers >= 1, got {text!r}")
    return vals


MODEL_HELP = ("checkpoint directory (any MoE model type of the installed transformers that `moe-offload models` lists "
              "as served; a multimodal checkpoint is served for text-only prompts), a built-in name: testbed "
              "(default), testbed-sparse, testbed-sparse-wide (its experts widened to 768 neurons, bf16, 2.6 GB), "
              "llada2-medium (built on first use), or a Hugging Face Hub name "
              "ORG/NAME[@REVISION] (config, tokenizer and safetensors downloaded into the Hugging Face cache, "
              "HF_HUB_CACHE; HF_HUB_OFFLINE=1: the cache only; HF_TOKEN for gated models)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """``--prompt``, ``--prompts``, ``--sharegpt``, ``--sharegpt-offset`` (read by ``testbed.prompts.load_prompts``)."""
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three short ShareGPT turns)")
    p.add_argument("--prompts", metavar="FILE", help="file with one prompt per line (default: none)")
    p.add_argument("--sharegpt", type=positive_int, metavar="N",
                   help="the first N human turns of ShareGPT (default: none)")
    p.add_argument("--sharegpt-offset", type=nonneg_int, default=0, metavar="K",
                   help="with --sharegpt: skip the first K human turns (for disjoint prompt sets)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options every generating command shares: model, device, dtype, policy, tokens, prompts, quiet."""
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--policy", default="auto",
                   help="eviction policy: auto (default: the best of lru, lfu, lfru-H, prefill-hot on a simulation "
                   "of the first prompt's own routing), lru, lfu, lfru[-H] (frequency-recency, half-life H decode "
                   "steps, 8), prefill-hot, xl (cross-layer forecasts from the model's own routers drive "
                   "probabilistic Belady + JSD prefetching; no predictor); with --predictor: seqmoe-cacheonly "
                   "(probabilistic Belady), seqmoe (+ JSD prefetching), seqmoe-infinity, seqmoe-xl (SeqMoE blended "
                   "with cross-layer forecasts); diffusion models: reactive, tide-fixed-T<n>, tide (auto: lru)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt at most")
    add_prompt_args(p)
    add_threads_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """``--threads N``: the intra-op threads every computing path of the command runs on (torch's operators and our
    native kernels share one pool; ``entry.main`` sets it before the command runs)."""
    p.add_argument("--threads", type=positive_int, help="intra-op threads for the compute, torch's and our kernels' "
                   "(default: OMP_NUM_THREADS, else one per core, or one when another process holds a core)")
    p.add_argument("--compute-threads", type=positive_int, metavar="N",
                   help="partition the cores: the compute runs N intra-op threads on the first N cores this process "
                   "may use, the expert readers and copiers on the others (all of them when N is every core); "
                   "instead of --threads (default: not partitioned)")
    p.add_argument("--io-priority", choices=("normal", "realtime"), default="normal",
                   help="how the threads that read and copy experts (--host-store disk, prefetching policies) are "
                   "scheduled: realtime runs them under Linux's real-time scheduler, so that a read's thread runs as "
                   "soon as it wakes even while the compute holds every core (needs CAP_SYS_NICE or an RLIMIT_RTPRIO "
                   "of 1 or more; no effect where no such thread runs; default: normal)")


def memory_budget(s: str) -> float | str:
    """argparse type of ``--memory-budget``: ``auto`` or a finite number of GB > 0 (one-line error otherwise)."""
    if s.strip().lower() == "auto":
        return "auto"
    v = finite_float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of GB > 0 or auto, got {s!r}")
    return v


def add_memory_budget_arg(p) -> None:
    """``--memory-budget GB|auto`` (``serve.budget``) on a parser or mutually exclusive group."""
    p.add_argument("--memory-budget", type=memory_budget, metavar="GB|auto",
                   help="memory budget in GB (10^9 bytes): the slot pool gets what the non-expert weights, the KV "
                   "cache at --max-context and the measured activation peak leave; auto: sized from what the machine "
                   "has (CUDA: 90%% of the free device memory; CPU: 80%% of MemAvailable, capped by the cgroup's "
                   "limit, less a pinned host store); default on CUDA: 90%% of the free device memory, on the CPU: "
                   "residency 1.0")


def add_host_store_arg(p: argparse.ArgumentParser) -> None:
    """``--host-store pinned|mmap|disk`` (``models.loader.HOST_STORES``): where the offloaded experts live below the
    device slots."""
    p.add_argument("--host-store", choices=["pinned", "mmap", "disk"], default="pinned",
                   help="where the offloaded experts live below the device slots: pinned (default: a private copy in "
                   "host RAM, page-locked on CUDA), mmap (the safetensors files' memory maps: the page cache) or disk "
                   "(read from the safetensors files with direct I/O, around the page cache: no expert byte in host "
                   "memory but the slots; for models larger than memory)")
    p.add_argument("--host-cache", type=finite_float, metavar="GB",
                   help="with --host-store disk: a host-RAM cache of this many GB (whole experts, LRU; page-locked "
                   "on CUDA) between the disk and the device slots: three tiers (default: none, slots read from disk)")
    p.add_argument("--pack", metavar="DIR", help="with --host-store disk: read the experts from this aligned expert "
                   "pack (`moe-offload pack`; straight into the slots, no staging copy) (default: the pack inside the "
                   "model folder, moe-offload-pack, if there is one; else the safetensors files)")


def add_rollout_every_arg(p: argparse.ArgumentParser, as_runtime: str = "") -> None:
    """``--rollout-every R`` (``core.forecast.ROLLOUT_EVERY``): decode steps between the predictor's rollouts."""
    from ..core.forecast import ROLLOUT_EVERY

    p.add_argument("--rollout-every", type=int_in(1, 64), default=ROLLOUT_EVERY,
                   help=f"with --predictor: decode steps between the predictor's recursive rollouts{as_runtime} "
                   f"(default {ROLLOUT_EVERY}; 1 = every step, as SeqMoE)")


def add_predictor_lag_arg(p: argparse.ArgumentParser) -> None:
    """``--predictor-lag LAYERS`` (``predictor.lagged``; read as ``args.predictor_lag``, None when not given)."""
    p.add_argument("--predictor-lag", type=int_in(0, 64), metavar="LAYERS",
                   help="with --predictor and --policy seqmoe / seqmoe-cacheonly / seqmoe-infinity: run the predictor "
                   "in a process of its own and use each forecast LAYERS MoE layers after the layer that triggers it "
                   "(at most 64; past the model's MoE layers the forecast waits into the next decode step), so it "
                   "computes beside the decode step instead of in it; simulate replays the forecasts at those "
                   "positions (default: in the step, at its trigger layer)")


def add_diffusion_args(p) -> None:
    """The block-diffusion loop's options (diffusion models such as LLaDA2; validated by
    ``generation.diffusion.loop_params``): ``--block-length``, ``--steps``, ``--threshold``, ``--no-prefix-cache``."""
    p.add_argument("--block-length", type=int, help="diffusion models (LLaDA2): positions per block (default 32)")
    p.add_argument("--steps", type=int, help="diffusion models: diffusion steps per block, at most --block-length "
                   "(default: --block-length)")
    p.add_argument("--threshold", type=float_, help="diffusion models: commit every masked token whose confidence "
                   "exceeds this, in (0, 1] (default 0.95)")
    p.add_argument("--no-prefix-cache", action="store_true", help="diffusion models: recompute the whole prefix at "
                   "every diffusion step (the reference loop) instead of caching the committed blocks' keys and "
                   "values (same tokens, slower)")
