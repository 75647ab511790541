"""Fault injection for the reliability tests: SIGKILL or an OSError at a chosen call, and launchers that expect failure.

Faults are injected by replacing a function inside the process that is to fail (a forked child, or one
rank of a launch), never through a hook in the library: the library runs exactly as in production.
"""

import errno
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _launch import spawn_ranks


def kill_self() -> None:
    """SIGKILL this process: no exception handler, finally block or atexit hook runs."""
    os.kill(os.getpid(), signal.SIGKILL)


def stamped_kill(stamp: Path) -> Callable[[], None]:
    """An ``inject`` action that writes the time to ``stamp``, then SIGKILLs this process."""

    def action() -> None:
        stamp.write_text(f"{time.time():.3f}")
        kill_self()

    return action


def disk_full(path: Any = None) -> OSError:
    """The error a write raises when the device is full."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([os.fspath(path)] if path is not None else []))


def raising(make_error: Callable[[], BaseException]) -> Callable[[], None]:
    """An ``inject`` action that raises ``make_error()``."""

    def action() -> None:
        raise make_error()

    return action


def inject(
    owner: Any, name: str, action: Callable[[], None], *, nth: int = 1, after: bool = False, when=None, patch=setattr
) -> None:
    """Make the ``nth`` call of ``owner.name`` (counting calls that satisfy ``when(*args)``) run ``action``.

    ``action`` runs before the call (``after=False``) or once it has returned; it kills the process or raises.
    ``patch`` installs the wrapper: ``monkeypatch.setattr`` in the pytest process, plain ``setattr`` in a
    process that dies anyway.
    """
    original = getattr(owner, name)
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        hit = False
        if when is None or when(*args, **kwargs):
            calls += 1
            hit = calls == nth
        if hit and not after:
            action()
        result = original(*args, **kwargs)
        if hit and after:
            action()
        return result

    patch(owner, name, wrapper)


def run_forked(body: Callable[[], None]) -> int:
    """Run ``body`` in a forked copy of this process; return the signal that ended it (0 if it exited)."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            body()
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status)
    raise AssertionError(f"the forked save was not killed: it exited with {os.WEXITSTATUS(status)}")


def launch_failing(target: str, world_size: int, out_dir: Path, *, args: tuple = (), timeout: float = 90.0) -> dict:
    """Run ``target`` on ``world_size`` ranks as tests/_launch.py does, expecting some rank to die.

    Returns ``{"codes": [exit code per rank], "seconds": wall time, "ended": time.time() when the last rank
    had exited, "logs": [log text per rank]}``; a launch still running after ``timeout`` is killed and fails
    the test (a hang).
    """
    start = time.monotonic()
    procs = spawn_ranks(target, world_size, out_dir, args=args)
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, start + timeout - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            raise AssertionError(f"{target} hung: still running after {timeout} s") from None
        finally:
            log.close()
    logs = [(out_dir / f"rank{rank}.log").read_text() for rank in range(world_size)]
    return {"codes": codes, "seconds": time.monotonic() - start, "ended": time.time(), "logs": logs}


def run_torchrun(script: Path, env: dict[str, str], *, nproc: int = 2, max_restarts: int = 0, timeout: float = 120.0):
    """Run ``script`` under ``torchrun --standalone``; return ``(returncode, time.time() at its end, output)``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        str(script),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        output, _ = proc.communicate()
        raise AssertionError(f"torchrun {script.name} hung: still running after {timeout} s\n{output}") from None
    return proc.returncode, time.time(), output
