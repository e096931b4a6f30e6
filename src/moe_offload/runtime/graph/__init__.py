"""Graph mode (``generate --graph``): the decode step compiled whole with ``torch.compile(fullgraph=True)``.

- ``cache``: the cache decisions as fixed-shape tensor ops (``GraphCache``);
- ``fetch_cache``: with prefetching, the Fetch and Compute slot states (``FetchingGraphCache``);
- ``engine``: the experts' custom ops over the slot pool (``GraphEngine``);
- ``predictor``: the predictor run inside the compiled step (``GraphPredictor``);
- ``prefetch``: the CPU prefetch worker beside the step (``GraphPrefetcher``);
- ``decode``: loading a model for graph mode and its decode loop (``load_graph``, ``GraphDecoder``).
"""
