"""torchacc: config-driven, one-call FSDP2 acceleration for PyTorch training.

The public surface, by job:

* configure: :class:`Config` and its sections (from code, a dict, YAML or the command line);
* accelerate: :func:`accelerate` shards a model and splits a dataloader in one call;
* precision: :class:`GradScaler` for fp16 on sharded gradients;
* distribute: :mod:`torchacc.dist` (ranks, rendezvous, collectives, the sharding mechanism).

Importing torchacc changes nothing in torch and sets no environment variables.
"""

from . import dist
from .accelerate import accelerate
from .config import ComputeConfig, Config, DataLoaderConfig, DistConfig, DPConfig, FSDPConfig, MemoryConfig
from .precision import GradScaler

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ComputeConfig",
    "MemoryConfig",
    "DistConfig",
    "DPConfig",
    "FSDPConfig",
    "DataLoaderConfig",
    "accelerate",
    "GradScaler",
    "dist",
]
