"""``torchacc.estimate_memory`` against real gloo runs of the same config and model (the estimate's oracle).

The ranks of the shared ``two_ranks`` and ``four_ranks`` launches (conftest.py) run plan_scenarios.py: every
configuration trained for real (FSDP, TP, FSDP with activation checkpointing in bf16, CP 2 and PP 2 at 2 ranks;
HSDP, FSDP x TP with AC at 4 ranks; GPT-2 and Llama shapes), and the estimates computed inside the same processes
while their real process group is alive. Parameter, gradient and optimizer bytes must be equal on the rank the
estimate speaks for (rank 0, the busiest; with a pipeline, the first rank of its busiest stage, above which no
rank of the pipeline may peak by more than 10%), and the estimated peak must be within 10% of the peak
``track_memory`` measured (benchmarks/plan_accuracy.py records the figures on larger shapes).
"""

from pathlib import Path

import pytest
from _launch import launch

PLAN_SCENARIOS = str(Path(__file__).with_name("plan_scenarios.py"))


def _check(results: list[dict], names: list[str]) -> None:
    rank0 = results[0]["plan_oracle"]
    for result in results:  # every rank gathered the same estimates over the real group afterwards
        assert result["plan_oracle"]["estimated"] == rank0["estimated"]
    assert sorted(rank0["estimated"]) == sorted(names)
    for name in names:
        estimated = rank0["estimated"][name]
        # the rank the estimate speaks for: 0, or a pipeline's busiest stage's first rank
        measured = results[estimated["rank"]]["plan_oracle"]["measured"][name]
        for key in ("parameters", "gradients", "optimizer_state"):
            assert estimated[key] == measured[key], (name, key, estimated, measured)
        assert estimated["peak"] == pytest.approx(measured["peak"], rel=0.10), (name, estimated, measured)
        for result in results:  # the busiest rank holds the most (torch.chunk's first pieces are the largest)
            other = result["plan_oracle"]["measured"][name]
            if "pp" not in name:  # the stages hold different blocks: no order between them
                assert other["parameters"] <= measured["parameters"], (name, other, measured)
            else:  # the estimate picked the busiest stage
                assert other["peak"] <= measured["peak"] * 1.10, (name, other, measured)


def test_estimates_equal_two_real_ranks(two_ranks):
    _check(two_ranks, ["gpt2_fsdp", "llama_tp", "llama_fsdp_ac_bf16", "llama_pp", "llama_cp"])


def test_estimates_equal_four_real_ranks(four_ranks):
    _check(four_ranks, ["gpt2_hsdp", "llama_fsdp_tp_ac"])


def test_training_after_an_estimate_on_one_rank_does_not_hang(tmp_path):
    # a hang (ranks sent to different process groups) fails the launch after its timeout
    results = launch(f"{PLAN_SCENARIOS}:estimate_between_trainings", 4, tmp_path, timeout=90)
    for result in results:  # the same model, seed and data: the second run equals the first
        assert result["second"] == pytest.approx(result["first"], rel=1e-6)
        assert result["second"]["norm"] == pytest.approx(results[0]["second"]["norm"], rel=1e-6)
