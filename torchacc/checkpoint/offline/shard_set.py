"""Read a set of per-rank checkpoint files, check it strictly, and rebuild full tensors one at a time.

A shard file is what ``torchacc.save(..., master_only=False)`` writes for one rank:
``{section: <state>, "shard_metadata": model.get_shard_metadata()}`` where ``section`` is
``"model"`` (a state dict) or ``"optimizer"`` (``torchacc.optim_state_dict(model, optimizer)``:
``{"state": {param name: {name: tensor}}, "param_groups": [...]}``). Files are memory-mapped, so
opening a set costs no memory; a full tensor is built only when asked for, or never: where the
pieces are contiguous byte ranges of the full tensor (dim-0 shards), ``byte_ranges`` says where they
lie in the files, so writers can copy them file to file. Pieces are blocks (``offset`` + ``local_shape``
in the metadata) on any dims, so tensor-parallel (dim-1) and FSDP x TP pieces rebuild the same way.

Files of a pipeline run (metadata with ``"pipeline"``) hold different tensors per stage group: every rank of a
group holds its group's tensors (checked as strictly as a run without a pipeline), and the set's tensors are the
groups' tensors in stage order, each rebuilt from the ranks of the group that holds it.
"""

import contextlib
import glob
import math
import os
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..._utils.tied import tied_names
from .._format.file_ranges import FileRange, read_ranges
from .._format.storage_records import is_tensor_record, locate_storages
from ..files import verify_file
from ..state import is_sharded, parse_dtype
from ._checks import check_rank, open_shard, order_by_rank
from ._items import TensorItem, canonical_name, get_path
from ._stages import merged_metadata, merged_optimizer, stage_groups
from ._tiling import check_tiling

__all__ = ["ShardSet", "TensorItem", "canonical_name", "get_path"]


