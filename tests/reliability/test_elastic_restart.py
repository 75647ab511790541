"""Elastic restart: ``torchrun --max-restarts=1`` with a crash at step 5 resumes from the latest complete checkpoint
(``torchacc.resume_latest``) and ends with bitwise the parameters of a run that never crashed.

The script saves every 2 steps with the dataloader position; rank 1 raises before step 5 in the first attempt
only (``TORCHELASTIC_RESTART_COUNT``), so the second attempt resumes at step 4, in the middle of an epoch, and
trains on to step 10, across the epoch boundary. The same script then trains a fresh model for 10 steps
without checkpoints: the reference (CPU, float32, same data order).
"""

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _faults import run_torchrun

from torchacc.dist import env

TRAIN = Path(__file__).with_name("fault_train.py")


def test_restart_resumes_from_the_latest_checkpoint_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "5", "TIMEOUT": "30"}
    env.update(CKPT=str(ckpt), OUT=str(tmp_path), REFERENCE="1", STEPS="10", SAVE_EVERY="2")
    code, _, output = run_torchrun(TRAIN, env, max_restarts=1)
    assert code == 0, output[-4000:]
    assert "injected failure at step 5" in output, "the first attempt must have crashed"
    attempts = [json.loads((tmp_path / f"attempt-{n}.json").read_text()) for n in (0, 1)]
    assert attempts == [{"attempt": 0, "resumed_step": 0}, {"attempt": 1, "resumed_step": 4}]

    final = torch.load(tmp_path / "final.pt")
    reference = torch.load(tmp_path / "reference.pt")
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key
    assert sorted(os.listdir(ckpt)) == [f"checkpoint-{n}" for n in range(1, 6)] + ["latest"]
    assert (ckpt / "latest").read_text() == "checkpoint-5"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}, "default store"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "2"}, "default store"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1", "WORLD_SIZE": "4"}, "warning"),
    ],
)
def test_restart_store_is_only_replaced_for_a_restarted_single_node_job(monkeypatch, environ, expected):
    """The single-node restart itself is the test above; here the cases where the default store is kept."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if expected == "warning":
        with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            assert env._restart_store(timedelta(seconds=1)) is None
    else:
        assert env._restart_store(timedelta(seconds=1)) is None
