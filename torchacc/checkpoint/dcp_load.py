"""Loading torchacc checkpoints: ``load_checkpoint``, ``resume_latest``, and ``load_dcp``, the one DCP loader
(the strategy's sharded files go through it too). See ``dcp.py`` for the layout, [Note: per-rank extra] and
[Note: pipeline checkpoints].
"""

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .._utils.logging import warn_once
from ..distributed import env
from . import storage
from .dcp import LATEST, gather_stages, layout_of
from .directory import latest_checkpoint, require_latest
from .optimizer import load_optim_state_dict, named_parameters
from .rng import set_rng_state
from .writing import wait_for_save

__all__ = ["load_checkpoint", "latest_checkpoint", "resume_latest", "read_checkpoint", "load_dcp", "dcp_source"]


def resume_latest(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    dataloader: Any = None,
    verify: bool = True,
    weights_only: bool = True,
) -> dict[str, Any] | None:
    """Load the newest complete ``save_checkpoint`` checkpoint under ``directory``, if there is one.

    The restart half of a training script: call it every time the script starts (every rank), after
    ``accelerate()`` and building the optimizer; under ``torchrun --max-restarts=N`` a crashed job then
    continues from its last complete checkpoint, with the data position and random states restored.

    Args:
        directory: the root given to ``save_checkpoint`` (it need not exist yet).
        model, optimizer, scheduler, dataloader, verify, weights_only: as in ``load_checkpoint``.

    Returns:
        The ``extra`` dict of the loaded checkpoint, or None when ``directory`` holds no checkpoint yet.

    Raises:
        FileNotFoundError: ``latest`` names a checkpoint that is missing or incomplete.
        ValueError: as ``load_checkpoint`` (a damaged file, a model that does not match).

    Example:
        >>> extra = torchacc.resume_latest("ckpt", model, optimizer, dataloader=loader) or {}
        >>> start = extra.get("step", 0)
    """
    wait_for_save()
    path = require_latest(directory)
    if path is None:
        return None
    options = {"scheduler": scheduler, "dataloader": dataloader, "verify": verify, "weights_only": weights_only}
    return load_checkpoint(path, model=model, optimizer=optimizer, **options)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    dataloader: Any = None,
    verify: bool = True,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint``, at any world size. Every rank must call it.

    The random states each rank saved are restored too (Python, NumPy, torch's CPU and accelerator generators)
    when the layout is the one that saved them, so that a resumed run draws what the uninterrupted one would have.

    Args:
        path: a checkpoint directory, or the root passed to ``save_checkpoint`` (its ``latest`` is loaded).
        model, optimizer, scheduler, dataloader: filled in place; each must have been saved.
        verify: check every file's CRC-32 against the checksums recorded at save (the ranks share the reading);
            False checks only the sizes.
        weights_only: load without running code from the files (see [Note: safe loading] in ``storage.py``);
            False only for checkpoints you trust that hold other objects (numpy arrays in ``extra``) or were
            written by torchacc before format 2.

    Returns:
        The ``extra`` dict this rank saved (see [Note: per-rank extra] in ``dcp.py``).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: a missing, truncated or corrupt file (named), the checkpoint lacks something asked for,
            holds keys this model does not have, or holds objects that would run code (with ``weights_only``).
    """
    wait_for_save()
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(
                f"no complete checkpoint at {path!r} (no .metadata, and no '{LATEST}' pointer to one); "
                "pass the directory given to save_checkpoint or one of its checkpoint-N subdirectories"
            )
        path = latest
    metadata = read_checkpoint(path, verify=verify, weights_only=weights_only)
    saved = metadata.state_dict_metadata
    model_state = get_model_state_dict(model)
    state: dict[str, Any] = {f"model/{k}": v for k, v in model_state.items()}
    others = _other_stages_keys(model, state)  # held by this model's other pipeline stages
    missing = sorted(k.removeprefix("model/") for k in state if k not in saved)
    unexpected = sorted(
        k.removeprefix("model/") for k in saved if k.startswith("model/") and k not in state and k not in others
    )
    if missing or unexpected:
        raise ValueError(f"{path}: the model does not match the checkpoint: missing {missing}, unexpected {unexpected}")
    if optimizer is not None:
        _require(saved, "optim_param_groups", path, "optimizer")
        params = named_parameters(model)
        for key, meta in saved.items():
            if key.startswith("optim/"):
                name = key.removeprefix("optim/").rpartition("/")[0]
                if f"model/{name}" in others:
                    continue
                state[key] = _template(params.get(name), meta, name, path)
        state["optim_param_groups"] = None
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            _require(saved, key, path, key)
            state[key] = None
    extra_key, rng_key = _extra_key(saved, path), f"rng/rank-{env.rank()}"
    state[extra_key] = None
    if rng_key in saved:
        state[rng_key] = state["torchacc"] = None
    load_dcp(path, state, metadata, weights_only=weights_only)

    def decoded(key: str, what: str) -> Any:
        return storage.decode(state[key], weights_only=weights_only, what=f"{path}: {what}")

    set_model_state_dict(model, {k: state[f"model/{k}"] for k in model_state}, options=StateDictOptions(strict=True))
    if optimizer is not None:
        groups = decoded("optim_param_groups", "optimizer groups")
        if others:  # a pipeline stage takes its own parameters from the groups of every stage
            groups = [{**g, "params": [n for n in g["params"] if f"model/{n}" not in others]} for g in groups]
        osd: dict[str, Any] = {"state": {}, "param_groups": groups}
        for key, value in state.items():
            if key.startswith("optim/"):
                name, _, state_key = key.removeprefix("optim/").rpartition("/")
                osd["state"].setdefault(name, {})[state_key] = value
        load_optim_state_dict(model, optimizer, osd)
    for key, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
        if obj is not None:
            obj.load_state_dict(decoded(key, f"{key} state"))
    if rng_key in saved:
        _restore_rng(decoded(rng_key, "random states"), decoded("torchacc", "format").get("layout"), model, path)
    return decoded(extra_key, "extra")


def read_checkpoint(path: str, *, verify: bool = True, weights_only: bool = True) -> Any:
    """Check the DCP directory ``path`` against its checksums (every rank must call it), then read its metadata
    without running code; a damaged file raises ValueError naming it."""
    storage.verify(path, full=verify, what=f"load_checkpoint({path!r})")
    try:
        return storage.SafeReader(path, weights_only=weights_only).read_metadata()
    except storage.UnsafeFileError:
        raise
    except Exception as exc:
        raise ValueError(
            f"{os.path.join(path, '.metadata')}: unreadable ({type(exc).__name__}: {exc}); the checkpoint is damaged: "
            "restore the file or load an earlier checkpoint"
        ) from None


def load_dcp(
    path: str, state: dict[str, Any], metadata: Any, *, weights_only: bool = True, rebuild: bool = False
) -> dict[str, Any]:
    """Fill ``state`` (templates: DTensors are loaded as laid out, ``None`` takes a non-tensor entry) from the DCP
    directory ``path`` (``metadata`` from :func:`read_checkpoint`); ``rebuild`` also fills in the top-level entries
    ``state`` has no template for, as saved. The one DCP loader. Every rank must call it.

    Raises:
        ValueError: a missing or truncated file (named), or entries that would run code.
    """
    reader = storage.SafeReader(path, weights_only=weights_only)
    planner = storage.SafeLoadPlanner(weights_only=weights_only, rebuild=rebuild)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as exc:  # raised on every rank
        short = storage.find_short_file(path, metadata)
        raise ValueError(f"load_checkpoint({path!r}) failed: {short or storage.describe_failure(exc, path)}") from None
    return state


def _restore_rng(rng: dict[str, Any], saved: str | None, model: nn.Module, path: str) -> None:
    """Restore this rank's random states if they were saved in the layout this job has: elsewhere (another world
    size, TP groups where there were none) they would replay nothing, and could differ where ranks must agree."""
    if saved == (current := layout_of(model)):
        set_rng_state(rng)
    else:
        warn_once(f"{path}: saved by {saved}, loaded by {current}: the ranks keep their own random states")


def _other_stages_keys(model: nn.Module, own: dict[str, Any]) -> set[str]:
    """The ``model/`` keys that the other pipeline stages of ``model`` hold (empty without a pipeline)."""
    stages = gather_stages(model, sorted(own)) or []
    return {key for keys in stages for key in keys} - set(own)


def _extra_key(saved: dict[str, Any], path: str) -> str:
    """The entry holding this rank's ``extra`` (see [Note: per-rank extra])."""
    own = f"extra/rank-{env.rank()}"
    if own in saved or "extra" in saved:
        return own if own in saved else "extra"  # "extra": format 1, one value for every rank
    if "extra/rank-0" not in saved:
        raise ValueError(
            f"{path}: holds no 'extra' entry, so torchacc.save_checkpoint did not write it; load a DCP checkpoint "
            "of your own with torch.distributed.checkpoint.load, or FSDP2Strategy.load_checkpoint"
        )
    warn_once(
        f"{path} was saved by fewer ranks than this job has: the ranks it did not have get rank 0's extra "
        "(RNG states, counters); re-seed them if they must differ"
    )
    return "extra/rank-0"