class ShardSet:
    """The files matching ``pattern``, one per rank, validated as a whole before anything is rebuilt.

    Args:
        pattern: a glob such as ``"ckpt/rank-*-of-*-model.pth"``.
        section: ``"model"`` or ``"optimizer"``.
        verify: check every file's CRC-32 (reads each file once; catches bit flips as well as truncation).
        check_tensors_later: with ``verify``, check only the small members now and leave the tensor
            data to ``checking_tensors()``, which overlaps it with the caller's work.

    Attributes:
        world_size, paths: the run's world size, and its files in rank order.
        run_id: the run the files come from (see [Note: shard metadata]); None for files saved before run ids.
        items: every tensor of rank 0's section, with how to rebuild it.

    Raises:
        ValueError: no file matches; a file is truncated, corrupt, not a shard file or has damaged
            metadata; ranks are missing, duplicated or outside the world size; world sizes or run ids
            are mixed; a tensor's shape or dtype disagrees with the metadata or with rank 0. Every
            message names the file(s) concerned (see ``torchacc._shard_checks``).
    """

    def __init__(
        self, pattern: str, *, section: str = "model", verify: bool = True, check_tensors_later: bool = False
    ) -> None:
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"no checkpoint files match {pattern!r}; check the directory and the pattern")
        self.section = section
        self._tensors_unchecked = verify and check_tensors_later
        opened = ((p, open_shard(p, section, verify=verify, tensors_later=self._tensors_unchecked)) for p in paths)
        files = order_by_rank(pattern, opened)
        self.world_size = len(files)
        self.paths = [path for path, _ in files]
        self._data = [data for _, data in files]
        self.run_id: str | None = self._data[0]["shard_metadata"].get("run_id")
        self._stages = stage_groups(self.paths, self._data)
        self._holders: dict[tuple[str, ...], list[int]] = {}
        self.items = self._plan()
        for rank, (path, data) in enumerate(files):
            check_rank(path, data, section, [item for item in self.items if rank in self._holders[item.path]])
        tiled = set()  # an optimizer's states share their parameter's entry: one check each
        for item in self.items:
            if item.meta_key is not None and item.meta_key not in tiled:
                blocks = [(path, entry["offset"], entry["local_shape"]) for path, entry in self._entries(item)]
                check_tiling(item, blocks, os.path.dirname(self.paths[0]) or ".")
                tiled.add(item.meta_key)
        self._records: list[dict[int, tuple[int, int, int]] | None] | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        """The shard metadata of every tensor (of the first rank of each pipeline stage group)."""
        return merged_metadata([self._data[ranks[0]] for ranks in self._stages])

    def _plan(self) -> list[TensorItem]:
        """Every tensor of each stage group's first rank, in stage order, with the ranks that hold it."""
        items: list[TensorItem] = []
        for ranks in self._stages:
            for item in self._plan_rank(ranks[0]):
                if item.path not in self._holders:
                    self._holders[item.path] = ranks
                    items.append(item)
        return items

    def _plan_rank(self, rank: int) -> list[TensorItem]:
        """Every tensor of ``rank``'s section, with how to rebuild it."""
        root = self._data[rank][self.section]
        metadata = self._data[rank]["shard_metadata"]["tensors"]
        path = self.paths[rank]
        items: list[TensorItem] = []
        if self.section == "model":
            for key in root:
                entry = metadata.get(key)
                if entry is None:
                    raise ValueError(f"{path}: {key} is in the state dict but not in shard_metadata")
                sharded = is_sharded(entry["placements"])
                shape, dtype = tuple(entry["shape"]), parse_dtype(entry["dtype"])
                items.append(TensorItem((key,), (canonical_name(key),), shape, dtype, key if sharded else None))
            return items
        if not isinstance(root, dict) or "state" not in root or "param_groups" not in root:
            raise ValueError(
                f"{path}: the optimizer section must come from torchacc.optim_state_dict(model, optimizer) "
                "(state keyed by parameter name)"
            )
        for name, state in root["state"].items():
            # checkpoint_wrapper strips its prefix from state_dict keys but not from parameter names.
            meta_key = name if name in metadata else canonical_name(name)
            entry = metadata.get(meta_key)
            if entry is None:
                raise ValueError(f"{path}: optimizer state for {name!r}, which is not a model parameter")
            for state_key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                sharded = is_sharded(entry["placements"]) and list(value.shape) == entry["local_shape"]
                shape = tuple(entry["shape"]) if sharded else tuple(value.shape)
                path = ("state", name, state_key)
                out_path = ("state", canonical_name(name), state_key)
                items.append(TensorItem(path, out_path, shape, value.dtype, meta_key if sharded else None))
        return items

    def _entries(self, item: TensorItem) -> Iterator[tuple[str, dict[str, Any]]]:
        """(file, shard_metadata entry) of a sharded tensor, for every rank that holds it (its pipeline stage's)."""
        for rank in self._holders[item.path]:
            yield self.paths[rank], self._data[rank]["shard_metadata"]["tensors"][item.meta_key]

    def _pieces(self, item: TensorItem) -> dict[tuple[int, ...], tuple[int, list[int]]]:
        """Distinct non-empty pieces of a sharded tensor: offset -> (rank holding it, local shape). The pieces
        tile the tensor (``check_tiling``), so no two differ at one offset."""
        pieces: dict[tuple[int, ...], tuple[int, list[int]]] = {}
        for rank, (_, entry) in zip(self._holders[item.path], self._entries(item), strict=True):
            if math.prod(entry["local_shape"]):
                pieces.setdefault(tuple(entry["offset"]), (rank, entry["local_shape"]))
        return pieces

    def full_tensor(self, item: TensorItem) -> torch.Tensor:
        """Rebuild ``item`` on the CPU: read from the files (or copied from the memory-mapped pieces)."""
        ranges = self.byte_ranges(item)
        if ranges is not None:  # read() rather than touch the mapping: no file pages join this process's RSS
            full = torch.empty(item.shape, dtype=item.dtype)
            read_ranges(ranges, full.reshape(-1).view(torch.uint8).numpy())
            return full
        if item.meta_key is None:
            return get_path(self._data[self._holders[item.path][0]][self.section], item.path).clone()
        full = torch.empty(item.shape, dtype=item.dtype)
        for offset, (rank, shape) in self._pieces(item).items():
            piece = get_path(self._data[rank][self.section], item.path)
            full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].copy_(piece)
        return full

    @contextlib.contextmanager
    def checking_tensors(self, *, skip: Collection[tuple[str, str]] = ()) -> Iterator[None]:
        """Check the tensor data's CRC-32 (left by ``check_tensors_later``) in a thread while the body runs.

        Args:
            skip: (path, member name) of records the body checks itself (``copy_ranges(check_sources=True)``).

        Raises:
            ValueError: at exit, a corrupt file (as ``verify_file``); this takes precedence over an
                error of the body, which may only be its consequence.
        """
        if not self._tensors_unchecked:
            yield
            return
        with ThreadPoolExecutor(1, thread_name_prefix="torchacc-verify") as pool:
            done = pool.submit(self._check_tensor_records, set(skip))
            try:
                yield
            except BaseException:
                if done.exception() is not None:
                    raise done.exception() from None
                raise
            done.result()
        self._tensors_unchecked = False

    def _check_tensor_records(self, skip: set[tuple[str, str]]) -> None:
        for path in self.paths:
            verify_file(path, members=lambda name: is_tensor_record(name) and (path, name) not in skip)  # noqa: B023

    def byte_ranges(self, item: TensorItem, start: int = 0, stop: int | None = None) -> list[FileRange] | None:
        """Where bytes ``[start, stop)`` of ``item``'s full tensor (row-major) lie in the shard files.

        Returns:
            The ranges in order, or None when the pieces are not contiguous byte ranges of the full
            tensor (sharded on another dim, non-contiguous, or files whose layout is not understood);
            use ``full_tensor`` then.
        """
        stop = item.num_bytes if stop is None else stop
        sources = self._sources(item)
        if sources is None:
            return None
        ranges = []
        for begin, source in sources:
            lo, hi = max(start, begin), min(stop, begin + source.length)
            if lo < hi:
                whole = lo == begin and hi == begin + source.length
                offset = source.offset + lo - begin
                ranges.append(FileRange(source.path, offset, hi - lo, *((source.crc, source.member) if whole else ())))
        return ranges

    def _sources(self, item: TensorItem) -> list[tuple[int, FileRange]] | None:
        """(byte offset in the full tensor, file range) of every piece, in order; None if not contiguous."""
        if item.meta_key is None:
            pieces = [(0, self._holders[item.path][0])]
        else:
            row_bytes = math.prod(item.shape[1:]) * item.dtype.itemsize
            pieces = []
            for offset, (rank, shape) in sorted(self._pieces(item).items()):
                if any(offset[1:]) or tuple(shape[1:]) != item.shape[1:]:
                    return None  # not a dim-0 slab
                pieces.append((offset[0] * row_bytes if offset else 0, rank))
        sources, end = [], 0
        for begin, rank in pieces:
            source = self._file_range(rank, get_path(self._data[rank][self.section], item.path))
            if source is None or begin != end:
                return None
            sources.append((begin, source))
            end = begin + source.length
        return sources if end == item.num_bytes else None

    def _file_range(self, rank: int, tensor: torch.Tensor) -> FileRange | None:
        records = self._storage_records()[rank]
        if records is None or not tensor.is_contiguous():
            return None
        length = tensor.numel() * tensor.element_size()
        if length == 0:
            return FileRange(self.paths[rank], 0, 0)
        record = records.get(tensor.untyped_storage().data_ptr())
        if record is None:
            return None
        offset, size, crc, name = record
        skip = tensor.storage_offset() * tensor.element_size()
        if skip == 0 and length == size:
            return FileRange(self.paths[rank], offset, length, crc, name)
        return FileRange(self.paths[rank], offset + skip, length)

    def _storage_records(self) -> list[dict[int, tuple[int, int, int, str]] | None]:
        if self._records is None:
            self._records = [locate_storages(p, data) for p, data in zip(self.paths, self._data, strict=True)]
        return self._records

    def skeleton(self) -> Any:
        """The section under canonical names: plain values kept, tensors left as ``None`` to be filled; a pipeline
        run's stage groups merged (their states side by side, the parameters of each param group in stage order)."""
        if self.section == "model":
            return {item.out_path[0]: None for item in self.items}
        return merged_optimizer([self._data[ranks[0]][self.section] for ranks in self._stages], canonical_name)

    def aliases(self) -> dict[TensorItem, TensorItem]:
        """Model tensors that share storage with an earlier one in a file (tied weights): item -> first."""
        if self.section != "model":
            return {}
        by_key = {item.path[0]: item for item in self.items}
        tied = tied_names((key, self._data[self._holders[item.path][0]]["model"][key]) for key, item in by_key.items())
        return {by_key[alias]: by_key[owner] for alias, owner in tied.items()}
