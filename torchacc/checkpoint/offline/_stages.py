"""The per-rank files of a pipeline run: the ranks of each stage group, and the groups' sections merged.

Under pipeline parallelism the shard metadata says which stage group a rank belongs to (``"pipeline": {"rank",
"size"}``, see [Note: shard metadata] in ``torchacc.checkpoint.state``): the ranks of one group hold the same
tensors, the groups different ones. A set of files without it is one group of every rank.
"""

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["stage_groups", "merged_metadata", "merged_optimizer"]


def stage_groups(paths: list[str], data: list[dict[str, Any]]) -> list[list[int]]:
    """The ranks of each pipeline stage group, in stage order: one group of every rank without a pipeline."""
    pipelines = [d["shard_metadata"].get("pipeline") for d in data]
    if all(p is None for p in pipelines):
        return [list(range(len(data)))]
    sizes = {None if p is None else p["size"] for p in pipelines}
    if len(sizes) > 1:
        raise ValueError(
            f"{paths[0]}: the files mix pipeline layouts ({sorted(map(str, sizes))} stage groups); keep one run's "
            "files per directory, or narrow the pattern"
        )
    size = next(iter(sizes))
    groups = [[r for r, p in enumerate(pipelines) if p["rank"] == stage] for stage in range(size)]
    empty = [stage for stage, ranks in enumerate(groups) if not ranks]
    if empty:
        raise ValueError(f"{paths[0]}: no file of pipeline stage group {empty[0]} of {size}; the set is incomplete")
    return groups


def merged_metadata(firsts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``shard_metadata["tensors"]`` of every group (``firsts``: each group's first file), first entry wins."""
    merged: dict[str, Any] = {}
    for data in firsts:
        for key, entry in data["shard_metadata"]["tensors"].items():
            merged.setdefault(key, entry)
    return merged


def merged_optimizer(roots: list[dict[str, Any]], rename: Callable[[str], str]) -> dict[str, Any]:
    """The groups' optimizer sections as one skeleton: their states side by side (tensors left as ``None``), the
    parameters of each param group in stage order; every name passed through ``rename``."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for root in roots:
        for name, values in root["state"].items():
            state.setdefault(rename(name), {k: (None if isinstance(v, torch.Tensor) else v) for k, v in values.items()})
        for index, group in enumerate(root["param_groups"]):
            params = [rename(n) for n in group["params"]]
            if index < len(groups):
                groups[index]["params"] += [n for n in params if n not in groups[index]["params"]]
            else:
                groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}
