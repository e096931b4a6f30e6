"""Our native CPU kernels (issue 46): built from their C++ sources with torch's ``cpp_extension`` by the set-up
(``scripts/setup.sh``) or on first use, cached per torch version and source, and loaded without a compiler.

- ``routed_experts.cpp``: the routed experts of one MoE layer in one call from the slot pool
  (``routed_experts(x, slots, weights, gate_up, down, pair_out=None, portable=False)``, ``sum_pairs``,
  ``workspace_peak_bytes``); see the file for its arithmetic and why it is deterministic.
- ``linear_rows.cpp``: ``linear_rows(x, weight, bias=None, portable=False)``, the linears of a decode step
  (``runtime.fast_linear``), and ``kernel_path``.
- ``decode_attention.cpp``: ``decode_attention(q, k, v, mask=None, scale=1.0, portable=False)``, the attention of
  a decode step (``runtime.decode_attention``).
- ``router_forecast.cpp``: ``router_forecast(weight, x, n, k, portable=False)``, the cross-layer forecast of one
  decode token (``runtime.cross_layer``).
- ``rms_norm.cpp``: ``rms_norm(x, weight, eps, portable=False)``, transformers' standard RMSNorm of each row
  (``runtime.fast_norm``).
- ``expert_read.cpp``: ``read_expert(fds, direct, spans, pieces, staging, dst)``, one expert read from disk and
  copied into its destination without the interpreter lock (``runtime.disk_store``); ``expert_read.h`` shares that
  read with ``prefetch_queue.cpp``: ``PrefetchQueue``, the disk tier's prefetch queue read by a native worker thread
  that never takes the interpreter lock (``runtime.native_prefetch``).
- ``belady_victim.cpp``: ``belady_victim(score, last, resident, ran, crf, pinned, cur, num_experts,
  layer_cycle, half_life)``, probabilistic Belady's victim in one pass over the policy's arrays (``core.prob_belady``).
- ``belady_scores.cpp``: ``belady_scores(score, ran, probs, lo, hi, num_experts, first)``, probabilistic Belady's
  scores from a one-row forecast under the layer cycle, written in place (``core.prob_belady``).
- ``forecast_candidates.cpp``: ``forecast_candidates(probs, width, top_k, chances, gate_mode, used_scale,
  threshold)``, a forecast's top-k' prefetch candidates per layer with their chance of use and a cost gate's verdict
  (``core.prefetch_tasks.forecast_candidates``).
- ``vec.h``: the dot product, bfloat16 widening and axpy they share (an AVX2 + FMA path and a portable path, bit
  for bit the same); ``bindings.cpp``: the Python module.

``native()`` is the built module, or None when it cannot be had: no compiler, a failed build (the reason is kept
beside the cache entry, so later runs do not try again until ``build(force=True)``), not a CPU with the
extension's headers, or ``MOE_OFFLOAD_KERNELS=torch`` in the environment (the pure-torch path on purpose, e.g. to
compare). ``describe()`` says which experts path a run uses, in one line.

The cache is ``$MOE_OFFLOAD_KERNELS_DIR``, else ``~/.cache/moe-offload/kernels`` (not under
``$MOE_OFFLOAD_CACHE``, which holds the built-in models and which tests point elsewhere).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path

from ...errors import MoeOffloadError

SOURCES = ("bindings.cpp", "routed_experts.cpp", "linear_rows.cpp", "decode_attention.cpp", "router_forecast.cpp",
           "expert_read.cpp", "rms_norm.cpp", "ops.cpp", "belady_victim.cpp",
           "belady_scores.cpp", "forecast_candidates.cpp", "prefetch_queue.cpp")
#: included by the sources (part of the cache key, not compiled on their own)
HEADERS = ("vec.h", "gil.h", "expert_read.h")
#: compiler flags: optimised, and no contraction of a * b + c into one fused multiply-add behind the source's back
#: (the kernel's float operations, and so its results, are the ones the source writes)
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")
#: linker flags: OpenMP, which ``at::parallel_for`` (an inline template, compiled into our module) runs on in torch's
#: OpenMP builds; without it the kernels' loops ran on one thread whatever ``--threads`` said. At run time the
#: module shares the ``libgomp.so.1`` torch has already loaded (one thread pool, sized by ``torch.set_num_threads``)
LDFLAGS = ("-fopenmp",)
#: seconds a build takes on this project's 2-core machine (for the first-use message)
BUILD_REFERENCE_S = 45.0

_state: dict = {}


def kernels_dir() -> Path:
    """Where built kernels are kept (module docstring)."""
    env = os.environ.get("MOE_OFFLOAD_KERNELS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moe-offload" / "kernels"


def _entry() -> tuple[str, Path]:
    """``(module name, cache entry)`` for the installed torch and these sources."""
    import torch

    h = hashlib.sha256((torch.__version__ + " ".join(CFLAGS + LDFLAGS)).encode())
    for name in SOURCES + HEADERS:
        h.update((Path(__file__).parent / name).read_bytes())
    digest = h.hexdigest()[:12]
    return f"moe_offload_kernels_{digest}", kernels_dir() / f"torch-{torch.__version__}-{digest}"


def _so(entry: Path, name: str) -> Path | None:
    found = sorted(entry.glob(f"{name}*.so"))
    return found[0] if found else None


def _import(name: str, so: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build(force: bool = False, say=None):
    """Build the kernels into the cache (once; concurrent processes wait for one build) and return the module.

    Args:
        force: try again after a failed build (its recorded reason is removed first).
        say: told one line before a build starts (default: stderr).
    Raises:
        MoeOffloadError: the build failed (no compiler, a compile error: the message says which, in one line).
    """
    from ...common.cache import build_once

    name, entry = _entry()
    failed = entry.with_name(entry.name + ".failed")
    if force:
        failed.unlink(missing_ok=True)
    elif failed.exists():
        raise MoeOffloadError(f"the native kernels failed to build before: {failed.read_text().strip()}")
    say = say or (lambda m: print(f"moe-offload: {m}", file=sys.stderr, flush=True))

    def compile_into(tmp: Path) -> None:
        from torch.utils import cpp_extension

        bin_dir = str(Path(sys.executable).parent)  # the environment's ninja, when it is not on PATH
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        cpp_extension.load(name=name, sources=[str(Path(__file__).parent / s) for s in SOURCES],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(tmp), verbose=False)

    def announce():
        say(f"building the native CPU kernels into {entry} (once per torch version; about {BUILD_REFERENCE_S:.0f} s "
            "on a 2-core machine)")

    t0 = time.perf_counter()
    try:
        path = build_once(entry.name, lambda p: _so(p, name) is not None, compile_into, what="the native kernels",
                          announce=announce, cache=entry.parent)
    except Exception as e:  # a missing compiler or ninja, a compile error: recorded, and the fallback runs
        reason = " ".join(str(e).split())[-300:] or type(e).__name__
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(reason + "\n")
        raise MoeOffloadError(f"the native kernels did not build: {reason}") from None
    _state["build_s"] = time.perf_counter() - t0
    return _import(name, _so(path, name))


def native():
    """The kernels' module, built on first use if it is not yet; None when it cannot be had (module docstring).
    The outcome is remembered for the process."""
    if "module" in _state:
        return _state["module"]
    module, why = None, None
    if os.environ.get("MOE_OFFLOAD_KERNELS", "").lower() == "torch":
        why = "MOE_OFFLOAD_KERNELS=torch"
    else:
        try:
            name, entry = _entry()
            so = _so(entry, name)
            module = _import(name, so) if so is not None else build()
        except MoeOffloadError as e:
            why = str(e)
        except (OSError, ImportError) as e:
            why = f"the native kernels could not be loaded: {e}"
    _state["module"], _state["why"] = module, why
    return module


def _kernel_function(name: str, build: bool):
    """Function ``name`` of the kernels' module, or None when the kernels cannot be had; ``build`` False: None too
    when they are not built yet (the simulator, which should not start a build of minutes for them)."""
    if not build and "module" not in _state and os.environ.get("MOE_OFFLOAD_KERNELS", "").lower() != "torch":
        try:
            mod_name, entry = _entry()
        except (ImportError, OSError):
            return None
        if _so(entry, mod_name) is None:
            return None
    module = native()
    return None if module is None else getattr(module, name)


def belady_victim_kernel(build: bool = True):
    """``belady_victim`` of the kernels' module (``core.prob_belady.ProbabilisticBelady``'s ``victim_kernel``), or
    None when the kernels cannot be had (the policy then ranks in numpy, with the same victims); ``build`` as
    ``_kernel_function``'s."""
    return _kernel_function("belady_victim", build)


def belady_scores_kernel(build: bool = True):
    """``belady_scores`` of the kernels' module (``core.prob_belady.ProbabilisticBelady``'s ``scores_kernel``), or
    None when the kernels cannot be had (the policy then scores in numpy, the same scores); ``build`` as
    ``_kernel_function``'s."""
    return _kernel_function("belady_scores", build)


def forecast_candidates_kernel(build: bool = True):
    """``forecast_candidates`` of the kernels' module (``core.prefetch_queue.PrefetchScheduler``'s
    ``candidates_kernel``), or None when the kernels cannot be had (the candidates then come from numpy, the same
    ones); ``build`` as ``_kernel_function``'s."""
    return _kernel_function("forecast_candidates", build)


def describe() -> str:
    """Which routed-experts path this process runs, in one line (``generate``'s stats say it)."""
    module = native()
    if module is not None:
        return f"native routed-experts kernel ({module.kernel_path()})"
    return f"torch grouped GEMMs (the native kernel is not used: {_state.get('why')})"
