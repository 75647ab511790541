"""The checks a set of per-rank shard files passes before anything is rebuilt from it or written.

Each file as it is opened: readable, a shard of the wanted section, and metadata with the structure
``model.get_shard_metadata()`` writes (see [Note: shard metadata]), so that no later step meets a
missing key. Then the set: one world size, one run, every rank exactly once; per rank, the tensors
rank 0 has, in the shapes and dtypes the metadata gives; per sharded tensor, pieces that tile it (in
``_tiling.py``); and no output that is one of the inputs. Every refusal is a ValueError naming the file(s) and the fix.
"""

import functools
import operator
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .._format.storage_records import is_tensor_record
from ..files import verify_file
from ..state import FORMAT, parse_dtype

if TYPE_CHECKING:
    from .shard_set import TensorItem

__all__ = [
    "check_metadata",
    "check_rank",
    "open_shard",
    "order_by_rank",
    "refuse_output_among_inputs",
    "refuse_writing_into_source",
]

_PLACEMENT = re.compile(r"replicate|shard:(\d+)|strided_shard:(\d+):[1-9]\d*")


def _save_call(section: str) -> str:
    return f"torchacc.save({{{section!r}: ..., 'shard_metadata': model.get_shard_metadata()}}, path, master_only=False)"


def open_shard(path: str, section: str, *, verify: bool, tensors_later: bool) -> dict[str, Any]:
    """Load one shard file memory-mapped and check its structure (see ``check_metadata``).

    Args:
        path: the file.
        section: ``"model"`` or ``"optimizer"``.
        verify: check the file's CRC-32 first.
        tensors_later: with ``verify``, check only the members that are not tensor data.
    """
    if verify:
        verify_file(path, members=(lambda name: not is_tensor_record(name)) if tensors_later else None)
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: cannot be read as a torch checkpoint (truncated or corrupt?): {exc}") from None
    if not isinstance(data, dict) or section not in data or "shard_metadata" not in data:
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{path}: not a torchacc {section} shard: expected keys {section!r} and 'shard_metadata', "
            f"found {found}; save shards as {_save_call(section)}"
        )
    meta = data["shard_metadata"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: 'shard_metadata' is not from model.get_shard_metadata() (format {FORMAT})")
    check_metadata(path, meta, section)
    return data


def check_metadata(path: str, meta: dict[str, Any], section: str) -> None:
    """Raise ValueError unless ``meta`` has every field, of the right type, that the offline tools read."""
    problem = _metadata_problem(meta)
    if problem is not None:
        raise ValueError(f"{path}: shard_metadata is damaged: {problem}; re-save the shards with {_save_call(section)}")


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _metadata_problem(meta: dict[str, Any]) -> str | None:
    for key in ("world_size", "rank", "tensors"):
        if key not in meta:
            return f"it has no {key!r}"
    for key in ("world_size", "rank"):
        if not _is_int(meta[key]):
            return f"{key!r} is {_show(meta[key])}, expected an int"
    if "run_id" in meta and not (isinstance(meta["run_id"], str) and meta["run_id"]):
        return f"'run_id' is {_show(meta['run_id'])}, expected a non-empty string"
    if "pipeline" in meta:
        pipe = meta["pipeline"]
        ok = isinstance(pipe, dict) and _is_int(pipe.get("rank")) and _is_int(pipe.get("size"))
        if not ok or not 0 <= pipe["rank"] < pipe["size"]:
            return f"'pipeline' is {pipe!r}, expected {{'rank': r, 'size': n}} with 0 <= r < n"
    if not isinstance(meta["tensors"], dict):
        return f"'tensors' is {type(meta['tensors']).__name__}, expected a dict"
    for key, entry in meta["tensors"].items():
        problem = _entry_problem(entry)
        if problem is not None:
            return f"tensors[{key!r}] {problem}"
    return None


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"is {type(entry).__name__}, expected a dict"
    for field in ("shape", "dtype", "placements", "offset", "local_shape"):
        if field not in entry:
            return f"has no {field!r}"
    for field in ("shape", "offset", "local_shape"):
        value = entry[field]
        if not isinstance(value, list | tuple) or not all(_is_int(n) and n >= 0 for n in value):
            return f"{field!r} is {value!r}, expected a list of ints >= 0"
    if not len(entry["shape"]) == len(entry["offset"]) == len(entry["local_shape"]):
        return "has 'shape', 'offset' and 'local_shape' of different lengths"
    placements, ndim = entry["placements"], len(entry["shape"])
    if not isinstance(placements, list | tuple) or not all(_is_placement(p, ndim) for p in placements):
        return (
            f"'placements' is {placements!r}, expected a list of 'replicate', 'shard:<dim>' and "
            f"'strided_shard:<dim>:<split factor>' (dim < {ndim})"
        )
    if "mesh" in entry and _mesh_problem(entry["mesh"], len(placements)) is not None:
        return f"'mesh' {_mesh_problem(entry['mesh'], len(placements))}"
    try:
        parse_dtype(entry["dtype"])
    except (ValueError, AttributeError):
        return f"'dtype' is {entry['dtype']!r}, expected a torch dtype name such as 'torch.float32'"
    return None


def _is_placement(placement: Any, ndim: int) -> bool:
    match = _PLACEMENT.fullmatch(placement) if isinstance(placement, str) else None
    dim = None if match is None else (match[1] or match[2])
    return match is not None and (dim is None or int(dim) < ndim)


def _mesh_problem(mesh: Any, num_placements: int) -> str | None:
    """What is wrong with a tensor's own ``"mesh"`` entry (tensor parallelism), or None."""
    if not isinstance(mesh, dict) or not isinstance(mesh.get("shape"), list | tuple):
        return f"is {mesh!r}, expected a dict with a 'shape' list"
    if not all(_is_int(n) and n >= 1 for n in mesh["shape"]) or len(mesh["shape"]) != num_placements:
        return f"has shape {mesh['shape']!r}, expected {num_placements} int(s) >= 1 (one per placement)"
    return None


def _run(run_id: str | None) -> str:
    return f"run {run_id!r}" if run_id is not None else "a run with no run id (saved before torchacc recorded one)"


def order_by_rank(pattern: str, files: Iterable[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """The files of one run's checkpoint in rank order; refuses anything but exactly one file per rank.

    Args:
        pattern: the glob the files matched (for the messages).
        files: (path, ``open_shard`` result); a lazy iterable stops at the first bad file.
    """
    by_rank: dict[int, tuple[str, dict[str, Any]]] = {}
    world_sizes: dict[int, str] = {}
    run_ids: dict[str | None, str] = {}
    num_files = 0
    for path, data in files:
        num_files += 1
        meta = data["shard_metadata"]
        world_sizes.setdefault(meta["world_size"], path)
        if len(world_sizes) > 1:
            (w0, p0), (w1, p1) = list(world_sizes.items())[:2]
            raise ValueError(
                f"mixed world sizes: {p0} is from a {w0}-rank run but {p1} is from a {w1}-rank run; "
                "keep one run's files per directory, or narrow the pattern"
            )
        run_ids.setdefault(meta.get("run_id"), path)
        if len(run_ids) > 1:
            (r0, p0), (r1, p1) = list(run_ids.items())[:2]
            raise ValueError(
                f"shards of different training runs: {p0} is from {_run(r0)} but {p1} is from {_run(r1)}; "
                "keep one run's files per directory, or narrow the pattern"
            )
        rank, world_size = meta["rank"], meta["world_size"]
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{path}: rank {rank} does not belong to a {world_size}-rank checkpoint (ranks 0 to {world_size - 1}); "
                "the file comes from another run: remove it or narrow the pattern"
            )
        if rank in by_rank:
            raise ValueError(
                f"duplicate rank {rank}: {by_rank[rank][0]} and {path}; keep one run's files per directory, or "
                "narrow the pattern"
            )
        by_rank[rank] = (path, data)
    world_size = next(iter(world_sizes))
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        raise ValueError(
            f"missing rank(s) {missing} of a {world_size}-rank checkpoint: {num_files} file(s) match {pattern!r}; "
            "copy the missing files next to the others"
        )
    return [by_rank[rank] for rank in range(world_size)]


def check_rank(path: str, data: dict[str, Any], section: str, items: "list[TensorItem]") -> None:
    """Raise ValueError unless this rank's file holds every tensor, shaped and typed as rank 0 and its metadata say."""
    tensors = data["shard_metadata"]["tensors"]
    for item in items:
        try:
            value = functools.reduce(operator.getitem, item.path, data[section])
        except (KeyError, TypeError):
            raise ValueError(f"{path}: {item.name} is missing (rank 0 has it)") from None
        if item.meta_key is not None and item.meta_key not in tensors:
            raise ValueError(
                f"{path}: shard_metadata has no entry for {item.meta_key} (rank 0's has); the files come from "
                "different models"
            )
        expected = tuple(tensors[item.meta_key]["local_shape"]) if item.meta_key else item.shape
        if item.meta_key and tuple(tensors[item.meta_key]["shape"]) != item.shape:
            raise ValueError(
                f"{path}: {item.name} has full shape {tensors[item.meta_key]['shape']} but rank 0 says "
                f"{list(item.shape)}; the files come from different models"
            )
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected or value.dtype != item.dtype:
            got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{path}: {item.name} is {got}, expected shape {expected} and dtype {item.dtype}")


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:  # also hard links and paths that differ only where the file system does not care (case)
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_output_among_inputs(out: str | os.PathLike[str], inputs: Iterable[str]) -> None:
    """Raise ValueError, before anything is written, if ``out`` is one of the shard files ``inputs``."""
    out = os.fspath(out)
    for path in inputs:
        if _same_file(out, path):
            raise ValueError(
                f"the output path {out!r} is the input shard file {path}: writing it would destroy the shards; "
                "choose another output path"
            )


def refuse_writing_into_source(src: str, dst: str, num_shards: int) -> None:
    """Raise ValueError, before anything is written, if resharding to ``num_shards`` writes into ``src`` itself."""
    if not _same_file(src, dst):
        return
    names = (f"rank-{r}-of-{num_shards}-{kind}.pth" for kind in ("model", "optim") for r in range(num_shards))
    replaced = [path for path in (os.path.join(src, name) for name in names) if os.path.exists(path)]
    harm = f"replace {', '.join(replaced)}" if replaced else "be mixed with the shards they are read from"
    raise ValueError(
        f"the output directory {dst!r} is the source directory {src!r}: the resharded files would {harm}; choose "
        f"another output directory, such as {os.path.join(src, f'resharded-{num_shards}')!r}"
    )
