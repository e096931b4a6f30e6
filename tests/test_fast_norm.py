"""RMSNorm on the native kernel (``runtime.fast_norm``): transformers' standard RMSNorm only, its result within the
last bits of torch's, the same for a row alone or in a batch, at 1 and 2 threads, on the AVX2 and the portable
path; families with another arithmetic keep their own forward."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from moe_offload.runtime import kernels
from moe_offload.runtime.fast_norm import is_standard, use_fast_norms

kernel = kernels.native()
pytestmark = pytest.mark.skipif(kernel is None, reason="native kernels not built")


def test_which_classes_are_standard():
    assert is_standard(MixtralRMSNorm) and is_standard(Qwen3MoeRMSNorm)
    assert not is_standard(GemmaRMSNorm)      # (1 + weight), a float32 product: its own forward stays
    model = torch.nn.ModuleDict(dict(a=MixtralRMSNorm(64), b=GemmaRMSNorm(64), c=torch.nn.Linear(4, 4)))
    assert use_fast_norms(model) == 1
    assert type(model["a"]).__name__ == "FastMixtralRMSNorm" and isinstance(model["a"], MixtralRMSNorm)
    assert type(model["b"]) is GemmaRMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_against_torch_and_itself(dtype):
    torch.manual_seed(0)
    ref = MixtralRMSNorm(576, eps=1e-6).to(dtype)
    ref.weight.data.uniform_(0.5, 1.5)
    fast = MixtralRMSNorm(576, eps=1e-6).to(dtype)
    fast.weight.data.copy_(ref.weight.data)
    use_fast_norms(torch.nn.Sequential(fast))
    x = (torch.randn(4, 7, 576) * 3).to(dtype)
    want, got = ref(x), fast(x)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # the sum of squares in another order: the last bits
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(fast(x[2:3, 5:6]), got[2:3, 5:6])              # a row alone = the row in a batch
    assert torch.equal(kernel.rms_norm(x, fast.weight, 1e-6, portable=True), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fast(x)
        torch.set_num_threads(2)
        assert torch.equal(fast(x), one) and torch.equal(one, got)
    finally:
        torch.set_num_threads(threads)


def test_other_dtypes_and_devices_fall_back():
    fast = MixtralRMSNorm(32)
    use_fast_norms(torch.nn.Sequential(fast))
    x = torch.randn(2, 32, dtype=torch.float64)
    assert torch.equal(fast(x), MixtralRMSNorm.forward(fast, x))      # float64 input: the module's own forward
