"""``moe-offload serve``: an OpenAI-compatible HTTP server over the offloaded engine.

- ``app``: the FastAPI application (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/stats``,
  ``/health``) and ``ServeState``;
- ``worker``: the single worker thread that runs queued requests one at a time (batch 1) with ``generate``'s loops;
- ``batch_worker``: the continuous-batching worker (``--max-batch``); ``batch_memory``: the batch's share of the plan;
- ``memory``: the memory plan that sizes the slot pool from a budget, the profile run, the CPU device-tier tracker;
- ``protocol``: OpenAI request schemas and error bodies;
- ``server``: start-up (load, plan, log) and uvicorn runners (the command line: ``cli/serve.py``).
"""
