"""Process-group start-up from the torchrun environment, and the rank/device queries.

Without torchrun (no ``WORLD_SIZE`` in the environment) everything behaves as a world of one and no
process group is created. Under torchrun the default group is started on first need, once: NCCL for
CUDA tensors (with gloo beside it for CPU tensors), gloo on a CPU-only machine.
"""

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .._utils.logging import warn_once

__all__ = [
    "init_distributed",
    "is_distributed",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "is_master_ordinal",
    "device",
    "teardown",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; launch with torchrun") from None


def _launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def init_distributed(*, timeout: float = 1800.0) -> bool:
    """Start the default process group from the torchrun environment. Idempotent.

    Args:
        timeout: seconds any collective may wait before the job fails instead of hanging.

    Returns:
        True when a process group is running (launched by torchrun, or started by the user), False
        for a plain ``python train.py`` run, which is treated as a world of one.

    Raises:
        ValueError: the environment is partial (``WORLD_SIZE`` without ``MASTER_ADDR``...), or asks for
            more CUDA devices than this node has.

    Example:
        >>> torchacc.dist.init_distributed(timeout=600)  # usually called for you by accelerate()
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if not _launched_by_torchrun():
        return False
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with "
            "`torchrun --nproc_per_node=N train.py`, or unset WORLD_SIZE to run as a single process"
        )
    if torch.cuda.is_available():
        num_devices = torch.cuda.device_count()
        if local_rank() >= num_devices:
            raise ValueError(
                f"LOCAL_RANK={local_rank()} but this node has {num_devices} CUDA device(s): "
                f"launch with --nproc_per_node <= {num_devices}"
            )
        torch.cuda.set_device(local_rank())
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    store = _restart_store(timedelta(seconds=timeout))
    rendezvous = {} if store is None else {"store": store, "rank": rank(), "world_size": world_size()}
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout), **rendezvous)
    # A process that exits with a live gloo/NCCL group can abort in the C++ teardown
    # ("terminate called without an active exception"), turning a finished run into a failed job.
    atexit.register(teardown)
    return True


_num_starts = 0


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """A key space of its own for a restarted torchrun attempt on one node, or None to use the default store."""
    # [Note: elastic restarts] torchrun shares its rendezvous TCPStore with the workers
    # (TORCHELASTIC_USE_AGENT_STORE) without separating successive attempts, so a restarted worker
    # can read a peer's gloo/NCCL address from the failed attempt and fail with "Connection refused"
    # (pytorch/pytorch#135712, #167288). On one node every worker sees the same restart count, so it
    # prefixes the keys. Across nodes the counts may differ (an agent restarts its workers without
    # counting when another node failed); there torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    global _num_starts
    _num_starts += 1
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or (attempt == "0" and _num_starts == 1):
        return None
    if attempt == "0":
        # A second start in the same processes (after teardown()): every rank counts its starts alike, on
        # every node, so the count separates the key spaces where the restart count cannot.
        prefix = f"torchacc/start-{_num_starts}"
    elif world_size() != local_world_size():
        warn_once(
            "torchrun restarted this multi-node job with its shared rendezvous store, whose keys from the failed "
            "attempt can break the new process group; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
        return None
    else:
        prefix = f"torchacc/attempt-{attempt}/start-{_num_starts}"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size(), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(prefix, store)


def teardown() -> None:
    """Destroy the process group torchacc started (safe to call twice, or when none is running)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # Groups still referenced (by the FSDP mesh) keep their gloo worker threads until interpreter
        # shutdown. A worker still releasing its last finished work then needs the GIL during
        # finalization and aborts the process ("terminate called without an active exception",
        # seen under CPU load; pytorch/pytorch#179291). Releasing the GIL a moment lets it finish.
        time.sleep(0.1)


def is_distributed() -> bool:
    """True when a process group of more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Global rank of this process (0 in a single-process run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK", 0)


def world_size() -> int:
    """Number of processes in the job (1 in a single-process run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """Rank of this process on its node (torchrun's ``LOCAL_RANK``)."""
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    """Number of processes on this node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def is_master_ordinal(local: bool = True) -> bool:
    """True on the first process of this node (``local=True``) or of the whole job (``local=False``).

    Example:
        >>> if torchacc.dist.is_master_ordinal(local=False):
        ...     print("only once per job")
    """
    return (local_rank() if local else rank()) == 0


def device() -> torch.device:
    """The device this process computes on: ``cuda:LOCAL_RANK`` when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")
