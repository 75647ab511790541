"""Read a set of per-rank checkpoint files, check it strictly, and rebuild full tensors one at a time.

A shard file is what ``torchacc.save(..., master_only=False)`` writes for one rank:
``{section: <state>, "shard_metadata": model.get_shard_metadata()}`` where ``section`` is
``"model"`` (a state dict) or ``"optimizer"`` (``torchacc.optim_state_dict(model, optimizer)``:
``{"state": {param name: {name: tensor}}, "param_groups": [...]}``). Files are memory-mapped, so
opening a set costs no memory; a full tensor is built only when asked for, or never: where the
pieces are contiguous byte ranges of the full tensor (dim-0 shards), ``byte_ranges`` says where they
lie in the files, so writers can copy them file to file.
"""

import contextlib
import glob
import math
import os
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ._file_ranges import FileRange, read_ranges
from ._storage_records import is_tensor_record, locate_storages
from .serialization import verify_file
from .sharded_state import FORMAT, parse_dtype

__all__ = ["ShardSet", "TensorItem", "canonical_name", "get_path"]


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


_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """``name`` without the segments that wrappers (torch.compile, checkpoint_wrapper, FSDP1) insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def get_path(obj: Any, path: tuple[str, ...]) -> Any:
    """``obj[path[0]][path[1]]...``."""
    for part in path:
        obj = obj[part]
    return obj


class ShardSet:
    """The files matching ``pattern``, one per rank, validated as a whole before anything is rebuilt.

    Args:
        pattern: a glob such as ``"ckpt/rank-*-of-*-model.pth"``.
        section: ``"model"`` or ``"optimizer"``.
        verify: check every file's CRC-32 (reads each file once; catches bit flips as well as truncation).
        check_tensors_later: with ``verify``, check only the small members now and leave the tensor
            data to ``checking_tensors()``, which overlaps it with the caller's work.

    Raises:
        ValueError: no file matches; a file is truncated, corrupt or not a shard file; ranks are
            missing, duplicated or outside the world size; world sizes are mixed; a tensor's shape or
            dtype disagrees with the metadata or with rank 0. Every message names the file(s) concerned.
    """

    def __init__(
        self, pattern: str, *, section: str = "model", verify: bool = True, check_tensors_later: bool = False
    ) -> None:
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"no checkpoint files match {pattern!r}; check the directory and the pattern")
        self.section = section
        by_rank: dict[int, tuple[str, Any]] = {}
        world_sizes: dict[int, str] = {}
        self._tensors_unchecked = verify and check_tensors_later
        for path in paths:
            data = self._open(path, verify)
            meta = data["shard_metadata"]
            world_sizes.setdefault(meta["world_size"], path)
            if len(world_sizes) > 1:
                (w0, p0), (w1, p1) = list(world_sizes.items())[:2]
                raise ValueError(
                    f"mixed world sizes: {p0} is from a {w0}-rank run but {p1} is from a {w1}-rank run; "
                    "keep one run's files per directory, or narrow the pattern"
                )
            if not 0 <= meta["rank"] < meta["world_size"]:
                raise ValueError(
                    f"{path}: rank {meta['rank']} does not belong to a {meta['world_size']}-rank checkpoint (ranks 0 "
                    f"to {meta['world_size'] - 1}); the file comes from another run: remove it or narrow the pattern"
                )
            if meta["rank"] in by_rank:
                raise ValueError(
                    f"duplicate rank {meta['rank']}: {by_rank[meta['rank']][0]} and {path}; keep one run's files per "
                    "directory, or narrow the pattern"
                )
            by_rank[meta["rank"]] = (path, data)
        self.world_size = next(iter(world_sizes))
        missing = sorted(set(range(self.world_size)) - set(by_rank))
        if missing:
            raise ValueError(
                f"missing rank(s) {missing} of a {self.world_size}-rank checkpoint: {len(paths)} file(s) match "
                f"{pattern!r}; copy the missing files next to the others"
            )
        self.paths = [by_rank[r][0] for r in range(self.world_size)]
        self._data = [by_rank[r][1] for r in range(self.world_size)]
        self.items = self._plan()
        for rank in range(self.world_size):
            self._check_rank(rank)
        for item in self.items:
            if item.meta_key is not None:
                self._check_tiling(item)
        self._records: list[dict[int, tuple[int, int, int]] | None] | None = None

    def _open(self, path: str, verify: bool) -> Any:
        if verify:
            verify_file(path, members=(lambda name: not is_tensor_record(name)) if self._tensors_unchecked else None)
        try:
            data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise ValueError(f"{path}: cannot be read as a torch checkpoint (truncated or corrupt?): {exc}") from None
        if not isinstance(data, dict) or self.section not in data or "shard_metadata" not in data:
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"{path}: not a torchacc {self.section} shard: expected keys {self.section!r} and 'shard_metadata', "
                f"found {found}; save shards as torchacc.save({{{self.section!r}: ..., 'shard_metadata': "
                "model.get_shard_metadata()}, path, master_only=False)"
            )
        meta = data["shard_metadata"]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{path}: 'shard_metadata' is not from model.get_shard_metadata() (format {FORMAT})")
        return data

    @property
    def metadata(self) -> dict[str, Any]:
        return self._data[0]["shard_metadata"]["tensors"]

    def _plan(self) -> list[TensorItem]:
        """Every tensor of rank 0's section, with how to rebuild it."""
        root = self._data[0][self.section]
        items: list[TensorItem] = []
        if self.section == "model":
            for key in root:
                entry = self.metadata.get(key)
                if entry is None:
                    raise ValueError(f"{self.paths[0]}: {key} is in the state dict but not in shard_metadata")
                sharded = any(p.startswith("shard:") for p in entry["placements"])
                shape, dtype = tuple(entry["shape"]), parse_dtype(entry["dtype"])
                items.append(TensorItem((key,), (canonical_name(key),), shape, dtype, key if sharded else None))
            return items
        if not isinstance(root, dict) or "state" not in root or "param_groups" not in root:
            raise ValueError(
                f"{self.paths[0]}: the optimizer section must come from torchacc.optim_state_dict(model, optimizer) "
                "(state keyed by parameter name)"
            )
        for name, state in root["state"].items():
            # checkpoint_wrapper strips its prefix from state_dict keys but not from parameter names.
            meta_key = name if name in self.metadata else canonical_name(name)
            entry = self.metadata.get(meta_key)
            if entry is None:
                raise ValueError(f"{self.paths[0]}: optimizer state for {name!r}, which is not a model parameter")
            for state_key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                sharded = (
                    any(p.startswith("shard:") for p in entry["placements"])
                    and list(value.shape) == entry["local_shape"]
                )
                shape = tuple(entry["shape"]) if sharded else tuple(value.shape)
                path = ("state", name, state_key)
                out_path = ("state", canonical_name(name), state_key)
                items.append(TensorItem(path, out_path, shape, value.dtype, meta_key if sharded else None))
        return items

    def _check_rank(self, rank: int) -> None:
        path, data = self.paths[rank], self._data[rank]
        tensors = data["shard_metadata"]["tensors"]
        for item in self.items:
            try:
                value = get_path(data[self.section], item.path)
            except (KeyError, TypeError):
                raise ValueError(f"{path}: {item.name} is missing (rank 0 has it)") from None
            expected = tuple(tensors[item.meta_key]["local_shape"]) if item.meta_key else item.shape
            if item.meta_key and tuple(tensors[item.meta_key]["shape"]) != item.shape:
                raise ValueError(
                    f"{path}: {item.name} has full shape {tensors[item.meta_key]['shape']} but rank 0 says "
                    f"{list(item.shape)}; the files come from different models"
                )
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected or value.dtype != item.dtype:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{path}: {item.name} is {got}, expected shape {expected} and dtype {item.dtype}")

    def _pieces(self, item: TensorItem) -> dict[tuple[int, ...], tuple[int, list[int]]]:
        """Distinct pieces of a sharded tensor: offset -> (rank holding it, local shape)."""
        pieces: dict[tuple[int, ...], tuple[int, list[int]]] = {}
        for rank, data in enumerate(self._data):
            entry = data["shard_metadata"]["tensors"][item.meta_key]
            pieces.setdefault(tuple(entry["offset"]), (rank, entry["local_shape"]))
        return pieces

    def _check_tiling(self, item: TensorItem) -> None:
        pieces = self._pieces(item)
        covered = sum(math.prod(shape) for _, shape in pieces.values())
        inside = all(
            o + n <= s
            for offset, (_, shape) in pieces.items()
            for o, n, s in zip(offset, shape, item.shape, strict=True)
        )
        if covered != math.prod(item.shape) or not inside:
            raise ValueError(
                f"{item.name}: the shards in {os.path.dirname(self.paths[0]) or '.'} do not tile its full shape "
                f"{list(item.shape)} (they cover {covered} of {math.prod(item.shape)} elements); corrupt metadata"
            )

    def full_tensor(self, item: TensorItem) -> torch.Tensor:
        """Rebuild ``item`` on the CPU: read from the files (or copied from the memory-mapped pieces)."""
        ranges = self.byte_ranges(item)
        if ranges is not None:  # read() rather than touch the mapping: no file pages join this process's RSS
            full = torch.empty(item.shape, dtype=item.dtype)
            read_ranges(ranges, full.reshape(-1).view(torch.uint8).numpy())
            return full
        if item.meta_key is None:
            return get_path(self._data[0][self.section], item.path).clone()
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
            pieces = [(0, 0)]
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
        """Rank 0's section under canonical names: plain values kept, tensors left as ``None`` to be filled."""
        root = self._data[0][self.section]
        if self.section == "model":
            return {item.out_path[0]: None for item in self.items}
        state = {
            canonical_name(name): {k: (None if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
            for name, values in root["state"].items()
        }
        groups = [{**g, "params": [canonical_name(n) for n in g["params"]]} for g in root["param_groups"]]
        return {"state": state, "param_groups": groups}

    def aliases(self) -> dict[TensorItem, TensorItem]:
        """Model tensors that share storage with an earlier one in rank 0's file (tied weights): item -> first."""
        if self.section != "model":
            return {}
        seen: dict[tuple, TensorItem] = {}
        aliases = {}
        for item in self.items:
            value = self._data[0]["model"][item.path[0]]
            ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
            if value.numel() and ident in seen:
                aliases[item] = seen[ident]
            else:
                seen.setdefault(ident, item)
        return aliases
