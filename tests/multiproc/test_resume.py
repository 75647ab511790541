"""Issue 24 at 2 ranks: resume replays exactly (dropout, a shuffled loader), saves run in the background, rotation,
the epoch length after a resume and the live Hugging Face export. One launch runs every scenario."""

from pathlib import Path

import pytest
import torch
from _launch import launch

SCENARIOS = str(Path(__file__).with_name("resume_scenarios.py"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    return launch(f"{SCENARIOS}:suite", 2, out / "logs", args=(out,)), out


def assert_same_run(run: dict, reference: dict) -> None:
    assert run["losses"] == reference["losses"]  # bitwise: float32 on the CPU, the same operations
    assert run["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(run["state"][key], value), key


@pytest.mark.parametrize("api", ["exact", "strategy"])
def test_a_resumed_run_with_dropout_and_shuffling_replays_the_uninterrupted_one(ranks, api):
    results, _ = ranks
    for result in results:
        assert_same_run(result[api]["resumed"], result[api]["reference"])


def test_len_of_a_resumed_loader_is_the_full_epoch_and_the_rest_is_counted_apart(ranks):
    results, _ = ranks
    for result in results:  # 64 samples, 2 ranks, batches of 2: 16 per epoch, 11 taken before the save
        assert result["exact"]["lengths_after_resume"] == (16, 5)
