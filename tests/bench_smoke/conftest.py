"""``run_benchmark``: a benchmark script's ``--quick`` run in this process, its torchrun jobs on forked ranks.

[Note: benchmarks in the suite] A script run as ``python benchmarks/x.py --quick`` starts ``torchrun`` for its
ranks: the script, torchrun's agent and each rank import torch, torchacc and transformers first, several seconds
of CPU each, which was most of what a smoke run cost. Here the script runs as ``__main__`` in the test's process
(its tables are the captured stdout), and ``_common.run_torchrun`` is replaced by a launch of ranks forked from
tests/_launch.py's pre-imported server, each running the same script as ``__main__`` with the same arguments and
environment, as torchrun would. What this does not run is torchrun itself: the examples' end-to-end tests do.
Scripts that start processes of their own to measure them (capacity.py's memory watchdog, consolidate.py's
peak per subprocess) keep running as subprocesses.
"""

import itertools
import json
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _launch
import pytest
import torch
from _launch import launch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _forked_run_torchrun(out_dir: Path) -> Callable[..., list[dict[str, Any]]]:
    """A stand-in for ``_common.run_torchrun`` that launches forked ranks under ``out_dir``."""
    import _common

    jobs = itertools.count()

    def run_torchrun(
        script: str,
        args: Sequence[str],
        *,
        nproc: int,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        echo: bool = True,
    ) -> list[dict[str, Any]]:
        job = out_dir / f"job{next(jobs)}"
        launch(f"{_launch.__file__}:run_script", nproc, job, timeout=timeout or 600,
               args=(script, json.dumps(list(args)), json.dumps(env or {})))  # fmt: skip
        results: list[dict[str, Any]] = []
        for rank in range(nproc):
            for line in (job / f"rank{rank}.log").read_text().splitlines():
                if line.startswith(_common.RESULT_PREFIX):
                    results.extend(json.loads(part) for part in line.split(_common.RESULT_PREFIX) if part)
        return results

    return run_torchrun


@pytest.fixture
def run_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Callable:
    """``run_benchmark("setup_time.py", "--quick", ...)``: the script's stdout (see [Note: benchmarks in the suite])."""

    def run(script: str, *argv: str) -> str:
        monkeypatch.syspath_prepend(str(BENCHMARKS))
        import _common

        monkeypatch.setattr(_common, "run_torchrun", _forked_run_torchrun(tmp_path / "ranks"))
        monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *argv])
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        num_threads = torch.get_num_threads()
        capsys.readouterr()
        try:
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (None, 0), f"{script} {' '.join(argv)} exited {exc.code}"
        finally:
            torch.set_num_threads(num_threads)  # throughput.py's loader comparison sets one thread
        return capsys.readouterr().out

    return run
