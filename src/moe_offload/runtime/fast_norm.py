"""RMSNorm through the native kernel (``runtime.kernels``: ``rms_norm``, issue 46).

An eager RMSNorm of a decode token is seven torch operators (a cast, a square, a mean, an add, a reciprocal square
root, two products) of a few microseconds each: 25-30 us per call measured here, 61 calls per decode step of a
30-layer model. ``use_fast_norms`` routes every RMSNorm module whose ``forward`` is transformers' standard one (the
source of ``LlamaRMSNorm.forward``, which most MoE families copy) through one kernel call, when the input and the
weight share a float32 or bfloat16 dtype on the CPU and the step is not being compiled (inductor fuses the norm with
its neighbours itself); otherwise the module's own forward runs. Families whose RMSNorm differs (an offset weight, a
float32 product) keep their own. The kernel's sum of squares has a fixed order, so the result depends neither on
the thread count nor on the rows of the call; FullLoad and the offloaded engines load through the same function and
keep agreeing bit for bit; against torch's own reduction the result differs in the last bits.
"""

from __future__ import annotations

import inspect
import textwrap

import torch

from .kernels import native

DTYPES = (torch.float32, torch.bfloat16)
_CLASSES: dict[type, type] = {}
_STANDARD: list[str] = []


def _source(fn) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _standard_source() -> str:
    """The source of transformers' standard RMSNorm forward (``LlamaRMSNorm.forward``)."""
    if not _STANDARD:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        _STANDARD.append(_source(LlamaRMSNorm.forward) or "")
    return _STANDARD[0]


def is_standard(cls: type) -> bool:
    """Whether ``cls`` is an RMSNorm with transformers' standard arithmetic: its ``forward`` has
    ``LlamaRMSNorm.forward``'s source and it keeps ``weight`` and ``variance_epsilon``."""
    src = _source(getattr(cls, "forward", None))
    return bool(src) and src == _standard_source()


def fast_rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The standard RMSNorm through the kernel (module docstring), else the class's own forward."""
    w = self.weight
    if (hidden_states.dtype == w.dtype and w.dtype in DTYPES and hidden_states.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        return self._moe_kernel.rms_norm(hidden_states, w, float(self.variance_epsilon))
    return super(type(self), self).forward(hidden_states)


def _fast_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward is ``fast_rms_forward`` (one per class, kept)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Fast{cls.__name__}", (cls,), {"forward": fast_rms_forward,
                                                              "__module__": cls.__module__})
    return _CLASSES[cls]


def use_fast_norms(model: torch.nn.Module) -> int:
    """Route ``model``'s standard RMSNorm modules on the CPU through the kernel (module docstring); returns how many.
    Nothing changes without the kernel or on another device."""
    kernel = native()
    if kernel is None or not hasattr(kernel, "rms_norm"):
        return 0
    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (isinstance(w, torch.Tensor) and w.dim() == 1 and w.device.type == "cpu"
                and hasattr(mod, "variance_epsilon") and is_standard(type(mod))):
            mod._moe_kernel = kernel
            mod.__class__ = _fast_class(type(mod))  # a class swap: no bound method, no reference cycle
            n += 1
    return n
