"""The record: what one rank tallies between two records, and the record made from every rank's tallies.

A ``Recorder`` belongs to one accelerated model. Between records it only adds numbers on the host and keeps
references to the loss tensors of the current step: no collective, no host-device sync. On a logged step
(every ``every`` optimizer steps) each rank puts its tallies in one small float64 tensor, the ranks all-gather
it once, and every rank computes the same record from the gathered rows (``make_record``); rank 0 hands it to
the sinks. See docs/watching.md for what each value means.
"""

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import env
from ..parallel.clip_grad import grad_norm
from .counting import count_tokens, memory_peak

__all__ = ["Recorder", "make_record", "check_values", "KEYS"]

# The record's own keys, in the order the sinks show them.
KEYS = (
    "step",
    "loss",
    "tokens_per_second",
    "tokens_per_second_per_device",
    "step_seconds",
    "data_wait_seconds",
    "mfu",
    "memory_peak_bytes",
    "memory_peak_fraction",
    "grad_norm",
    "lr",
)
# The columns of one rank's row in the all-gather.
_LOSS, _HAS_LOSS, _TOKENS, _TOKEN_POSITIONS, _WAIT, _MEMORY, _CAPACITY = range(7)


def make_record(
    rows: list[list[float]],
    *,
    step: int,
    num_steps: int,
    seconds: float,
    num_ranks_per_batch: int,
    flops_per_token: float,
    attention_flops: float,
    peak_flops: float | None,
) -> dict[str, float]:
    """The record of ``num_steps`` steps that took ``seconds``, from every rank's row of tallies.

    Args:
        rows: one row per rank: the step's loss and whether it has one, tokens, tokens x sequence length, seconds
            waited for data, peak memory and capacity in bytes.
        step: the optimizer steps taken so far.
        num_steps: the steps since the last record.
        seconds: the wall time since the last record.
        num_ranks_per_batch: the ranks that read the same batches and count them alike: the world size over the
            data-parallel ranks (``tp x cp x pp``; see [Note: counting tokens] in counting.py).
        flops_per_token: ``6 x`` the trainable parameters.
        attention_flops: the attention FLOPs per token and unit of sequence length (``12 x layers x width``).
        peak_flops: one device's peak FLOP/s, or None (no MFU).

    Returns:
        The record: ``step`` and the values that could be computed (see ``KEYS``).
    """
    record: dict[str, float] = {"step": step}
    losses = [row[_LOSS] for row in rows if row[_HAS_LOSS]]
    if losses:
        record["loss"] = sum(losses) / len(losses)  # the ranks that share a batch hold the same loss
    tokens = sum(row[_TOKENS] for row in rows) / num_ranks_per_batch
    if tokens:
        num_devices = len(rows)
        record["tokens_per_second"] = tokens / seconds
        record["tokens_per_second_per_device"] = tokens / seconds / num_devices
        if peak_flops:
            positions = sum(row[_TOKEN_POSITIONS] for row in rows) / num_ranks_per_batch
            flops = flops_per_token * tokens + attention_flops * positions
            record["mfu"] = flops / (seconds * num_devices * peak_flops)
    record["step_seconds"] = seconds / num_steps
    record["data_wait_seconds"] = max(row[_WAIT] for row in rows) / num_steps
    record["memory_peak_bytes"] = int(max(row[_MEMORY] for row in rows))
    fractions = [row[_MEMORY] / row[_CAPACITY] for row in rows if row[_CAPACITY]]
    if fractions:
        record["memory_peak_fraction"] = max(fractions)
    return {key: record[key] for key in KEYS if key in record}


