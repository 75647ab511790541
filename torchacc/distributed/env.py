"""Process-group start-up from the torchrun environment, and the rank/device queries.

Without torchrun (no ``WORLD_SIZE`` in the environment) everything behaves as a world of one and no
process group is created. Under torchrun the default group is started on first need, once: NCCL for
CUDA tensors (with gloo beside it for CPU tensors), gloo on a CPU-only machine. A group the script
started itself is adopted after two checks (this rank's device, a CPU backend); at exit the group is
destroyed unless the process is dying of an exception.
"""

import atexit
import os
import sys
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


def init_distributed(*, timeout: float = 1800.0, world_of_one: bool = False) -> bool:
    """Start the default process group from the torchrun environment, or adopt the one already running. Idempotent.

    A group the script started itself (``dist.init_process_group(...)`` before torchacc) is adopted as one that
    torchacc starts: this rank computes on ``cuda:LOCAL_RANK``, and the group must have a backend for CPU
    tensors, which torchacc communicates too (see [Note: CPU collectives]).

    Args:
        timeout: seconds any collective may wait before the job fails instead of hanging.
        world_of_one: without torchrun, start a group of this one process (on an in-process store) instead of
            running without one: a ``DeviceMesh`` needs a group.

    Returns:
        True when a process group is running (launched by torchrun, started by the user, or a world of one
        asked for), False for a plain ``python train.py`` run, which is treated as a world of one.

    Raises:
        ValueError: the environment is partial (``WORLD_SIZE`` without ``MASTER_ADDR``...), asks for more CUDA
            devices than this node has, or the running group has no CPU backend (``init_process_group("nccl")``).

    Example:
        >>> torchacc.dist.init_distributed(timeout=600)  # usually called for you by accelerate()
    """
    if dist.is_available() and dist.is_initialized():
        _adopt_running_group()
        return True
    alone = not _launched_by_torchrun()
    if alone and not world_of_one:
        return False
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing and not alone:
        raise ValueError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with "
            "`torchrun --nproc_per_node=N train.py`, or unset WORLD_SIZE to run as a single process"
        )
    backend = "cpu:gloo,cuda:nccl" if _use_local_device() else "gloo"
    if alone:
        rendezvous = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    else:
        store = _restart_store(timedelta(seconds=timeout))
        rendezvous = {} if store is None else {"store": store, "rank": rank(), "world_size": world_size()}
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout), **rendezvous)
    # A process that exits with a live gloo/NCCL group can abort in the C++ teardown
    # ("terminate called without an active exception"), turning a finished run into a failed job.
    atexit.register(_teardown_at_exit)
    return True


def _use_local_device() -> bool:
    """Make ``cuda:LOCAL_RANK`` this process's current device; False on a machine without CUDA."""
    if not torch.cuda.is_available():
        return False
    num_devices = torch.cuda.device_count()
    if local_rank() >= num_devices:
        raise ValueError(
            f"LOCAL_RANK={local_rank()} but this node has {num_devices} CUDA device(s): "
            f"launch with --nproc_per_node <= {num_devices}"
        )
    if torch.cuda.current_device() != local_rank():
        torch.cuda.set_device(local_rank())
    return True


# [Note: CPU collectives] torchacc communicates CPU tensors in a CUDA job: the digests and broadcasts of
# sync_module_states over a model still on the CPU (sync.sync_tensors), the buffer-sync flags
# (parallel/_buffers.py), the fp16 overflow flag (parallel/precision.py), and every collective on
# CPU-offloaded shards and gradients (clipping, full_tensor, optimizer state). DTensor and FSDP run the
# latter on the mesh's groups, which take the default group's backends, so a gloo group beside it could not
# serve them: the default group itself needs a CPU backend. (The object collectives behind agree_on_config
# and raise_on_any_rank, DCP's planning and init_from's broadcasts go through CUDA under NCCL.)


def _adopt_running_group() -> None:
    """Check a group torchacc may not have started: this rank's device, and a backend for CPU tensors."""
    _use_local_device()
    config = dist.get_backend_config()
    if "cpu" not in {pair.split(":")[0].strip() for pair in config.split(",")}:
        raise ValueError(
            f"the process group was started with backend '{config}', which has no backend for CPU tensors, but "
            "torchacc also communicates CPU tensors (state and buffer sync, CPU offload): start it with "
            'dist.init_process_group("cpu:gloo,cuda:nccl"), or leave it to torchacc (remove the call; accelerate() '
            "and FSDP2Strategy.setup_environment() start it)"
        )


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


def _teardown_at_exit() -> None:
    # [Note: no teardown on a dying rank] A rank that dies of an uncaught exception leaves its group as it is:
    # under NCCL, destroy_process_group() can wait for a collective that a peer still has pending, and the job
    # then waits out dist.timeout instead of ending when torchrun sees this rank fail (TorchTitan destroys only
    # on a clean exit). sys.exc_info() is empty in an atexit hook; the interpreter records the uncaught
    # exception in sys.last_value (and sys.last_exc from Python 3.12) before it runs the hooks. sys.exit(code)
    # is not recorded there and counts as a clean exit.
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    teardown()


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
