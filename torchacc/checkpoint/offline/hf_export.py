"""Export consolidated weights as a Hugging Face ``save_pretrained``-style directory, tensor by tensor.

``AutoModelForCausalLM.from_pretrained(output_dir)`` loads the result. The weights are read from
per-rank shards, a consolidated file, a native (DCP) checkpoint or an in-memory state dict, and
written as safetensors files (several, with an index, past ``max_shard_size``) one tensor at a
time, so exporting from files needs memory for about one tensor, not the model.
"""

import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._utils.fs import temp_path
from ..._utils.tied import tied_names
from .._format.safetensors_writer import StreamingSafetensorsWriter
from .consolidate import MODEL_PATTERN
from .shard_set import ShardSet, canonical_name

__all__ = ["export_hf"]

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _dict_source(state: dict[str, torch.Tensor]) -> tuple[Layout, Callable[[str], torch.Tensor]]:
    aliases = tied_names(state.items())  # a tied weight is written once: from_pretrained ties it again
    original = {canonical_name(key): key for key in state if key not in aliases}
    layout: Layout = {name: (tuple(state[key].shape), state[key].dtype) for name, key in original.items()}
    return layout, lambda key: state[original[key]]


def _shard_source(pattern: str, verify: bool) -> tuple[Layout, Callable[[str], torch.Tensor]]:
    shards = ShardSet(pattern, section="model", verify=verify)
    aliases = shards.aliases()
    items = {item.out_path[0]: item for item in shards.items if item not in aliases}
    return {k: (i.shape, i.dtype) for k, i in items.items()}, lambda key: shards.full_tensor(items[key])


