"""Checkpoints. Native sharded checkpoints on torch.distributed.checkpoint, with model and optimizer state through
torch's state-dict API: ``dcp.py`` saves (in the background too), ``dcp_load.py`` loads, ``directory.py`` publishes
(tags, ``latest``, rotation, the one writer), ``storage.py`` plugs into DCP (loading that runs no code, checksums),
``optimizer.py`` keys optimizer state by names, ``rng.py`` keeps the random states, ``hf.py`` exports to Hugging
Face. TorchAcc's per-rank files: ``files.py`` (``torchacc.save`` / ``load``), ``state.py`` (shard metadata),
``offline/`` (streaming consolidation and resharding, no process group) and the formats they write (``_format/``).
"""
