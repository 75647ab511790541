"""Collectives with TorchAcc's names: a named rendezvous, barrier, broadcast and reductions.

Each one starts the process group on first use and is a no-op in a world of one, so the same
script runs under ``python`` and under ``torchrun``.
"""

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .env import init_distributed, is_distributed

__all__ = [
    "rendezvous",
    "mark_step",
    "barrier",
    "broadcast",
    "all_reduce",
    "reduce",
    "broadcast_tensors",
    "all_gather_object",
    "raise_on_any_rank",
    "meet",
]

T = TypeVar("T")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _active() -> bool:
    init_distributed()
    return is_distributed()


def rendezvous(tag: str) -> None:
    """Wait until every rank reaches the rendezvous named ``tag``.

    Unlike a bare barrier, the tags are compared: a rank that reached a different rendezvous is an
    error on every rank instead of a silent mismatch or a hang.

    Args:
        tag: a name for this meeting point, the same on every rank.

    Raises:
        RuntimeError: the ranks reached rendezvous with different tags.

    Example:
        >>> torchacc.dist.rendezvous("saving_model")
    """
    if not _active():
        return
    tags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if any(t != tag for t in tags):
        by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise RuntimeError(
            f"rendezvous mismatch ({by_rank}): every rank must call torchacc.dist.rendezvous with the same "
            "tags in the same order; look for a rendezvous inside a rank-dependent branch"
        )


def mark_step() -> None:
    """No-op kept for TorchAcc scripts: eager PyTorch has no lazy graph to cut."""


def barrier() -> None:
    """Block until every rank arrives (no-op in a world of one)."""
    if _active():
        dist.barrier()


def broadcast(obj: T, src: int = 0) -> T:
    """Send ``obj`` from rank ``src`` to every rank.

    Args:
        obj: a tensor (broadcast in place, same shape on every rank) or any picklable object.
        src: the sending rank.

    Returns:
        The tensor (filled with ``src``'s values) or ``src``'s object.

    Example:
        >>> run_id = torchacc.dist.broadcast(str(uuid.uuid4()))
    """
    if not _active():
        return obj
    if isinstance(obj, torch.Tensor):
        dist.broadcast(obj, src=src)
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` across ranks, in place.

    Args:
        tensor: the same shape and dtype on every rank.
        op: ``"sum"``, ``"mean"`` (floating tensors only), ``"max"`` or ``"min"``.

    Returns:
        ``tensor``, now holding the reduced value on every rank.

    Raises:
        ValueError: an unknown ``op``, or ``"mean"`` of an integer tensor.
    """
    if op != "mean" and op not in _REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported; use one of 'sum', 'mean', 'max', 'min'")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='mean' needs a floating tensor, got {tensor.dtype}; convert with .float() first")
    if not _active():
        return tensor
    # gloo has no AVG, so a mean is a sum divided by the world size on every backend.
    dist.all_reduce(tensor, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        tensor.div_(dist.get_world_size())
    return tensor


def reduce(value: torch.Tensor | float, op: str = "mean") -> torch.Tensor | float:
    """Out-of-place reduction across ranks, for logging a loss or a metric.

    Args:
        value: a tensor or a Python number.
        op: as in :func:`all_reduce`; defaults to ``"mean"``.

    Returns:
        A new tensor, or a float when ``value`` was a number. ``value`` is left unchanged.

    Example:
        >>> avg_loss = torchacc.dist.reduce(loss.detach())
    """
    if isinstance(value, torch.Tensor):
        return all_reduce(value.detach().clone(), op=op)
    tensor = torch.tensor(float(value), dtype=torch.float64)
    if _active() and dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    return all_reduce(tensor, op=op).item()


def broadcast_tensors(tensors: Iterable[torch.Tensor], *, src: int = 0, bucket_bytes: int = 64 << 20) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in a few large messages.

    Tensors are packed into flat buckets of one dtype and device (at most ``bucket_bytes`` each), so
    a model with hundreds of small parameters costs a handful of broadcasts, not hundreds.

    Args:
        tensors: the same shapes, dtypes and order on every rank; updated in place.
        src: the rank whose values win.
        bucket_bytes: the size at which a bucket is sent.
    """
    if not _active():
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}

    def flush(key: tuple[torch.dtype, torch.device]) -> None:
        bucket = buckets.pop(key, [])
        sizes.pop(key, None)
        if not bucket:
            return
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, src=src)
        offset = 0
        for t in bucket:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        buckets.setdefault(key, []).append(tensor)
        sizes[key] = sizes.get(key, 0) + tensor.numel() * tensor.element_size()
        if sizes[key] >= bucket_bytes:
            flush(key)
    for key in list(buckets):
        flush(key)


MEET_TIMEOUT = 300.0  # seconds a rank waits in meet() for the others before it raises
_num_meetings: dict[str, int] = {}


def meet(what: str, *, hint: str) -> None:
    """Wait until every rank reaches this call (the n-th of its name); raise if some do not within ``MEET_TIMEOUT``.

    A collective that some ranks never reach (one called under ``if rank == 0:``) would wait out the
    process-group timeout (30 minutes by default) and then fail with a message about the transport. This
    meeting goes through the rendezvous store, so the ranks that arrived can name the ones that did not.

    Args:
        what: the operation, for the message and the store keys (the same on every rank).
        hint: how to fix a missed meeting, appended to the message.

    Raises:
        RuntimeError: naming the ranks that did not arrive within ``MEET_TIMEOUT`` seconds.
    """
    if not _active():
        return
    count = _num_meetings[what] = _num_meetings.get(what, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"torchacc/meet/{what}/{count}"
    world, rank = dist.get_world_size(), dist.get_rank()
    store.set(f"{prefix}/{rank}", b"1")
    try:
        store.wait([f"{prefix}/{r}" for r in range(world)], timedelta(seconds=MEET_TIMEOUT))
    except (RuntimeError, dist.DistError):
        missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        raise RuntimeError(
            f"{what} is collective, but rank(s) {missing} did not reach it within {MEET_TIMEOUT:.0f} s; {hint}"
        ) from None


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` in a world of one."""
    if not _active():
        return [obj]
    objects: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


def raise_on_any_rank(error: str | None, *, what: str, error_type: type[Exception] = RuntimeError) -> None:
    """Meet every rank; if any reports an error, raise it on all of them.

    Use after a step that may fail on some ranks only (a full disk, a bad path): the failing rank
    raises, and so do the others, instead of waiting for it in the next collective until the timeout.

    Args:
        error: this rank's error text, or None when it succeeded.
        what: the operation, for the message.
        error_type: the exception raised (the same on every rank).

    Raises:
        RuntimeError: (or ``error_type``) naming the first failing rank, its error and how many ranks failed.
    """
    if not _active():
        if error:
            raise error_type(f"{what} failed: {error}")
        return
    failed = [(rank, e) for rank, e in enumerate(all_gather_object(error)) if e]
    if failed:
        rank, first = failed[0]
        raise error_type(f"{what} failed on {len(failed)} rank(s); rank {rank}: {first}")