class Recorder:
    """Tallies of one accelerated model between records, and the record of every ``every``-th optimizer step.

    Args:
        params: the model's parameters (their gradients' global norm is the ``grad_norm``).
        every: optimizer steps between records.
        device: this rank's device (the all-gather runs there).
        num_ranks_per_batch: the ranks that read the same batches (``tp x cp x pp``).
        flops_per_token: ``6 x`` the trainable parameters.
        attention_flops: ``12 x layers x width``, or 0.
        peak_flops: one device's peak FLOP/s, or None.
        write: called on rank 0 with each record (the sinks).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        *,
        every: int,
        device: torch.device,
        num_ranks_per_batch: int,
        flops_per_token: float,
        attention_flops: float,
        peak_flops: float | None,
        write: Callable[[dict[str, Any]], None],
    ) -> None:
        self.params, self.every, self.device = params, every, device
        self.num_ranks_per_batch = num_ranks_per_batch
        self.flops_per_token, self.attention_flops, self.peak_flops = flops_per_token, attention_flops, peak_flops
        self.write = write
        self.param_ids = {id(p) for p in params}
        self.step = 0
        self.last: dict[str, Any] = {}
        self.pending: dict[str, Any] = {}  # torchacc.log_metrics values for the next record
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses, not yet read
        self._clip_norm: float | None = None  # what torchacc.clip_grad_norm_ returned for this step
        self._grad_norm: float | None = None
        self._tokens = self._token_positions = 0
        self._wait = 0.0
        self._since: float | None = None  # the start of the interval of the next record
        self._num_steps = 0

    # --- between records: host-side tallies only ----------------------------------------------------------

    def start(self) -> None:
        """Start the clock at the first batch or forward (not at set-up, which may load a checkpoint)."""
        if self._since is None:
            self._since = time.perf_counter()

    def read(self, batch: Any) -> tuple[int, int]:
        """``BatchObserver.read``: count the host batch's tokens."""
        return count_tokens(batch)

    def delivered(self, note: tuple[int, int], wait_seconds: float) -> None:
        """``BatchObserver.delivered``: add the batch's tokens and the wait for it."""
        if self._since is None:
            self._since = time.perf_counter() - wait_seconds
        self._tokens += note[0]
        self._token_positions += note[1]
        self._wait += wait_seconds

    def add_loss(self, loss: torch.Tensor) -> None:
        """Keep a micro-batch's loss (detached; read on logged steps only)."""
        self._losses.append(loss.detach())

    def note_clip(self, norm: float) -> None:
        """The norm ``torchacc.clip_grad_norm_`` computed for the coming step: the record reuses it."""
        self._clip_norm = norm

    def before_step(self) -> None:
        """Before the optimizer step: on a step to log, the gradient norm (unless clipping computed it)."""
        if (self.step + 1) % self.every == 0:
            self._grad_norm = self._clip_norm if self._clip_norm is not None else grad_norm(self.params)

    def after_step(self, lr: Any) -> None:
        """After the optimizer step: count it; every ``every``-th step, make and write the record."""
        self.step += 1
        self._num_steps += 1
        if self.step % self.every == 0:
            self._record(lr)
        self._losses.clear()
        self._clip_norm = None

    # --- a logged step ----------------------------------------------------------------------------------

    def _record(self, lr: Any) -> None:
        row = torch.zeros(7, dtype=torch.float64, device=self.device)
        if self._losses:
            row[_LOSS] = torch.stack([loss.float().mean() for loss in self._losses]).mean().to(row)
            row[_HAS_LOSS] = 1.0
        memory, capacity = memory_peak(self.device)
        row[_TOKENS:] = torch.tensor(
            [self._tokens, self._token_positions, self._wait, memory, capacity], dtype=torch.float64
        ).to(self.device)
        rows = _all_gather(row).tolist()  # the one collective, and the one sync, of a logged step
        now = time.perf_counter()
        record = make_record(
            rows,
            step=self.step,
            num_steps=self._num_steps,
            seconds=now - (self._since if self._since is not None else now),
            num_ranks_per_batch=self.num_ranks_per_batch,
            flops_per_token=self.flops_per_token,
            attention_flops=self.attention_flops,
            peak_flops=self.peak_flops,
        )
        if self._grad_norm is not None:
            record["grad_norm"] = self._grad_norm
        if lr is not None:
            record["lr"] = float(lr)
        record.update({key: _number(value) for key, value in self.pending.items()})
        self.pending.clear()
        self.last = record
        self._tokens = self._token_positions = 0
        self._wait, self._num_steps, self._grad_norm = 0.0, 0, None
        self._since = now
        if env.rank() == 0:
            self.write(record)


def _all_gather(row: torch.Tensor) -> torch.Tensor:
    """Every rank's ``row``, stacked; ``row[None]`` in a world of one."""
    if not env.is_distributed():
        return row[None].cpu()
    out = row.new_empty(dist.get_world_size() * row.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, row)
    return out.view(-1, row.numel()).cpu()


def _number(value: Any) -> float:
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


def check_values(values: Any) -> dict[str, Any]:
    """``torchacc.log_metrics``'s values: a mapping of names to numbers or one-element tensors."""
    if not isinstance(values, Mapping):
        raise TypeError(f"log_metrics takes a dict of names to numbers, got {type(values).__name__}")
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"log_metrics: the name {key!r} is not a non-empty str; name each value, e.g. 'val_loss'")
        if key in KEYS:
            raise ValueError(
                f"log_metrics: {key!r} is a value torchacc records itself; give yours another name, e.g. 'my_{key}'"
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number and not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise ValueError(
                f"log_metrics: {key}={value!r} is not a number; log an int, a float or a one-element tensor"
            )
    return {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in values.items()}
