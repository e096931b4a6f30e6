"""Shared fixtures: tiny random checkpoints of every supported architecture, built once per test session."""

import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """``{model_type: checkpoint_dir}`` for every supported architecture."""
    from transformers.utils import logging as hf_logging

    from moe_offload.models.registry import ARCHITECTURES
    from moe_offload.models.tiny import make_tiny

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch) for arch in ARCHITECTURES}
