"""Small foundations shared by the subsystems, importing nothing of the package above ``errors``:

- ``seeds``: the one seed mapping of sampled generation;
- ``cache``: the user cache of built-in checkpoints (build once under a lock);
- ``progress``, ``threads``: phase lines and bars of long one-time builds, their intra-op thread count.
"""
