"""``moe-offload export gguf``: a testbed-family checkpoint as a GGUF file for llama.cpp (issue 36).

The side-by-side benchmark (``bench disk``) runs llama.cpp on the same checkpoint as moe-offload, so the checkpoint
must exist as GGUF. The conversion is llama.cpp's own: its ``convert_hf_to_gguf.py`` (which writes through the
``gguf`` package shipped beside it) knows the tensor names, the Q/K row permutation of its rope layout and the
tokenizer metadata its loader expects; a second implementation here would be a second place for those to go wrong,
and the result is checked against llama.cpp itself (tests/test_gguf_export.py: greedy tokens of llama.cpp on the
exported default testbed against our FullLoad's).

Where the converter comes from, in order: ``--converter PATH``, ``$LLAMA_CPP_DIR/convert_hf_to_gguf.py``, a
``convert_hf_to_gguf.py`` on ``PATH``. It is in every llama.cpp source tree, e.g. the one vendored in the
llama-cpp-python source package (``pip download --no-deps --no-binary :all: llama-cpp-python``, then
``vendor/llama.cpp``); it needs ``sentencepiece`` (``pip install moe-offload[peer]``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from ..errors import MoeOffloadError

#: output types of the converter this command offers (the checkpoint's own precision or a wider one)
OUTTYPES = ("f32", "bf16", "f16")
CONVERTER = "convert_hf_to_gguf.py"


def find_converter(explicit: str | os.PathLike | None = None) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (module docstring: where it is looked for).

    Raises:
        MoeOffloadError: not found (the message says how to get it).
    """
    if explicit is not None:
        path = Path(explicit)
        if path.is_dir():
            path = path / CONVERTER
        if not path.is_file():
            raise MoeOffloadError(f"--converter {explicit}: no {CONVERTER} there")
        return path
    env = os.environ.get("LLAMA_CPP_DIR")
    if env and (Path(env) / CONVERTER).is_file():
        return Path(env) / CONVERTER
    which = shutil.which(CONVERTER)
    if which:
        return Path(which)
    raise MoeOffloadError(f"llama.cpp's {CONVERTER} was not found: pass --converter PATH or set LLAMA_CPP_DIR to a "
                          "llama.cpp source tree (e.g. `pip download --no-deps --no-binary :all: llama-cpp-python` "
                          "and its vendor/llama.cpp)")


def export_gguf(model_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32",
                converter: str | os.PathLike | None = None, timeout_s: float = 3600) -> Path:
    """Convert the Mixtral-layout checkpoint ``model_dir`` into the GGUF file ``out`` (``outtype`` f32, bf16 or
    f16) with llama.cpp's converter; written to ``out.partial`` and renamed, so ``out`` is complete or absent.

    Returns:
        ``out``.
    Raises:
        MoeOffloadError: ``out`` exists (never overwritten) or its folder does not, ``model_dir`` is not a
            Mixtral-layout checkpoint, an unknown ``outtype``, the converter is missing or fails (its last line).
    """
    model_dir, out = Path(model_dir), Path(out)
    if outtype not in OUTTYPES:
        raise MoeOffloadError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    if out.exists():
        raise MoeOffloadError(f"{out} already exists; choose a new --out")
    if not out.parent.is_dir():
        raise MoeOffloadError(f"{out.parent} is not a directory")
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise MoeOffloadError(f"{model_dir}: no readable config.json ({e})") from None
    if model_type != "mixtral":
        raise MoeOffloadError(f"export gguf converts the testbed family (Mixtral layout); {model_dir} is "
                              f"{model_type!r}")
    script = find_converter(converter)
    partial = out.with_name(out.name + ".partial")
    cmd = [sys.executable, str(script), str(model_dir), "--outfile", str(partial), "--outtype", outtype]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise MoeOffloadError(f"{script.name} did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        raise MoeOffloadError(f"{script.name} failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}")
    partial.rename(out)
    return out


