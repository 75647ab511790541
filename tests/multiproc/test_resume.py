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


def test_a_save_in_the_background_holds_the_state_at_the_call_and_is_published_by_wait(ranks):
    results, out = ranks
    root = out / "background"
    for result in (r["background"] for r in results):
        assert result["path"] == result["latest_after_wait"] == str(root / "checkpoint-2")
        assert result["extra"] == {"step": 2}
        assert_same_run({"losses": [], **result["loaded"]}, {"losses": [], **result["at_call"]})
        for name, values in result["at_call"]["optim"]["state"].items():
            for key, value in values.items():
                assert torch.equal(result["loaded"]["optim"]["state"][name][key], value), (name, key)
        assert result["latest_at_next_save"] == str(root / "checkpoint-3"), "the next save publishes the one before"
        assert result["resumed_extra"] == {"step": 6}, "a load publishes the save in flight first"
    visible = sorted(p.name for p in root.iterdir() if p.name != ".torchacc-writer.json")
    assert visible == [*(f"checkpoint-{n}" for n in range(1, 5)), "latest"]


def test_export_hf_of_the_live_model_reloads_to_equal_logits(ranks):
    from transformers import AutoModelForCausalLM

    results, out = ranks
    expected = results[0]["export"]
    for name in ("export", "pretrained"):
        files = sorted(p.name for p in (out / name).iterdir())
        assert files == ["config.json", "generation_config.json", "model.safetensors"], files
        reloaded = AutoModelForCausalLM.from_pretrained(out / name).eval()
        torch.testing.assert_close(reloaded(input_ids=expected["ids"]).logits, expected["logits"], rtol=0, atol=1e-5)
    assert "call torchacc.export_hf" in expected["refused"] and not (out / "refused").exists()
