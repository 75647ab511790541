"""Shared multi-process fixtures, each launched once per session however many test modules read it:
the scenario suites of scenarios.py at 2 and 4 ranks (test_parity.py, test_memory_report.py) and one
2-rank training run whose checkpoints several test modules read."""

from pathlib import Path

import pytest
from _launch import launch

import torchacc

CKPT_SCENARIOS = str(Path(__file__).with_name("ckpt_scenarios.py"))
SCENARIOS = str(Path(__file__).with_name("scenarios.py"))


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """Each rank's result of ``scenarios.fsdp_suite`` (2 ranks). test_scale.py has its own ``two_ranks``."""
    return launch(f"{SCENARIOS}:fsdp_suite", 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    """Each rank's result of ``scenarios.hsdp_suite`` (4 ranks)."""
    return launch(f"{SCENARIOS}:hsdp_suite", 4, tmp_path_factory.mktemp("four_ranks"))


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Train 3 steps on 2 ranks and save every format; then consolidate the optimizer and reshard to 4 here."""
    out = tmp_path_factory.mktemp("ckpt")
    results = launch(f"{CKPT_SCENARIOS}:train_and_save", 2, out / "logs", args=(out,))
    shards = out / "shards"
    torchacc.dist.fsdp.consolidate_sharded_optimizer_checkpoints(ckpt_prefix=f"{shards}/")
    torchacc.reshard_checkpoint(shards, out / "resharded-4", num_shards=4)
    return out, results
