"""Offline tools over per-rank shard files, with no process group or GPU: the strict shard-set reader
(``shard_set.py``, checks in ``_checks.py``), consolidation (``consolidate.py``) and resharding (``reshard.py``);
they stream, tensor by tensor."""
