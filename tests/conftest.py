"""Shared fixtures: tiny random checkpoints of the core architectures, built once per test session (the sweep over
every model type of the installed transformers is tests/test_architectures.py)."""

import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: the architectures the runtime tests exercise in depth (residencies, rounds, quantized formats, diffusion)
CORE_ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "llada2_moe"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """``{model_type: checkpoint_dir}`` for ``CORE_ARCHS``."""
    from transformers.utils import logging as hf_logging

    from moe_offload.models.tiny import make_tiny

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch) for arch in CORE_ARCHS}