def _dcp_source(path: str) -> tuple[Layout, Callable[[str], torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    layout: Layout = {
        key.removeprefix("model/"): (tuple(meta.size), meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)
    }

    def read(key: str) -> torch.Tensor:
        shape, dtype = layout[key]
        box = {f"model/{key}": torch.empty(shape, dtype=dtype)}
        dcp.load(box, checkpoint_id=path, no_dist=True)
        return box[f"model/{key}"]

    return layout, read


def _source(src: Any, pattern: str, verify: bool) -> tuple[Layout, Callable[[str], torch.Tensor]]:
    if isinstance(src, dict):
        return _dict_source(src.get("model", src))
    src = os.fspath(src)
    if os.path.isfile(os.path.join(src, ".metadata")):
        return _dcp_source(src)
    if os.path.isdir(src):
        return _shard_source(os.path.join(src, pattern), verify)
    if os.path.isfile(src):
        data = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
        return _dict_source(data.get("model", data))
    raise ValueError(
        f"src={src!r} is neither a state dict, a consolidated file, a directory of rank shards nor a DCP checkpoint"
    )


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"max_shard_size={size!r} is not a size; use bytes or a string such as '5GB' or '500MB'")


def _groups(layout: Layout, limit: int) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for key, (shape, dtype) in layout.items():
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        if group and size + num_bytes > limit:
            yield group
            group, size = [], 0
        group.append(key)
        size += num_bytes
    yield group


_INDEX = "model.safetensors.index.json"

# How a checkpoint gets the config.json that an export needs, for the errors that find none.
_SAVE_CONFIG_HINT = (
    "or save the config beside the shards when saving them (on rank 0: model.config.save_pretrained(ckpt_dir), "
    "as examples/train_gpt2.py --save_dir does)"
)


def _require_transformers(what: str) -> Any:
    """Import and return ``transformers``, which ``what`` (a function or a CLI flag) needs.

    Raises:
        ImportError: transformers cannot be imported; the message says to install ``torchacc[hf]``.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"{what} needs transformers, which cannot be imported ({exc}); install it with: pip install 'torchacc[hf]'"
        ) from exc
    return transformers


def _config_problem(path: str, given: str) -> str | None:
    """Why the local ``path`` holds no model config, worded with ``given`` (how the caller named it), or None.

    ``path`` must be a ``config.json`` file or a directory holding one. The file's content is left to
    ``AutoConfig``, whose errors name it.
    """
    if os.path.isdir(path):
        return None if os.path.isfile(os.path.join(path, "config.json")) else f"no config.json in {given}"
    return None if os.path.exists(path) else f"{given} does not exist"


def _load_config(config_or_model: Any, transformers: Any) -> Any:
    config = getattr(config_or_model, "config", config_or_model)
    if isinstance(config, transformers.PretrainedConfig):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(
            f"config_or_model must be a transformers config, a model or the path of a config.json (or of a "
            f"directory holding one), got an object of type {type(config).__name__!r}"
        )
    path = os.fspath(config)
    problem = _config_problem(path, f"config_or_model={path!r}")
    if problem:
        raise ValueError(
            f"export_hf needs the model's config: {problem}; pass the model, its transformers config, or the path "
            f"of a config.json (or of a directory holding one), {_SAVE_CONFIG_HINT}"
        )
    return transformers.AutoConfig.from_pretrained(path)


def _weight_files(directory: str) -> set[str]:
    """The safetensors files of an export in ``directory``: model.safetensors and those its index names."""
    names = {"model.safetensors"} if os.path.isfile(os.path.join(directory, "model.safetensors")) else set()
    try:
        with open(os.path.join(directory, _INDEX)) as f:
            names |= {n for n in json.load(f)["weight_map"].values() if os.path.basename(n) == n}
        names.add(_INDEX)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {n for n in names if os.path.isfile(os.path.join(directory, n))}


def _replace_own_files(staging: str, output_dir: str) -> None:
    """Move the finished export's files into ``output_dir`` one by one, then drop the previous export's weight
    files that the new one did not replace (from_pretrained would prefer a stale model.safetensors)."""
    stale = _weight_files(output_dir)
    for name in sorted(os.listdir(staging)):
        os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        stale.discard(name)
    for name in stale:
        os.remove(os.path.join(output_dir, name))


def export_hf(
    src: Any,
    output_dir: str | os.PathLike[str],
    config_or_model: Any,
    *,
    max_shard_size: int | str = "5GB",
    pattern: str = MODEL_PATTERN,
    verify: bool = True,
    overwrite: bool = False,
) -> str:
    """Write ``src``'s weights and the model config as a directory ``from_pretrained`` loads.

    Args:
        src: a directory of rank shard files (``pattern``), a consolidated ``.pth`` file, a checkpoint
            directory written by ``save_checkpoint``, or a state dict.
        output_dir: a new (or empty) directory; it appears only when complete. With ``overwrite`` it may
            hold other files (a tokenizer, logs, checkpoints): only the export's own files are replaced
            (``config.json``, the safetensors files and their index), and weight files of an earlier export
            that the new one does not rewrite are removed; nothing else is touched.
        config_or_model: a ``transformers`` config, a model (its ``.config`` is used) or the local path of a
            ``config.json`` or of a directory holding one (such as ``src``, when the config was saved beside the
            shards with ``model.config.save_pretrained(ckpt_dir)``).
        max_shard_size: bytes, or a string such as ``"5GB"``; larger exports are split with an index file.
        pattern: the shard file glob inside a ``src`` directory.
        verify: check shard checksums first.
        overwrite: write into an existing, non-empty ``output_dir`` (its files are replaced only once the
            new ones are complete).

    Returns:
        ``output_dir``.

    Raises:
        ValueError: ``output_dir`` is not empty (without ``overwrite``), ``config_or_model`` is a path that
            does not exist or a directory without a ``config.json``, ``src`` is not recognised, or a shard-set
            problem.
        ImportError: transformers is not installed (``pip install 'torchacc[hf]'``).

    Example:
        >>> torchacc.export_hf("ckpt/", "gpt2-hf", model)  # then AutoModelForCausalLM.from_pretrained("gpt2-hf")
    """
    transformers = _require_transformers("torchacc.export_hf")
    output_dir = os.fspath(output_dir)
    if not overwrite and os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ValueError(f"output_dir {output_dir!r} exists and is not empty; choose a new directory or remove it")
    config = _load_config(config_or_model, transformers)
    layout, read = _source(src, pattern, verify)
    groups = list(_groups(layout, _parse_size(max_shard_size)))
    staging = temp_path(output_dir)
    os.makedirs(staging)
    try:
        config.save_pretrained(staging)
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        for name, keys in zip(names, groups, strict=True):
            writer = StreamingSafetensorsWriter(os.path.join(staging, name), {k: layout[k] for k in keys})
            for key in keys:
                writer.write(key, read(key))
            writer.close()
        if len(groups) > 1:
            total = sum(torch.Size(s).numel() * d.itemsize for s, d in layout.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: n for n, ks in zip(names, groups, strict=True) for k in ks},
            }
            with open(os.path.join(staging, _INDEX), "w") as f:
                json.dump(index, f, indent=2)
        if os.path.isdir(output_dir) and os.listdir(output_dir):
            _replace_own_files(staging, output_dir)
        else:
            os.replace(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir
