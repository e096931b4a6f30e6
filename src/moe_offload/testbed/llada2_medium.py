"""The built-in ``llada2-medium`` checkpoint: a random LLaDA2-MoE with LLaDA2.0-mini's routing geometry
(``models.tiny.make_llada2_medium``), its routers balanced on ShareGPT text, built into the user cache on first use."""

from __future__ import annotations

import json
from pathlib import Path

from ..common.cache import build_once, default_cache_dir
from ..common.progress import Phases, fmt_duration, say, slowdown
from ..common.threads import build_threads
from ..models import tiny
from .sharegpt import human_turns

#: seconds to build llada2-medium on the reference machine (``progress.REFERENCE_PROBE_S``)
LLADA2_MEDIUM_REFERENCE_S = 38.0


def _built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "balance.json").is_file()


def ensure_llada2_medium(progress: bool = True) -> Path:
    """The built-in ``llada2-medium`` checkpoint (``models.tiny.make_llada2_medium``, routers balanced on 32 ShareGPT human turns
    disjoint from the default prompts), built on first use into the cache by ``cache.build_once`` (under a lock, in
    a temporary directory renamed into place). A first use prints one line saying what it builds and about how long
    it takes on this machine (even when ``progress`` is off), then a bar over the balancing passes (``progress``).
    About 40 s on 2 cores (``LLADA2_MEDIUM_REFERENCE_S``; 57 s measured with the cores shared, 102 s before the
    thread-count probe under the same load).

    Raises:
        MoeOffloadError: the ShareGPT data set is not installed.
    """
    def announce():
        say("first use of llada2-medium: building a random LLaDA2-MoE with LLaDA2.0-mini's routing geometry (routers "
            f"balanced on ShareGPT text) into {default_cache_dir() / 'llada2-medium'}; about "
            f"{fmt_duration(LLADA2_MEDIUM_REFERENCE_S * slowdown())} on this machine, once")

    def build(tmp: Path) -> None:
        texts = [t[:400] for t in human_turns(32, offset=200)]
        with build_threads():
            phases = Phases(1, enabled=progress)
            with phases.phase("balancing the routers", LLADA2_MEDIUM_REFERENCE_S * slowdown(), total=tiny.BALANCE_PASSES, unit="pass") as update:
                _, history = tiny.make_llada2_medium(tmp, texts, overwrite=True, on_pass=update)
        (tmp / "balance.json").write_text(json.dumps({"max_over_mean_load_per_pass": history,
                                                      "texts": "ShareGPT human turns 200..231, first 400 chars"}))

    return build_once("llada2-medium", _built, build, what="the llada2-medium checkpoint",
                      announce=announce)
