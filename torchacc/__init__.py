"""torchacc: config-driven, one-call FSDP2 acceleration for PyTorch training.

The public surface, by job:

* configure: :class:`Config` and its sections (from code, a dict, YAML or the command line);
* accelerate: :func:`accelerate` shards a model and splits a dataloader in one call; :func:`train_step` is the
  forward and backward of one batch for every layout, pipelines included;
* precision: :class:`GradScaler` for fp16 on sharded gradients;
* inspect: :func:`memory_report` (a :class:`MemoryReport`) counts what this rank holds against the full model,
  and its measured peak (:func:`track_memory` on the CPU); :func:`accelerated_state` says what ``accelerate()``
  did to a model (its layout, mesh, device);
* plan: :func:`estimate_memory` (a :class:`MemoryEstimate`) predicts a rank's memory for any world size, on
  one CPU; ``torchacc plan`` picks the layout;
* watch: ``config.metrics`` records loss, tokens/s, MFU, memory and grad norm; :func:`log_metrics` adds your
  values, :func:`last_metrics` reads the last record (:mod:`torchacc.metrics`);
* checkpoint: :func:`save` / :func:`load` (TorchAcc's per-rank files), :func:`optim_state_dict` /
  :func:`load_optim_state_dict` (keyed by names), :func:`consolidate` and :func:`reshard_checkpoint`
  (offline, streaming);
* distribute: :mod:`torchacc.dist` (ranks, rendezvous, collectives, the sharding mechanism).

Importing torchacc changes nothing in torch and sets no environment variables.
"""

from . import dist
from ._utils.version import VERSION
from .checkpoint.dcp import save_checkpoint
from .checkpoint.dcp_load import latest_checkpoint, load_checkpoint, resume_latest
from .checkpoint.files import load, save
from .checkpoint.hf import export_hf
from .checkpoint.offline.consolidate import consolidate
from .checkpoint.offline.reshard import reshard_checkpoint
from .checkpoint.optimizer import load_optim_state_dict, optim_state_dict
from .config import (
    ComputeConfig,
    Config,
    CPConfig,
    DataLoaderConfig,
    DistConfig,
    DPConfig,
    FSDPConfig,
    MemoryConfig,
    MetricsConfig,
    PPConfig,
    TPConfig,
)
from .metrics import last_metrics, log_metrics
from .parallel.accelerate import accelerate
from .parallel.accelerated import AcceleratedState, accelerated_state
from .parallel.clip_grad import clip_grad_norm_
from .parallel.memory_report import MemoryReport, memory_report
from .parallel.memory_tracking import track_memory
from .parallel.meta_init import init_empty_weights
from .parallel.pipeline_step import train_step
from .parallel.precision import GradScaler
from .planning import MemoryEstimate, estimate_memory
from .strategy import FSDP2Strategy

__version__ = VERSION

__all__ = [
    "Config",
    "ComputeConfig",
    "MemoryConfig",
    "DistConfig",
    "DPConfig",
    "FSDPConfig",
    "TPConfig",
    "PPConfig",
    "CPConfig",
    "DataLoaderConfig",
    "MetricsConfig",
    "accelerate",
    "train_step",
    "accelerated_state",
    "AcceleratedState",
    "init_empty_weights",
    "memory_report",
    "MemoryReport",
    "track_memory",
    "estimate_memory",
    "MemoryEstimate",
    "GradScaler",
    "clip_grad_norm_",
    "log_metrics",
    "last_metrics",
    "FSDP2Strategy",
    "save",
    "load",
    "optim_state_dict",
    "load_optim_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "resume_latest",
    "consolidate",
    "reshard_checkpoint",
    "export_hf",
    "dist",
]
