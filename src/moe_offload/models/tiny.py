"""Tiny random checkpoints of every supported architecture, for tests and for trying an architecture in seconds.

Each is written with transformers' ``save_pretrained`` (so it has the architecture's published checkpoint key
layout, per-expert keys included) plus a 258-token byte-level tokenizer, so ``--prompt`` works on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MoeOffloadError
from .registry import ARCHITECTURES, supported_names


def tiny_tokenizer(mask_token: bool = False):
    """A byte-level BPE tokenizer without merges: 256 byte tokens + ``<|bos|>`` (256) + ``<|eos|>`` (257), and with
    ``mask_token`` a ``<|mask|>`` (258) for diffusion models (their mask token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|bos|>"] = len(vocab)
    vocab["<|eos|>"] = len(vocab)
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if mask_token:
        vocab["<|mask|>"] = len(vocab)
        special["mask_token"] = "<|mask|>"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def make_tiny(arch: str, out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              overwrite: bool = False) -> Path:
    """Write a tiny random checkpoint of ``arch`` (a supported ``model_type``) to ``out_dir``.

    Weights are drawn with ``initializer_range`` 0.2 (transformers' default 0.02 gives near-uniform router scores
    and a model that repeats one token): routing is then decisive and varies from token to token, and greedy text
    varies, which makes the lossless comparisons meaningful.

    Raises:
        MoeOffloadError: unknown architecture, or ``out_dir`` exists and is not empty (unless ``overwrite``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise MoeOffloadError(f"unknown architecture {arch!r}; supported: {supported_names()}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise MoeOffloadError(f"{out} already exists and is not empty; choose another --out")
    diffusion = ARCHITECTURES[arch].diffusion
    tok = tiny_tokenizer(mask_token=diffusion)
    extra = {"mask_token_id": tok.mask_token_id} if diffusion else {}
    config = AutoConfig.for_model(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                  tie_word_embeddings=False, initializer_range=0.2, **extra, **ARCHITECTURES[arch].tiny)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # LLaDA2's selection-only router bias: random, so that loading it is tested
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
