"""The measurement harness: every ``moe-offload bench`` subcommand's implementation and the GPU checks, above the
engine they measure (nothing in the engine imports from here).

- ``cli``: the ``bench`` command group's options and runners;
- ``decode``, ``diffusion``, ``formats``, ``graph``: ``bench decode``, ``bench diffusion``, ``bench formats``,
  ``bench graph``;
- ``serve_load``, ``serve_compare``, ``serve_replicas``: ``bench serve`` (the streaming load test, batch 1 vs
  continuous batching) and ``bench replicas``;
- ``link``: ``bench link`` (host->device copies and compute rates: the ``this-machine`` profile; ``--disk``:
  ``disk_link``; the model of the disk as a link: ``core.disk_link``);
- ``replay_speed``: ``bench replay`` (the simulator's speed);
- ``gpu_check``, ``gpu_check_graph``: the GPU check (``scripts/gpu-check.sh``).
"""