def _require(saved: dict[str, Any], key: str, path: str, what: str) -> None:
    if key not in saved:
        raise ValueError(f"{path}: no {what} state was saved in this checkpoint; do not pass {what}= to load it")


def _template(param: torch.Tensor | None, meta: Any, name: str, path: str) -> Any:
    """What DCP loads one optimizer state into: a tensor laid out like its parameter, or None for a non-tensor."""
    if param is None:
        raise ValueError(f"{path}: optimizer state for {name!r}, which is not a parameter of this model")
    if not isinstance(meta, TensorStorageMetadata):
        return None
    if tuple(meta.size) == tuple(param.shape):
        return torch.zeros_like(param, dtype=meta.properties.dtype)
    return torch.zeros(meta.size, dtype=meta.properties.dtype, device=param.device if meta.size else "cpu")


def dcp_source(path: str, prefix: str = "model/") -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Any]:
    """The tensors under ``prefix`` of a ``save_checkpoint`` directory, read one at a time without running code."""
    saved = storage.SafeReader(path).read_metadata().state_dict_metadata
    keys = {k.removeprefix(prefix): k for k, m in saved.items() if k.startswith(prefix)}
    tensors = {n: saved[k] for n, k in keys.items() if isinstance(saved[k], TensorStorageMetadata)}
    layout = {n: (tuple(meta.size), meta.properties.dtype) for n, meta in tensors.items()}

    def read(name: str) -> torch.Tensor:
        box = {keys[name]: torch.empty(layout[name][0], dtype=layout[name][1])}
        dcp.load(box, storage_reader=storage.SafeReader(path), planner=storage.SafeLoadPlanner(), no_dist=True)
        return box[keys[name]]

    return layout, read
