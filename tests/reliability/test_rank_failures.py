"""Failures at 2 ranks: every rank raises (the same error where the cause is shared), quickly, and a job whose
rank fails or hangs mid-step exits non-zero within the configured timeout instead of hanging.

One launch runs every error scenario in sequence (process start-up is the expensive part); the mid-step
failures run the real thing, ``torchrun --nproc_per_node=2``, with a short ``config.dist.timeout``.
"""

import re
from pathlib import Path

import pytest
from _faults import run_torchrun
from _launch import launch

SCENARIOS = str(Path(__file__).with_name("fault_scenarios.py"))
TRAIN = Path(__file__).with_name("fault_train.py")
QUICK = 5.0  # seconds; every error must surface well before the 20 s process-group timeout of the launch


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank-errors")
    return launch(f"{SCENARIOS}:rank_errors", 2, out / "logs", args=(out,), timeout=120)


def both(errors, name):
    return errors[0][name], errors[1][name]


def test_config_error_raises_the_same_message_on_every_rank(errors):
    r0, r1 = both(errors, "config")
    assert r0["type"] == r1["type"] == "ValueError"
    assert r0["message"] == r1["message"]
    assert "dist.fsdp.size=3 exceeds world size 2; choose a divisor of 2: 1, 2" in r0["message"]
    assert max(r0["seconds"], r1["seconds"]) < QUICK


@pytest.mark.parametrize(
    ("name", "error_type", "names"),
    [
        (
            "config_differs",
            "ValueError",
            ["dist.fsdp.wrap_layer_cls: rank 0=['Block'], rank 1=[]", "the same torchacc.Config"],
        ),
        ("config_bad_on_rank1", "ValueError", ["dist.fsdp.size: rank 0=2, rank 1=3"]),
        ("save_model_fails_on_rank0", "RuntimeError", ["save_model(", "rank 0:", "blocker0' is a file"]),
        ("remove_fails_on_rank0", "RuntimeError", ["remove_checkpoint(", "rank 0:", "not writable"]),
        ("checkpoint_io_fails_on_rank0", "RuntimeError", ["checkpoint_io.save_checkpoint(", "rank 0: OSError"]),
        ("save_unwritable_on_rank1", "RuntimeError", ["rank 1:", "blocker' is a file, not a directory"]),
        ("save_disk_full_on_rank0", "RuntimeError", ["rank 0: no space left on the device", "full.pth"]),
        ("checkpoint_disk_full_on_rank1", "RuntimeError", ["rank 1: no space left", ".checkpoint-2.incomplete"]),
        ("checkpoint_unwritable_on_rank1", "RuntimeError", ["rank 1:", "is not writable", "fix its permissions"]),
        ("checkpoint_below_a_file", "RuntimeError", ["rank 0:", "blocker' is a file, not a directory"]),
        ("load_bit_flip", "ValueError", ["flipped/__1_0.distcp: CRC-32", "load an earlier checkpoint"]),
        ("load_truncated", "ValueError", ["truncated/__1_0.distcp: 100 bytes, but", "written at save"]),
    ],
)
def test_an_error_on_one_rank_raises_on_every_rank_quickly(errors, name, error_type, names):
    r0, r1 = both(errors, name)
    for result in (r0, r1):
        assert result["type"] == error_type, result
        for part in names:
            assert part in result["message"], result["message"]
        assert result["seconds"] < QUICK
    if name != "save_unwritable_on_rank1":  # there each rank names its own file first
        assert r0["message"] == r1["message"]


def test_failed_saves_leave_the_previous_state_whole(errors):
    for result in errors:
        assert result["rank0_file_complete"], "rank 0's file of the failed save is complete"
        assert result["full_file_intact"] and result["full_file_leftovers"] == []
        assert result["checkpoint_leftovers"] == [], "no staging directory survives a failed save"
        assert result["latest"].endswith("checkpoint-1")


def test_after_the_errors_the_job_goes_on(errors):
    for result in errors:
        assert result["all_reduce"] == 2.0, "no rank was left behind in a collective"
        assert result["resumed_extra"] == {"step": 1} and result["resumed_equal"]


def injected_at(output: str, what: str) -> float:
    """The time stamp the training script printed when it injected ``what`` ("failure" or "hang")."""
    match = re.search(rf"injected {what} at step 3 \(t=([0-9.]+)\)", output)
    assert match, f"the fault was never injected:\n{output[-3000:]}"
    return float(match.group(1))


def test_a_rank_raising_mid_step_ends_the_torchrun_job(tmp_path):
    timeout = 30
    env = {"FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "3", "TIMEOUT": str(timeout), "OUT": str(tmp_path)}
    code, ended, output = run_torchrun(TRAIN, env)
    assert code != 0, output[-3000:]
    # torchrun's agent sees rank 1 exit and stops rank 0 (blocked in a collective) at once, no timeout involved.
    waited = ended - injected_at(output, "failure")
    assert waited < timeout / 3, f"the job took {waited:.1f} s to end after the failure"
    assert not (tmp_path / "final.pt").exists()


def test_a_rank_hanging_mid_step_ends_the_torchrun_job_within_the_timeout(tmp_path):
    timeout = 8
    env = {"FAULT": "hang", "FAULT_RANK": "1", "FAULT_STEP": "3", "TIMEOUT": str(timeout), "OUT": str(tmp_path)}
    code, ended, output = run_torchrun(TRAIN, env)
    assert code != 0, output[-3000:]
    assert re.search("timed out", output, re.IGNORECASE), output[-3000:]
    # Rank 0's next collective gives up after config.dist.timeout; then the agent stops the hung rank.
    waited = ended - injected_at(output, "hang")
    assert timeout / 2 < waited < timeout + 10, f"the job ended {waited:.1f} s after the hang"
