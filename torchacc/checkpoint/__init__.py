"""Checkpoints: TorchAcc's per-rank files (``files.py``: ``torchacc.save`` / ``load``), native sharded
checkpoints on torch.distributed.checkpoint (``dcp.py``), what a sharded model and its optimizer hold
(``state.py``, ``optimizer.py``), offline tools that need no process group (``offline/``) and the file
formats they write (``_format/``). Loading runs no code from a file by default (``_safe_load.py``).
"""
