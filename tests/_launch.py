"""Run a function on N local ranks (gloo, CPU) in fresh processes and collect what each returns.

A tiny stand-in for ``torch.testing._internal``'s MultiProcessTestCase, which needs extra test-only
packages: each rank is a plain ``python`` process with the torchrun environment variables set, so
the code under test starts its process group exactly as under torchrun. Spawn several checks in
one launch where you can: the process start-up (``import torch``) is the expensive part.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

_WORKER = Path(__file__).with_name("_worker_main.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    target: str,
    world_size: int,
    out_dir: Path,
    *,
    timeout: float = 300.0,
    args: tuple = (),
    local_world_size: int | None = None,
) -> list[Any]:
    """Run ``target`` (``"path/to/file.py:function"``) on ``world_size`` ranks; return each rank's result.

    The function is called as ``function(*args)`` inside a rank whose environment is torchrun's
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); it returns a ``torch.save``-able value.
    Any rank failing, or the whole launch taking over ``timeout`` seconds, fails with every rank's
    stderr in the message. ``local_world_size`` emulates several nodes on this machine (ranks are
    grouped into "nodes" of that many, with LOCAL_RANK counting within the node).
    """
    for attempt in range(3):
        try:
            return _launch_once(target, world_size, out_dir, timeout, args, local_world_size)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def spawn_ranks(
    target: str, world_size: int, out_dir: Path, *, args: tuple = (), local_world_size: int | None = None
) -> list[tuple[subprocess.Popen, Any]]:
    """Start one process per rank with torchrun's environment; return ``(process, open log file)`` pairs.

    Each rank's output goes to ``out_dir/rank<r>.log`` and its return value to ``out_dir/rank<r>.pt``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    per_node = local_world_size or world_size
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - the caller closes it
        cmd = [sys.executable, str(_WORKER), target, str(out_dir / f"rank{rank}.pt"), *map(str, args)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


class _PortTaken(AssertionError):
    """Another process took the free port between our probe and the rendezvous; try another one."""


def _launch_once(
    target: str, world_size: int, out_dir: Path, timeout: float, args: tuple, local_world_size: int | None
) -> list[Any]:
    procs = spawn_ranks(target, world_size, out_dir, args=args, local_world_size=local_world_size)
    deadline = time.monotonic() + timeout
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "timeout"
        log.close()
        if code != 0:
            failed.append((rank, code))
    if failed:
        for proc, _ in procs:
            proc.kill()
        logs = "\n".join(
            f"--- rank {r} (exit {code}) ---\n{(out_dir / f'rank{r}.log').read_text()[-4000:]}" for r, code in failed
        )
        if "address already in use" in logs.lower() or "EADDRINUSE" in logs:
            raise _PortTaken(logs)
        raise AssertionError(f"{target} failed on {len(failed)} of {world_size} ranks:\n{logs}")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
