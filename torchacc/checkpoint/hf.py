"""Hugging Face export (``export_hf``): a ``from_pretrained`` directory from a live accelerated model or from files,
written as safetensors one tensor at a time (gathered one at a time): memory for about one tensor, not the model."""

import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._utils.fs import describe_os_error, temp_path
from .._utils.tied import tied_names
from ..distributed import env
from ..distributed.collectives import meet, raise_on_any_rank
from ._format.safetensors_writer import StreamingSafetensorsWriter
from .state import canonical_name, require_whole_model

__all__ = ["export_hf", "save_pretrained", "SAVE_CONFIG_HINT", "config_problem", "require_transformers"]

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
Source = tuple[Layout, Callable[[str], torch.Tensor | None]]
_INDEX = "model.safetensors.index.json"
# How a checkpoint gets the config.json that an export needs, for the errors that find none.
SAVE_CONFIG_HINT = (
    "or save the config beside the shards when saving them (on rank 0: model.config.save_pretrained(ckpt_dir), "
    "as examples/train_gpt2.py --save_dir does)"
)


def _dict_source(state: dict[str, torch.Tensor], aliases: dict[str, str] | None = None, read: Any = None) -> Source:
    """``state``'s tensors, each tied weight once (from_pretrained ties it again), under canonical names."""
    aliases = tied_names(state.items()) if aliases is None else aliases
    original = {canonical_name(k): k for k in state if k not in aliases and canonical_name(k) not in aliases}
    layout = {name: (tuple(state[k].shape), state[k].dtype) for name, k in original.items()}
    return layout, lambda name: (read or (lambda t: t))(state[original[name]])


def _live_source(model: nn.Module) -> Source:
    """Every rank gathers each tensor in turn (a collective); only rank 0 keeps it."""
    require_whole_model(model)

    def gather(value: torch.Tensor) -> torch.Tensor | None:
        value = value.full_tensor() if isinstance(value, DTensor) else value
        return value.detach().cpu() if env.rank() == 0 else None

    return _dict_source(model.state_dict(), tied_names(model.named_parameters(remove_duplicate=False)), gather)


def _source(src: Any, pattern: str, verify: bool) -> Source:
    if isinstance(src, nn.Module):
        return _live_source(src)
    if isinstance(src, dict):
        return _dict_source(src.get("model", src))
    src = os.fspath(src)
    if os.path.isfile(os.path.join(src, ".metadata")):
        from .dcp_load import dcp_source

        return dcp_source(src)
    if os.path.isdir(src):
        from .offline.shard_set import ShardSet

        shards = ShardSet(os.path.join(src, pattern), section="model", verify=verify)
        aliases = shards.aliases()
        items = {item.out_path[0]: item for item in shards.items if item not in aliases}
        return {k: (i.shape, i.dtype) for k, i in items.items()}, lambda key: shards.full_tensor(items[key])
    if os.path.isfile(src):
        data = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
        return _dict_source(data.get("model", data))
    raise ValueError(
        f"src={src!r} is neither a model, a state dict, a consolidated file, a directory of rank shards nor a "
        "save_checkpoint checkpoint"
    )


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    text = size.strip().upper()
    for unit, factor in units.items():
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


def require_transformers(what: str) -> Any:
    """Import ``transformers``, which ``what`` (a function or a CLI flag) needs; the error says what to install."""
    try:
        import transformers
    except ImportError as exc:
        fix = "install it with: pip install 'torchacc[hf]'"
        raise ImportError(f"{what} needs transformers, which cannot be imported ({exc}); {fix}") from exc
    return transformers


def config_problem(path: str, given: str) -> str | None:
    """Why the local ``path`` (a ``config.json`` or a directory holding one) holds no model config, or None."""
    if os.path.isdir(path):
        return None if os.path.isfile(os.path.join(path, "config.json")) else f"no config.json in {given}"
    return None if os.path.exists(path) else f"{given} does not exist"


