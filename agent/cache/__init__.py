"""The node-local dataset cache (docs/cache.md): whole files of a dataset's source kept on
the node's NVMe, behind a FUSE mount and an ``mgcache::`` fsspec file system.

The data path: :mod:`.source` (what misses read from), :mod:`.store` (the cache itself),
:mod:`.policy` and :mod:`.pattern` (pure: what to keep, which pattern the readers follow),
:mod:`.stats` (the counters and ``stats.json``).
"""