@contextmanager
def router_ulp_control(model, seed: int):
    """Inside, every top-k router of ``model`` (transformers' ``*TopKRouter``: ``(logits, scores, indices)``) picks
    its experts from probabilities each moved by at most one float32 ulp (up, down or not, drawn from ``seed``): the
    difference another engine's exp, sum and sort make (llama.cpp: ``ggml_v_expf``, ``std::sort``). The control of
    ``check_tokens``: where router probabilities are that close at the top-k boundary, our own engine parts from
    itself as another engine parts from us.

    Raises:
        MoeOffloadError: the model has no top-k router module.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)

    def moved(module, args, out):
        logits = out[0]
        p = torch.softmax(logits.float(), dim=-1)
        step = torch.randint(-1, 2, p.shape, generator=gen)
        p = torch.where(step > 0, torch.nextafter(p, torch.ones_like(p)),
                        torch.where(step < 0, torch.nextafter(p, torch.zeros_like(p)), p))
        scores, indices = torch.topk(p, module.top_k, dim=-1)
        return logits, scores / scores.sum(dim=-1, keepdim=True), indices

    hooks = [m.register_forward_hook(moved) for m in _top_k_routers(model)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _top_k_routers(model) -> list:
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise MoeOffloadError("the model has no top-k router module (transformers' *TopKRouter) to perturb")
    return routers


@contextmanager
def router_near_ties(model, ulps: int = 2):
    """Inside, count the top-k routers' decisions of ``model`` and how many of them are near ties: the k-th and
    (k+1)-th float32 probabilities at most ``ulps`` ulp of the k-th apart (``"near"``) or equal (``"exact"``).
    Yields ``{"decisions", "near", "exact"}`` (ints, filled as the model runs).

    Raises:
        MoeOffloadError: the model has no top-k router module.
    """
    import torch

    counts = {"decisions": 0, "near": 0, "exact": 0}

    def count(module, args, out):
        top = torch.softmax(out[0].float(), dim=-1).topk(module.top_k + 1, dim=-1).values
        kth, nxt = top[:, -2], top[:, -1]
        counts["decisions"] += kth.numel()
        counts["near"] += int(((kth - nxt) <= ulps * torch.finfo(torch.float32).eps * kth).sum())
        counts["exact"] += int((kth == nxt).sum())

    hooks = [m.register_forward_hook(count) for m in _top_k_routers(model)]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens ``a`` and ``b`` share from the start."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def check_tokens(model_dir: Path, gguf: Path, llama_bin: Path, prompts: list[str], n: int = 16,
                 threads: int = 2, timeout_s: float = 600, controls: int = 4) -> list[dict]:
    """llama.cpp's greedy continuation of each prompt on ``gguf`` against our FullLoad's (one thread) on
    ``model_dir``: ``[{"prompt", "ours", "llama", "agree", "n", "control", "explained", "router_ties"}]`` where ``agree`` is the
    number of our first ``n`` tokens whose text is a prefix of llama.cpp's text (llama-completion prints text, not
    ids; its prompt is ours in the chat template, so both start from the same token ids).

    ``control``: the tokens our own FullLoad shares with itself when its router probabilities are moved by at most
    one ulp (``router_ulp_control``, seeds ``0 .. controls - 1``); ``explained``: llama.cpp agrees on all ``n``
    tokens, or parts at a token where one of the controls parts too (a router near tie there, not a difference of
    the two engines' models); ``router_ties``: ``router_near_ties``'s counts over our FullLoad run.

    Raises:
        MoeOffloadError: llama.cpp fails on a prompt (its last line).
    """
    import torch

    from ..generation.generate import encode_prompt, generate_ids
    from ..models.loader import load_full

    torch.set_num_threads(1)
    lm = load_full(model_dir, device="cpu")
    tok = lm.tokenizer
    out = []
    for p in prompts:
        with router_near_ties(lm.model) as ties:
            ids = generate_ids(lm, encode_prompt(tok, p), n)[0]
        control = []
        for seed in range(controls):
            with router_ulp_control(lm.model, seed):
                control.append(first_difference(ids, generate_ids(lm, encode_prompt(tok, p), n)[0]))
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        proc = subprocess.run([str(llama_bin), "-m", str(gguf), "-p", text, "-n", str(n), "--temp", "0", "-t",
                               str(threads), "-c", "4096", "-no-cnv", "--no-warmup", "--seed", "0",
                               "--no-display-prompt", "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            raise MoeOffloadError(f"llama.cpp failed: {lines[-1] if lines else proc.returncode}")
        theirs = proc.stdout.removesuffix(" [end of text]\n").removesuffix(" [end of text]")
        agree = 0
        while agree < len(ids) and theirs.startswith(tok.decode(ids[:agree + 1])):
            agree += 1
        out.append({"prompt": p, "ours": tok.decode(ids), "llama": theirs, "agree": agree, "n": len(ids),
                    "control": control, "explained": agree == len(ids) or agree in control, "router_ties": ties})
    return out
