"""Offline tools over per-rank shard files, with no process group or GPU: the strict shard-set reader
(``shard_set.py``, checks in ``_checks.py``), consolidation (``consolidate.py``), resharding
(``reshard.py``) and Hugging Face export (``hf_export.py``); they stream, tensor by tensor."""
