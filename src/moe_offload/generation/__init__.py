"""Generation loops and their stats, over a model the loader built (``models.loader``):

- ``generate``: the autoregressive prefill/decode loop, batch 1 (``generate_ids``, ``run``), its ``RunStats``;
- ``batching``: continuous batching (``BatchDecoder``);
- ``diffusion``, ``diffusion_forward``, ``diffusion_result``: the block-diffusion loop, one step's forward with the
  block-prefix KV cache, per-block / per-request results;
- ``sampling``: the one sampler of every loop; ``report``: a run's stats as a dict, a table and notes.

Graph mode's loop is ``graph.decode``.
"""
