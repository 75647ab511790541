"""Run a function on N local ranks (gloo, CPU) in fresh processes and collect what each returns.

A tiny stand-in for ``torch.testing._internal``'s MultiProcessTestCase, which needs extra test-only
packages: each rank is a process of its own with the torchrun environment variables set, so the code
under test starts its process group exactly as under torchrun.

[Note: forked ranks] Importing torch, torchacc and transformers costs a rank process seconds of CPU, more
than most scenarios themselves, and the suite starts about a hundred of them. So ranks are forked from a
server process that imported all that once (``multiprocessing``'s forkserver, started on first use): each
rank is still a new process with a fresh interpreter state of its own (no process group, no CUDA, nothing
of another test), its environment set from the caller's. ``TORCHACC_TEST_SPAWN=exec`` starts each rank as
``python tests/_worker_main.py`` instead, as before. Spawn several checks in one launch where you can.
"""

import gc
import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

_WORKER = Path(__file__).with_name("_worker_main.py")
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torchacc", "transformers"]
_PRELOAD += [f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "qwen2")]
_PRELOAD += ["torch.distributed.pipelining"]  # torchacc imports it only for a pipeline
_context: Any = None


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


class _ForkedRank:
    """A forked rank with the part of ``subprocess.Popen``'s interface the launchers use."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()


def run_target(target: str, out_path: str, args: tuple) -> None:
    """Run ``FILE:FUNCTION`` with ``args`` in this rank and save its return value to ``out_path``."""
    import importlib.util

    path, func_name = target.rsplit(":", 1)
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(path).resolve().parent)]
    spec = importlib.util.spec_from_file_location("_scenario", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = getattr(module, func_name)(*args)
    torch.save(result, out_path)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_script(script: str, argv: str, env: str) -> None:
    """Inside a rank: run ``script`` as ``__main__`` with ``argv`` and ``env`` (both JSON), as torchrun does.

    ``launch(f"{_launch.__file__}:run_script", n, out, args=(script, json.dumps(argv), json.dumps(env)))`` runs a
    script on ``n`` forked ranks; each rank's output is in ``out/rank<r>.log``.
    """
    os.environ.update(json.loads(env))
    sys.argv = [script, *json.loads(argv)]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def _run_rank(target: str, out_path: str, args: tuple, env: dict[str, str], log_path: str) -> None:
    """The body of a forked rank: _worker_main.py's, with the environment and the output files set first."""
    # The server's imports (millions of objects) are this rank's too; a full collection would walk them all, 0.2 s
    # each time the scenario or torch calls gc.collect(). Frozen, they are left out of every collection.
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    code = 0
    try:
        run_target(target, out_path, args)
    except BaseException:  # reported in the rank's log, as an uncaught exception would be
        traceback.print_exc()
        code = 1
    # See _worker_main.py: skip the interpreter's finalization (gloo's threads can abort it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def spawn_ranks(
    target: str, world_size: int, out_dir: Path, *, args: tuple = (), local_world_size: int | None = None
) -> list[tuple[Any, Any]]:
    """Start one process per rank with torchrun's environment; return ``(process, open log file)`` pairs.

    Each rank's output goes to ``out_dir/rank<r>.log`` and its return value to ``out_dir/rank<r>.pt``. The
    processes are forked ranks (see [Note: forked ranks]) or, with ``TORCHACC_TEST_SPAWN=exec``, ``Popen``s.
    """
    forked = os.environ.get("TORCHACC_TEST_SPAWN", "fork") != "exec"
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
        log_path, out_path = out_dir / f"rank{rank}.log", out_dir / f"rank{rank}.pt"
        log = open(log_path, "a")  # noqa: SIM115 - the caller closes it
        if forked:
            process = _forkserver().Process(
                target=_run_rank, args=(target, str(out_path), tuple(map(str, args)), env, str(log_path))
            )
            process.start()
            procs.append((_ForkedRank(process), log))
            continue
        cmd = [sys.executable, str(_WORKER), target, str(out_path), *map(str, args)]
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
