"""Offline resharding: the N per-rank files of a run become M files for a run of another world size.

Streams like consolidation (``consolidate.py``, whose writers it shares): each tensor's new pieces are
copied from the shard files, or rebuilt one tensor at a time where they are not byte ranges.
"""

import contextlib
import os
from typing import Any

from ..._utils.fs import publish, temp_path
from .._format.torch_writer import StreamingTorchWriter, TensorSlot
from ..state import FORMAT, is_sharded, local_slice
from ._checks import refuse_writing_into_source
from .consolidate import MODEL_PATTERN, OPTIM_PATTERN, plan_slots, progress_bar, write_item
from .shard_set import ShardSet, TensorItem, canonical_name

__all__ = ["reshard_checkpoint"]


def _resharded_metadata(shards: ShardSet, rank: int, num_shards: int) -> dict[str, Any]:
    mesh = {"shape": [num_shards], "dim_names": ["fsdp"], "coordinate": [rank]}
    tensors = {}
    for key, entry in shards.metadata.items():
        key = canonical_name(key)
        sharded = is_sharded(entry["placements"]) and len(entry["shape"]) > 0
        placements = ["shard:0"] if sharded else ["replicate"]
        offset, local = local_slice(tuple(entry["shape"]), placements, mesh["shape"], mesh["coordinate"])
        entry = {k: v for k, v in entry.items() if k != "mesh"}  # a tensor-parallel tensor's own mesh is gone
        tensors[key] = {**entry, "placements": placements, "offset": offset, "local_shape": local}
    meta = {"format": FORMAT, "world_size": num_shards, "rank": rank, "mesh": mesh, "tensors": tensors}
    return meta if shards.run_id is None else {**meta, "run_id": shards.run_id}  # still the run that trained it


def reshard_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    num_shards: int,
    verify: bool = True,
    progress: bool | None = None,
    sync_files: bool = True,
) -> list[str]:
    """Turn the N per-rank files in ``src`` into ``num_shards`` files in ``dst`` for a run of that world size.

    Both the model files (``rank-*-of-*-model.pth``) and, if present, the optimizer files
    (``rank-*-of-*-optim.pth``) are resharded, FSDP-style (dim 0, ``torch.chunk`` sizes), whatever the
    source layout (FSDP, HSDP, tensor parallel or FSDP x TP). A run with
    ``dist.fsdp.size == num_shards`` loads its file with
    ``model.load_state_dict(ckpt["model"], shard_metadata=ckpt["shard_metadata"])``.
    ``verify``, ``progress`` and ``sync_files`` are as in :func:`consolidate`.

    Returns:
        The paths written.

    Raises:
        ValueError: ``num_shards < 1``, ``dst`` is ``src``, no model shards in ``src`` or a shard-set problem.
    """
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    src, dst = os.fspath(src), os.fspath(dst)
    refuse_writing_into_source(src, dst, num_shards)
    sets = [ShardSet(os.path.join(src, MODEL_PATTERN), section="model", verify=verify, check_tensors_later=True)]
    if any(name.endswith("-optim.pth") for name in os.listdir(src)):
        optim = ShardSet(os.path.join(src, OPTIM_PATTERN), section="optimizer", verify=verify, check_tensors_later=True)
        sets.append(optim)
    os.makedirs(dst, exist_ok=True)
    finals, tmps = [], []
    try:  # every file of every section is complete and checked before the first one is published
        for shards in sets:
            kind = "model" if shards.section == "model" else "optim"
            names = [os.path.join(dst, f"rank-{r}-of-{num_shards}-{kind}.pth") for r in range(num_shards)]
            finals += names
            tmps += [temp_path(path) for path in names]
            _reshard_section(shards, tmps[-num_shards:], num_shards, progress, write_back=sync_files)
        for tmp, final in zip(tmps, finals, strict=True):
            publish(tmp, final, sync=sync_files)
    finally:
        for tmp in tmps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    return finals


def _reshard_section(
    shards: ShardSet, tmps: list[str], num_shards: int, progress: bool | None, *, write_back: bool
) -> None:
    """Write the ``num_shards`` resharded files of one section to ``tmps``."""
    aliases = shards.aliases()
    metas = [_resharded_metadata(shards, r, num_shards) for r in range(num_shards)]
    writers: list[tuple[StreamingTorchWriter, dict[TensorItem, TensorSlot]]] = []
    try:
        with shards.checking_tensors():
            for meta, tmp in zip(metas, tmps, strict=True):
                skeleton, slots = plan_slots(shards, aliases, meta)
                contents = {shards.section: skeleton, "shard_metadata": meta}
                writers.append((StreamingTorchWriter(tmp, contents, write_back=write_back), slots))
            for item in progress_bar(shards.items, "reshard", progress):
                if item in aliases:
                    continue
                # pieces that are not byte ranges (tensor-parallel dim-1 pieces) are rebuilt once, not once per file
                full = shards.full_tensor(item) if shards.byte_ranges(item) is None else None
                for meta, (writer, slots) in zip(metas, writers, strict=True):
                    write_item(writer, slots[item], shards, item, _rows(item, meta), full=full)
            for writer, _ in writers:
                writer.close()
    finally:
        for writer, _ in writers:
            writer.abort()


def _rows(item: TensorItem, meta: dict[str, Any]) -> tuple[int, int] | None:
    """The dim-0 rows of ``item`` that the resharded rank of ``meta`` holds; None: all of it."""
    if item.meta_key is None:
        return None
    entry = meta["tensors"][canonical_name(item.meta_key)]
    if not entry["offset"]:
        return None
    return entry["offset"][0], entry["offset"][0] + entry["local_shape"][0]
