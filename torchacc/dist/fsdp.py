"""``torchacc.dist.fsdp``: sharding by class name (``torchacc.parallel.fsdp``) and TorchAcc's offline
consolidation helpers under their original home, ``torchacc.dist.fsdp.consolidate_sharded_model_checkpoints``.

The consolidation helpers are re-exported lazily, so that importing the distributed layer never imports
the checkpoint package.
"""

from typing import Any

from ..parallel.fsdp import check_units, is_wrapped, plan_units, resolve_module_classes, wrap_ddp, wrap_fsdp

__all__ = [
    "resolve_module_classes",
    "plan_units",
    "check_units",
    "wrap_fsdp",
    "wrap_ddp",
    "is_wrapped",
    "consolidate_sharded_model_checkpoints",
    "consolidate_sharded_optimizer_checkpoints",
]

_LAZY = ("consolidate_sharded_model_checkpoints", "consolidate_sharded_optimizer_checkpoints")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ..checkpoint.offline import consolidate

        return getattr(consolidate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
