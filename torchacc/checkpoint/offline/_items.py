"""The tensors of a set of per-rank checkpoint files (``TensorItem``) and the paths to them in a state."""

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..state import canonical_name

__all__ = ["TensorItem", "canonical_name", "get_path"]


@dataclass(frozen=True)
class TensorItem:
    """One tensor of the checkpoint: where it sits in the state, and how its pieces combine."""

    path: tuple[str, ...]  # keys from the section's root, e.g. ("state", "lm_head.weight", "exp_avg")
    out_path: tuple[str, ...]  # the same with wrapper prefixes removed: where it goes in every output
    shape: tuple[int, ...]
    dtype: torch.dtype
    meta_key: str | None  # the shard_metadata entry it is sharded like; None when every rank has it whole

    @property
    def name(self) -> str:
        return ".".join(self.path) if self.path[0] != "state" else f"{self.path[1]}:{'.'.join(self.path[2:])}"

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def get_path(obj: Any, path: tuple[str, ...]) -> Any:
    """``obj[path[0]][path[1]]...``."""
    for part in path:
        obj = obj[part]
    return obj