def _load_config(config_or_model: Any, transformers: Any) -> Any:
    config = getattr(config_or_model, "config", config_or_model)
    if isinstance(config, transformers.PretrainedConfig):
        return config
    if not isinstance(config, str | os.PathLike):
        raise ValueError(
            f"config_or_model must be a transformers config, a model or the path of a config.json (or of a "
            f"directory holding one), got an object of type {type(config).__name__!r}"
        )
    path = os.fspath(config)
    if problem := config_problem(path, f"config_or_model={path!r}"):
        raise ValueError(
            f"export_hf needs the model's config: {problem}; pass the model, its transformers config, or the path "
            f"of a config.json (or of a directory holding one), {SAVE_CONFIG_HINT}"
        )
    return transformers.AutoConfig.from_pretrained(path)


def _weight_files(directory: str) -> set[str]:
    """The safetensors files of an export in ``directory``: model.safetensors and those its index names."""
    names = {"model.safetensors"}
    try:
        with open(os.path.join(directory, _INDEX)) as f:
            names |= {n for n in json.load(f)["weight_map"].values() if os.path.basename(n) == n} | {_INDEX}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {n for n in names if os.path.isfile(os.path.join(directory, n))}


def export_hf(
    src: Any,
    output_dir: str | os.PathLike[str],
    config_or_model: Any = None,
    *,
    max_shard_size: int | str = "5GB",
    pattern: str = "rank-*-of-*-model.pth",
    verify: bool = True,
    overwrite: bool = False,
    tokenizer: Any = None,
    what: str = "export_hf",
) -> str:
    """Write a model's weights and config as a directory ``from_pretrained`` loads.

    Args:
        src: the live accelerated model (every rank must call it then; rank 0 writes, with ``config.json`` and
            ``generation_config.json``), or, in one process: a directory of rank shard files (``pattern``), a
            consolidated ``.pth`` file, a checkpoint directory written by ``save_checkpoint``, or a state dict.
        output_dir: a new (or empty) directory; it appears only when complete. With ``overwrite`` it may hold
            other files (a tokenizer, logs, checkpoints): only the export's own files are replaced (``config.json``,
            the safetensors files and their index), and weight files of an earlier export that the new one does
            not rewrite are removed; nothing else is touched.
        config_or_model: a ``transformers`` config, a model (its ``.config`` is used) or the local path of a
            ``config.json`` or of a directory holding one; default: ``src``'s when ``src`` is a model.
        max_shard_size: bytes, or a string such as ``"5GB"``; larger exports are split with an index file.
        pattern: the shard file glob inside a ``src`` directory.
        verify: check shard checksums first.
        overwrite: write into an existing, non-empty ``output_dir``.
        tokenizer: saved beside the weights with its ``save_pretrained``.
        what: the operation, for the error of a live export.

    Returns:
        ``output_dir``.

    Raises:
        ValueError: ``output_dir`` is not empty (without ``overwrite``), no model config, ``src`` is not recognised,
            or a shard-set problem.
        ImportError: transformers is not installed (``pip install 'torchacc[hf]'``).
        RuntimeError: a live export that rank 0 could not write, on every rank.

    Example:
        >>> torchacc.export_hf(model, "gpt2-hf")  # every rank; then AutoModelForCausalLM.from_pretrained("gpt2-hf")
    """
    options = (max_shard_size, pattern, verify, overwrite, tokenizer)
    if not isinstance(src, nn.Module):
        return _export(src, os.fspath(output_dir), config_or_model, *options)
    meet(what, hint="call it on every rank, not under `if rank == 0:`: every rank sends its shards, rank 0 writes")
    error = None
    try:  # the checks first, on every rank, so that no rank starts gathering while another gave up
        require_transformers(what)
        _check_output(os.fspath(output_dir), overwrite)
    except (ValueError, ImportError) as exc:
        error = str(exc)
    raise_on_any_rank(error, what=what, error_type=ValueError)
    try:
        _export(src, os.fspath(output_dir), config_or_model or src, *options)
    except Exception as exc:  # rank 0's; every rank raises, instead of waiting in the next collective
        error = describe_os_error(exc, output_dir)
    raise_on_any_rank(error, what=what)
    return os.fspath(output_dir)


