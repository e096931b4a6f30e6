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


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (the exact-token rules of batching hold at OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def random_pset():
    """``make(lm, seed)``: an untrained two-range predictor set for a loaded model (weights from ``seed``)."""
    import torch

    from moe_offload.predictor.model import PredictorHeader, PredictorSet, PredictorSpec, default_ranges

    def make(lm, seed: int):
        h = PredictorHeader(model_id=lm.model_id, model_type=lm.model.config.model_type,
                            num_moe_layers=lm.num_moe_layers, num_experts=lm.num_experts, top_k=lm.top_k,
                            specs=[PredictorSpec(layers=r, hidden_size=32, state_size=16, head_dim=16)
                                   for r in default_ranges(lm.num_moe_layers, 2)])
        torch.manual_seed(seed)
        return PredictorSet(h).eval()

    return make


@pytest.fixture
def torch_experts(monkeypatch):
    """The grouped GEMMs of ``runtime.experts`` for every layer, offloaded and FullLoad, as without the native
    kernel (``runtime.fused_experts``): for tests of that path (the one CUDA runs)."""
    from moe_offload.runtime import fused_experts

    monkeypatch.setattr(fused_experts, "native", lambda: None)

