"""The checkpoint half of ``FSDP2Strategy``: full or sharded files, rotating checkpoints, deferred optimizer restore.
No checkpoint code of its own: torch's state-dict API, ``torchacc.save`` / ``load``, the one DCP save and load,
``save_checkpoint``'s directory protocol (``max_num`` is its rotation) and ``export_hf``."""

import os
import shutil
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .._utils.fs import describe_os_error
from ..checkpoint.dcp import save_state
from ..checkpoint.dcp_load import load_checkpoint, load_dcp, read_checkpoint
from ..checkpoint.directory import require_latest
from ..checkpoint.files import load, save
from ..checkpoint.hf import export_hf
from ..checkpoint.state import require_whole_model
from ..checkpoint.writing import save_dcp
from ..distributed import collectives, env

__all__ = ["StrategyCheckpointMixin"]

_STEP_KEY = "__torchacc_global_step__"
_SCALER_KEY = "__torchacc_grad_scaler__"


class StrategyCheckpointMixin:
    """Checkpoint methods of ``FSDP2Strategy`` (see there for the constructor arguments they read)."""

    model: nn.Module | None
    state_dict_type: str
    checkpoint_io: Any
    global_step: int
    scaler: Any
    dataloader: Any
    _pending_optimizer_state: Any

    def _require_model(self) -> nn.Module:  # provided by FSDP2Strategy
        raise NotImplementedError

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state: full CPU tensors on rank 0 (other ranks get ``{}``) for ``state_dict_type="full"``,
        this rank's DTensor shards for ``"sharded"``. Every rank must call it (full gathers)."""
        full = self.state_dict_type != "sharded"
        if full:
            require_whole_model(self._require_model())
        options = StateDictOptions(full_state_dict=full, cpu_offload=full)
        return get_model_state_dict(self._require_model(), options=options)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's name for ``model_state_dict``."""
        return self.model_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str]) -> None:
        """Save ``checkpoint`` (e.g. ``{"state_dict": strategy.model_state_dict(), "epoch": 3}``).

        ``"full"``: one file written atomically by rank 0 (DTensors in it are gathered first).
        ``"sharded"``: a DCP directory every rank writes its shards into. Every rank must call it.
        """
        path = os.fspath(filepath)
        if self.checkpoint_io is not None:
            error = None
            if env.rank() == 0 or self.state_dict_type == "sharded":
                try:
                    self.checkpoint_io.save_checkpoint(checkpoint, filepath)
                except Exception as exc:  # every rank raises, instead of waiting in a barrier
                    error = f"{type(exc).__name__}: {exc}"
            collectives.raise_on_any_rank(error, what=f"checkpoint_io.save_checkpoint({path!r})")
        elif self.state_dict_type == "full":
            save(checkpoint, filepath, master_only=True, global_master=True)
        else:
            save_dcp(checkpoint, path, what=f"save_checkpoint({path!r})", unchanged="the previous version is intact")

    def load_checkpoint(self, filepath: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
        """Load a checkpoint written by ``save_checkpoint``; its ``"state_dict"`` goes into the model.

        Args:
            filepath: the file (``"full"``) or DCP directory (``"sharded"``).
            weights_only: load without running code from the file (see ``torchacc.load``); False only for a
                checkpoint you trust that holds other objects.

        Returns:
            The checkpoint dict (with ``"state_dict"`` as loaded).

        Raises:
            ValueError: a damaged file, or (with ``weights_only``) one that holds objects that would run code.
        """
        if self.checkpoint_io is not None:
            checkpoint = self.checkpoint_io.load_checkpoint(filepath)
        elif os.path.isdir(filepath):
            path = os.fspath(filepath)
            metadata = read_checkpoint(path, weights_only=weights_only)
            saved = {keys[0] for keys in (metadata.planner_data or {}).values()}
            model = self.model if "state_dict" in saved else None
            template = {} if model is None else {"state_dict": get_model_state_dict(model)}
            checkpoint = load_dcp(path, template, metadata, weights_only=weights_only, rebuild=True)
        else:
            checkpoint = load(filepath, weights_only=weights_only)
        if "state_dict" in checkpoint and self.model is not None:
            self.model.load_state_dict(checkpoint["state_dict"])
        return checkpoint

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Delete a checkpoint file or directory (rank 0 deletes; every rank raises if it fails)."""
        error = None
        if env.rank() == 0:
            try:
                if self.checkpoint_io is not None:
                    self.checkpoint_io.remove_checkpoint(filepath)
                elif os.path.isdir(filepath):
                    shutil.rmtree(filepath)
                elif os.path.exists(filepath):
                    os.remove(filepath)
            except Exception as exc:
                error = describe_os_error(exc, filepath)
        collectives.raise_on_any_rank(error, what=f"remove_checkpoint({os.fspath(filepath)!r})")

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Keep optimizer state (``checkpoint["optimizer"]`` or the state itself) to restore at the first
        ``optimizer_step``, once the optimizer exists and before it steps."""
        self._pending_optimizer_state = checkpoint.get("optimizer", checkpoint)

    def save_ckpt(
        self,
        model: nn.Module,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        max_num: int = 3,
        max_mem: float = 1000,
        client_state: dict[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        blocking: bool = True,
    ) -> Any:
        """Save a sharded checkpoint to ``save_dir/tag`` and keep at most ``max_num`` of them and ``max_mem`` GB.

        ``torchacc.save_checkpoint`` with the data position of ``process_dataloader``'s loader, the step count and
        the scaler; once it is published the oldest of the checkpoints it wrote are removed (never the newest).
        ``tag`` defaults to ``global_step<N>``; ``blocking=False`` writes in the background and returns a handle
        (see ``save_checkpoint``).

        Returns:
            The new checkpoint's path (or the handle).
        """
        extra = {**(client_state or {}), _STEP_KEY: self.global_step}
        if self.scaler is not None:
            extra[_SCALER_KEY] = self.scaler.state_dict()
        return save_state(
            save_dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            dataloader=self.dataloader,
            extra=extra,
            tag=tag or f"global_step{self.global_step}",
            keep=max(max_num, 1),
            max_bytes=max_mem * 1e9,
            blocking=blocking,
        )

    def load_ckpt(
        self,
        model: nn.Module,
        load_dir: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        weights_only: bool = True,
    ) -> tuple[str | None, dict[str, Any]]:
        """Load the latest complete checkpoint under ``load_dir`` (model, optimizer, scheduler, data position,
        random states). ``weights_only`` is as in ``torchacc.load_checkpoint``.

        Returns:
            ``(checkpoint path, client_state)``, or ``(None, {})`` when there is no checkpoint yet.

        Raises:
            FileNotFoundError: ``latest`` names a checkpoint that is missing or incomplete.
        """
        path = require_latest(load_dir)
        if path is None:
            return None, {}
        extra = load_checkpoint(
            path, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=self.dataloader,
            weights_only=weights_only,
        )  # fmt: skip
        self.global_step = extra.pop(_STEP_KEY, self.global_step)
        scaler_state = extra.pop(_SCALER_KEY, None)
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        return path, extra

    def save_model(self, model: nn.Module, tokenizer: Any, output_dir: str | os.PathLike[str]) -> None:
        """Write a Hugging Face ``save_pretrained`` directory (safetensors) of the live model: ``export_hf``.

        Every rank must call it; rank 0 writes. Other files in ``output_dir`` (a training log, a checkpoint
        folder) are left alone: only the export's own files and the tokenizer's are replaced.

        Raises:
            RuntimeError: on every rank, when rank 0 could not write (the message names the cause).
        """
        export_hf(model, output_dir, overwrite=True, tokenizer=tokenizer, what=f"save_model({os.fspath(output_dir)!r})")