def _check_output(output_dir: str, overwrite: bool) -> None:
    if not overwrite and os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ValueError(f"output_dir {output_dir!r} exists and is not empty; choose a new directory or remove it")


def _export(
    src: Any, output_dir: str, config_or_model: Any, max_shard_size: Any, pattern: str, verify: bool, overwrite: bool,
    tokenizer: Any,
) -> str:  # fmt: skip
    transformers = require_transformers("torchacc.export_hf")
    _check_output(output_dir, overwrite)
    config = _load_config(config_or_model, transformers)
    layout, read = _source(src, pattern, verify)
    groups = list(_groups(layout, _parse_size(max_shard_size)))
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    names = names if len(names) > 1 else ["model.safetensors"]
    writes, staging, failed = env.rank() == 0 or not isinstance(src, nn.Module), temp_path(output_dir), []

    def attempt(write: Callable[..., Any], *args: Any) -> Any:
        # after a failed write rank 0 goes on gathering with the other ranks; the error is raised at the end
        if writes and not failed:
            try:
                return write(*args)
            except Exception as exc:
                failed.append(exc)
        return None

    try:
        attempt(_begin, staging, config, src)
        for name, keys in zip(names, groups, strict=True):
            writer = attempt(StreamingSafetensorsWriter, os.path.join(staging, name), {k: layout[k] for k in keys})
            for key in keys:
                tensor = read(key)  # a live model's: gathered on every rank, written on rank 0
                if writer is not None:
                    attempt(writer.write, key, tensor)
            if writer is not None:
                attempt(writer.close)
        if failed:
            raise failed[0]
        if writes:
            _finish(staging, output_dir, dict(zip(names, groups, strict=True)), layout, tokenizer)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def _begin(staging: str, config: Any, src: Any) -> None:
    os.makedirs(staging)
    config.save_pretrained(staging)
    if getattr(src, "generation_config", None) is not None and src.can_generate():
        src.generation_config.save_pretrained(staging)


def _finish(staging: str, output_dir: str, files: dict[str, list[str]], layout: Layout, tokenizer: Any) -> None:
    """Add the index and the tokenizer, then give the export its place: new, or over an earlier one's own files."""
    if len(files) > 1:
        total = sum(torch.Size(s).numel() * d.itemsize for s, d in layout.values())
        weight_map = {key: name for name, keys in files.items() for key in keys}
        with open(os.path.join(staging, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    if not (os.path.isdir(output_dir) and os.listdir(output_dir)):
        os.replace(staging, output_dir)
        return
    stale = _weight_files(output_dir)  # from_pretrained would prefer a stale model.safetensors to a new index
    for name in sorted(os.listdir(staging)):
        os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        stale.discard(name)
    for name in stale:
        os.remove(os.path.join(output_dir, name))


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """``model.save_pretrained`` of an accelerated model: :func:`export_hf` (every rank must call it).

    Raises:
        ValueError: before anything is written, for an argument that only transformers' own
            ``save_pretrained`` understands (a ``state_dict=``, a PEFT adapter...): call ``torchacc.export_hf``.
    """
    known = {"max_shard_size", "safe_serialization", "is_main_process", "push_to_hub"}
    if set(kwargs) - known or kwargs.get("safe_serialization", True) is not True or kwargs.get("push_to_hub"):
        raise ValueError(
            f"save_pretrained({', '.join(sorted(kwargs))}) on an accelerated model: its weights are sharded across "
            "ranks, so it saves through torchacc.export_hf(model, directory, max_shard_size=...) on every rank, which "
            "takes none of these arguments; call torchacc.export_hf, or save a consolidated state dict"
        )
    export_hf(model, save_directory, max_shard_size=kwargs.get("max_shard_size", "5GB"), overwrite=True,
              what=f"save_pretrained({os.fspath(save_directory)!r})")  # fmt: skip
