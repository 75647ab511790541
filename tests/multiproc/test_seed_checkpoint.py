"""The seed's (TorchAcc's) checkpoint section runs unchanged from docs/migration.md and replays exactly;
first-week habits: model.forward(...), a save on rank 0 only, BatchNorm buffers (see seed_scenarios.py)."""

from pathlib import Path

import pytest
import torch
from _launch import launch

SCENARIOS = str(Path(__file__).with_name("seed_scenarios.py"))


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed")
    return launch(f"{SCENARIOS}:seed_suite", 2, out / "logs", args=(out,))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_seed_checkpoint_blocks_run_unchanged_and_training_resumes_exactly(seed, precision):
    for result in seed:
        replay = result[f"replay_{precision}"]
        assert replay["losses"] == replay["reference"], "losses after the load equal the uninterrupted run"
        assert replay["state_equal"]
        for name in ("rank-0-of-2.pth", "rank-1-of-2.pth", "consolidated.pth", "optimizer.pth", "lr_scheduler.pth"):
            assert name in replay["files"], replay["files"]


def test_a_plain_optimizer_state_dict_of_other_parameters_fails_at_load_naming_the_fix(seed):
    for result in seed:
        error = result["foreign_optimizer_state"]["error"]
        assert error and "transformer.wte.weight" in error and "torchacc.load_optim_state_dict" in error


def test_model_forward_called_directly_runs_through_the_sharding_hooks(seed):
    for result in seed:
        assert result["forward"] == {"equal": True, "grads": True}


def test_a_save_on_rank_zero_only_raises_there_quickly_naming_the_fix(seed):
    error = seed[0]["save_on_rank0_only"]["error"]
    assert error and "rank(s) [1] did not reach it" in error and "not under `if rank == 0:`" in error
    assert seed[0]["save_on_rank0_only"]["seconds"] < 10


def test_batchnorm_statistics_agree_across_ranks_with_broadcast_buffers(seed):
    r0, r1 = (r["bn_broadcast"] for r in seed)
    assert torch.equal(r0["mean"], r1["mean"]) and torch.equal(r0["var"], r1["var"]) and r0["count"] == r1["count"] == 3
    local0, local1 = (r["bn_local"] for r in seed)
    assert not torch.equal(local0["mean"], local1["mean"]), "without the knob each rank keeps its own statistics"
