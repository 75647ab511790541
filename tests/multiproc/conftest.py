"""Shared multi-process fixtures, each launched once per run however many test modules read it: the scenario
suites of scenarios.py at 2 and 4 ranks (test_parity.py, test_memory_report.py, test_plan_oracle.py,
test_metrics_ranks.py; see ``once_per_run``) and one 2-rank training run whose checkpoints several test modules
read."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import launch
from filelock import FileLock

import torchacc

CKPT_SCENARIOS = str(Path(__file__).with_name("ckpt_scenarios.py"))
SCENARIOS = str(Path(__file__).with_name("scenarios.py"))


def once_per_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, produce: Callable) -> Any:
    """``produce()``, called once per test run: under xdist a session fixture runs once per worker, and the
    modules that share a launch land on different workers (``--dist loadfile``), so the first worker to ask
    launches and saves the result, and the others wait for it and load it."""
    if worker_id == "master":  # no xdist: the session fixture is already once per run
        return produce()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.pt"  # this run's directory, shared by its workers
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return torch.load(path, weights_only=False)
        result = produce()
        torch.save(result, path)
        return result


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, worker_id):
    """Each rank's result of ``scenarios.fsdp_suite`` (2 ranks). test_scale.py has its own ``two_ranks``."""
    out = tmp_path_factory.getbasetemp() / "two_ranks"
    return once_per_run(tmp_path_factory, worker_id, "two_ranks", lambda: launch(f"{SCENARIOS}:fsdp_suite", 2, out))


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory, worker_id):
    """Each rank's result of ``scenarios.hsdp_suite`` (4 ranks)."""
    out = tmp_path_factory.getbasetemp() / "four_ranks"
    return once_per_run(tmp_path_factory, worker_id, "four_ranks", lambda: launch(f"{SCENARIOS}:hsdp_suite", 4, out))


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Train 3 steps on 2 ranks and save every format; then consolidate the optimizer and reshard to 4 here."""
    out = tmp_path_factory.mktemp("ckpt")
    results = launch(f"{CKPT_SCENARIOS}:train_and_save", 2, out / "logs", args=(out,))
    shards = out / "shards"
    torchacc.dist.fsdp.consolidate_sharded_optimizer_checkpoints(ckpt_prefix=f"{shards}/")
    torchacc.reshard_checkpoint(shards, out / "resharded-4", num_shards=4)
    return out, results
