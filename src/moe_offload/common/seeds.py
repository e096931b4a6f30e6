"""The one seed mapping of sampled generation (``generate --seed``, the server's ``seed`` field).

A seed is an integer ``s`` in ``[0, 2**32 - 1]``; sampling draws from ``torch.Generator().manual_seed(s)`` (CPU), so
distinct seeds give distinct generator states and the same seed the same tokens. Anything outside the range is
refused with one message: torch would silently keep only the low 32 bits of a seed (its CPU generator is an
mt19937 with a 32-bit seed; a negative seed is first wrapped modulo 2**64), so ``0`` and ``2**32`` — or ``-1`` and
``2**64 - 1`` — would share a sequence, and a seed outside 64 bits would fail deep inside the sampler.
"""

from __future__ import annotations

from ..errors import MoeOffloadError

SEED_MIN = 0
SEED_MAX = 2**32 - 1


def seed_problem(value) -> str | None:
    """The one-line reason ``value`` is not a valid seed, or None when it is (booleans are not integers)."""
    if isinstance(value, bool) or not isinstance(value, int) or not SEED_MIN <= value <= SEED_MAX:
        return f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {value}"
    return None


def check_seed(value: int | None) -> int | None:
    """``value`` itself when it is None or a valid seed.

    Raises:
        MoeOffloadError: outside ``[SEED_MIN, SEED_MAX]`` (see the module docstring).
    """
    if value is None:
        return None
    problem = seed_problem(value)
    if problem:
        raise MoeOffloadError(problem)
    return value


def make_generator(seed: int | None):
    """A CPU ``torch.Generator`` seeded with ``seed`` (checked by ``check_seed``), or None for no seed."""
    if check_seed(seed) is None:
        return None
    import torch

    return torch.Generator().manual_seed(seed)
