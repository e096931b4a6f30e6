"""Architectures (``registry``), checkpoint loading (``loader``) and tiny test checkpoints (``tiny``); the
block-diffusion loop is ``generation.diffusion``.

Importing this package registers LLaDA2-MoE (``llada2_moe``, not in transformers) with transformers' Auto classes
and checkpoint conversion mapping, so every entry point that loads a checkpoint can read one.
"""

from . import llada2_moe  # noqa: F401  (registers model_type "llada2_moe")
