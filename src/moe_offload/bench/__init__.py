"""The measurement harness: every ``moe-offload bench`` subcommand's implementation and the GPU checks, above the
engine they measure (nothing in the engine imports from here).

- ``decode``, ``diffusion``, ``formats``, ``graph``: ``bench decode``, ``bench diffusion``, ``bench formats``,
  ``bench graph``;
- ``serve_load``, ``serve_compare``, ``serve_replicas``: ``bench serve`` (the streaming load test, batch 1 vs
  continuous batching) and ``bench replicas``;
- ``link``: ``bench link`` (host->device copies and compute rates: the ``this-machine`` profile; ``--disk``:
  ``disk_link``; the model of the disk as a link: ``core.disk_link``);
- ``replay_speed``: ``bench replay`` (the simulator's speed);
- ``disk``, ``disk_measure``, ``disk_report``, ``disk_figure``: ``bench disk`` (each engine in a memory cgroup), what
  a run read, its table and plot; ``bench disk-figure`` (several runs in one picture);
- ``gguf_export``: ``export gguf`` (a checkpoint for llama.cpp, and its check);
- ``gpu_check``, ``gpu_check_graph``: ``bench gpu-check`` (``scripts/gpu-check.sh``).

The command line of all of them is ``cli/bench.py``, ``cli/bench_disk.py``, ``cli/serve.py`` and ``cli/export.py``.
"""
