"""The checkpoint half of ``FSDP2Strategy``: full or sharded files, rotation, deferred optimizer restore.

All of it is built on ``torchacc.save`` / ``load``, ``save_checkpoint`` / ``load_checkpoint``
(torch.distributed.checkpoint) and ``export_hf``; nothing here writes bytes its own way. Work that only
rank 0 does (writing, deleting) reports its failure to every rank (``raise_on_any_rank``), so no rank
waits for a rank 0 that gave up.
"""

import os
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from .._utils.fs import describe_os_error
from ..checkpoint import _checksums
from ..checkpoint._dir import describe_failure, is_marked
from ..checkpoint._safe_load import SafeEmptyLoadPlanner, SafeLoadPlanner, SafeReader
from ..checkpoint.dcp import save_checkpoint, save_dcp
from ..checkpoint.dcp_load import load_checkpoint, require_latest
from ..checkpoint.files import load, save
from ..checkpoint.state import gather_model
from ..distributed import collectives, env

__all__ = ["StrategyCheckpointMixin"]

_STEP_KEY = "__torchacc_global_step__"
_SCALER_KEY = "__torchacc_grad_scaler__"


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _full_state_on_rank0(model: nn.Module) -> dict[str, Any]:
    """Every tensor gathered (a collective: all ranks call it); rank 0 keeps CPU copies, the others ``{}``."""
    state = gather_model(model, keep=env.rank() == 0)
    return state if env.rank() == 0 else {}


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

    # --- state dicts -------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state: full CPU tensors on rank 0 (other ranks get ``{}``) for ``state_dict_type="full"``,
        this rank's DTensor shards for ``"sharded"``. Every rank must call it (full gathers)."""
        model = self._require_model()
        return model.state_dict() if self.state_dict_type == "sharded" else _full_state_on_rank0(model)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's name for ``model_state_dict``."""
        return self.model_state_dict()

    # --- one checkpoint --------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str]) -> None:
        """Save ``checkpoint`` (e.g. ``{"state_dict": strategy.model_state_dict(), "epoch": 3}``).

        ``"full"``: one file written atomically by rank 0 (DTensors in it are gathered first).
        ``"sharded"``: a DCP directory every rank writes its shards into. Every rank must call it.
        """
        if self.checkpoint_io is not None:
            error = None
            if env.rank() == 0 or self.state_dict_type == "sharded":
                try:
                    self.checkpoint_io.save_checkpoint(checkpoint, filepath)
                except Exception as exc:  # every rank raises, instead of waiting in a barrier
                    error = f"{type(exc).__name__}: {exc}"
            collectives.raise_on_any_rank(error, what=f"checkpoint_io.save_checkpoint({os.fspath(filepath)!r})")
            return
        if self.state_dict_type == "full":
            save(checkpoint, filepath, master_only=True, global_master=True)
            return
        path = os.fspath(filepath)
        save_dcp(checkpoint, path, what=f"save_checkpoint({path!r})")

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
            checkpoint = self._load_dcp(os.fspath(filepath), weights_only=weights_only)
        else:
            checkpoint = load(filepath, weights_only=weights_only)
        if "state_dict" in checkpoint and self.model is not None:
            self.model.load_state_dict(checkpoint["state_dict"])
        return checkpoint

    def _load_dcp(self, path: str, *, weights_only: bool) -> dict[str, Any]:
        _checksums.verify(path, full=True, what=f"load_checkpoint({path!r})")
        reader = SafeReader(path, weights_only=weights_only)
        top = {fqn[0] for fqn in reader.read_metadata().planner_data.values()}
        checkpoint: dict[str, Any] = {}
        try:
            if top - {"state_dict"}:
                planner = SafeEmptyLoadPlanner(top - {"state_dict"}, weights_only=weights_only)
                dcp.load(checkpoint, storage_reader=reader, planner=planner)
            if "state_dict" in top:
                template = {"state_dict": self._require_model().state_dict()}
                dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner(weights_only=weights_only))
                checkpoint["state_dict"] = template["state_dict"]
        except CheckpointException as exc:  # raised on every rank
            raise ValueError(f"load_checkpoint({path!r}) failed: {describe_failure(exc, path)}") from None
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

    # --- rotating checkpoints ----------------------------------------------------------------------

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
    ) -> str:
        """Save a sharded checkpoint to ``save_dir/tag`` and keep at most ``max_num`` of them and ``max_mem`` GB.

        The oldest complete checkpoints are removed first, only after the new one is complete, and
        the newest is never removed. ``tag`` defaults to ``global_step<N>``. The dataloader position
        of ``process_dataloader``'s loader is saved too.

        Returns:
            The new checkpoint's path.
        """
        extra = {**(client_state or {}), _STEP_KEY: self.global_step}
        if self.scaler is not None:
            extra[_SCALER_KEY] = self.scaler.state_dict()
        path = save_checkpoint(
            save_dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            dataloader=self.dataloader,
            extra=extra,
            tag=tag or f"global_step{self.global_step}",
        )
        error = None
        if env.rank() == 0:
            try:
                self._rotate(os.fspath(save_dir), keep=path, max_num=max_num, max_bytes=max_mem * 1e9)
            except OSError as exc:
                error = f"removing an old checkpoint: {describe_os_error(exc, exc.filename or save_dir)}"
        collectives.raise_on_any_rank(error, what=f"save_ckpt({os.fspath(save_dir)!r})")
        return path

    @staticmethod
    def _rotate(save_dir: str, *, keep: str, max_num: int, max_bytes: float) -> None:
        # Only checkpoints that save_checkpoint wrote (its marker names the directory) take part: a user's
        # own DCP export or other folder beside them is never counted, let alone deleted.
        complete = [
            os.path.join(save_dir, name)
            for name in os.listdir(save_dir)
            if not name.startswith(".")
            and os.path.isfile(os.path.join(save_dir, name, ".metadata"))
            and is_marked(os.path.join(save_dir, name))
        ]
        complete.sort(key=os.path.getmtime)
        sizes = {path: _dir_bytes(path) for path in complete}
        while len(complete) > 1 and (len(complete) > max_num or sum(sizes[p] for p in complete) > max_bytes):
            oldest = complete.pop(0)
            if os.path.samefile(oldest, keep):
                complete.append(oldest)
                break
            shutil.rmtree(oldest)

    def load_ckpt(
        self,
        model: nn.Module,
        load_dir: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        weights_only: bool = True,
    ) -> tuple[str | None, dict[str, Any]]:
        """Load the latest complete checkpoint under ``load_dir`` (model, optimizer, scheduler, data position).

        ``weights_only`` is as in ``torchacc.load_checkpoint``: False only for a checkpoint you trust whose
        ``client_state`` holds other objects.

        Returns:
            ``(checkpoint path, client_state)``, or ``(None, {})`` when there is no checkpoint yet.

        Raises:
            FileNotFoundError: ``latest`` names a checkpoint that is missing or incomplete.
        """
        path = require_latest(load_dir)
        if path is None:
            return None, {}
        extra = load_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            dataloader=self.dataloader,
            weights_only=weights_only,
        )
        self.global_step = extra.pop(_STEP_KEY, self.global_step)
        scaler_state = extra.pop(_SCALER_KEY, None)
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        return path, extra

    # --- export --------------------------------------------------------------------------------------

    def save_model(self, model: nn.Module, tokenizer: Any, output_dir: str | os.PathLike[str]) -> None:
        """Write a Hugging Face ``save_pretrained`` directory (safetensors) from the gathered full state.

        Every rank must call it; rank 0 writes. Other files in ``output_dir`` (a training log, a checkpoint
        folder) are left alone: only the export's own files and the tokenizer's are replaced.

        Raises:
            RuntimeError: on every rank, when rank 0 could not write (the message names the cause).
        """
        from ..checkpoint.offline.hf_export import export_hf

        state = _full_state_on_rank0(model)
        error = None
        if env.rank() == 0:
            try:
                export_hf(state, output_dir, model, overwrite=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(output_dir)
            except Exception as exc:  # every rank raises, instead of waiting in a barrier
                error = describe_os_error(exc, output_dir)
        collectives.raise_on_any_rank(error, what=f"save_model({os.fspath(output_dir)!r})")
