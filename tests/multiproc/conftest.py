"""Shared multi-process fixtures: one 2-rank training run whose checkpoints several test modules read."""

from pathlib import Path

import pytest
from _launch import launch

import torchacc

CKPT_SCENARIOS = str(Path(__file__).with_name("ckpt_scenarios.py"))


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Train 3 steps on 2 ranks and save every format; then consolidate the optimizer and reshard to 4 here."""
    out = tmp_path_factory.mktemp("ckpt")
    results = launch(f"{CKPT_SCENARIOS}:train_and_save", 2, out / "logs", args=(out,))
    shards = out / "shards"
    torchacc.dist.fsdp.consolidate_sharded_optimizer_checkpoints(ckpt_prefix=f"{shards}/")
    torchacc.reshard_checkpoint(shards, out / "resharded-4", num_shards=4)
    return out, results
