"""Context parallelism must match one process on the same global batches (the parity oracle).

Two launches (2 and 4 ranks) run every scenario of cp_scenarios.py; the reference trains one unsharded model
here on the whole sequences of the distinct data-parallel ranks (the ranks of a CP group share their samples,
each taking a chunk of every sequence).
"""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_llama, token_dataset

import torchacc

SCENARIOS = str(Path(__file__).with_name("cp_scenarios.py"))
TOL = 5e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("cp")


@pytest.fixture(scope="module")
def two(out):
    return launch(f"{SCENARIOS}:two_rank_suite", 2, out / "logs2", args=(out,))


@pytest.fixture(scope="module")
def four(out, two):  # loads the checkpoint that the 2-rank suite saved
    return launch(f"{SCENARIOS}:four_rank_suite", 4, out / "logs4", args=(out,))


def _reference(kind: str, data: str, batches: list[list[list[int]]], **model_kw) -> tuple[list[float], dict]:
    from cp_scenarios import LR, sft_dataset

    dataset = token_dataset(32) if data == "tokens" else sft_dataset()
    model = tiny_llama(seed=0, kind=kind, **model_kw)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(len(batches[0])):
        samples = [dataset[i] for rank_batches in batches for i in rank_batches[step]]
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0] if key != "index"}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _assert_parity(results: list[dict], *, cp: int, kind: str = "llama", data: str = "tokens", **model_kw) -> None:
    groups: dict[str, list[dict]] = {}
    for result in results:
        groups.setdefault(str(result["indices"]), []).append(result)
    assert all(len(group) == len(results) // len(groups) for group in groups.values())
    assert len(results) // len(groups) >= cp, "the ranks of a CP group must take the same samples"
    data_ranks = [group[0] for group in groups.values()]
    seen = [i for r in data_ranks for step in r["indices"] for i in step]
    assert len(seen) == len(set(seen)), "data-parallel ranks must see disjoint samples"
    losses, state = _reference(kind, data, [r["indices"] for r in data_ranks], **model_kw)
    for group in groups.values():
        for result in group:  # every rank of a CP group returns its data rank's whole-sequence loss
            assert result["attn"] == "torchacc_ulysses"
    mean_losses = torch.tensor([r["losses"] for r in data_ranks]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(losses), atol=TOL, rtol=0)
    for result in results:
        assert result["state"].keys() == state.keys()
        worst = max((result["state"][k] - v).abs().max().item() for k, v in state.items())
        assert worst < TOL, worst


def test_cp2_matches_one_process(two):
    _assert_parity([r["cp2"] for r in two], cp=2)
    result = two[0]["cp2"]
    assert result["lengths"] == [8, 8, 8], "each rank holds half of every 16-token sequence"
    assert result["mesh"] == (["fsdp", "cp"], [[0, 1]])
    assert two[0]["cp2"]["losses"] == two[1]["cp2"]["losses"], "both chunks report the whole sequences' loss"
    placements = result["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == (["Shard(dim=0)"], ["fsdp_cp"])


def test_cp2_qwen2_with_padding_and_uneven_targets_matches_one_process(two):
    """Odd length (padded to 16 by the loader), a padding mask, and chunks with different numbers of targets."""
    _assert_parity([r["cp2_qwen2_sft"] for r in two], cp=2, kind="qwen2", data="sft")
    assert two[0]["cp2_qwen2_sft"]["lengths"] == [8, 8, 8]


def test_cp2_trains_in_bf16(two):
    """FSDP's bf16 input casting rebuilds dataclasses on their way into each unit: the CP context survives it."""
    for result in two:
        assert result["cp2_bf16"]["attn"] == "torchacc_ulysses"
        bf16, fp32 = torch.tensor(result["cp2_bf16"]["losses"]), torch.tensor(result["cp2"]["losses"])
        torch.testing.assert_close(bf16, fp32, atol=2e-2, rtol=0)


def test_fsdp2_x_cp2_matches_one_process(four):
    _assert_parity([r["fsdp2_cp2"] for r in four], cp=2)
    result = four[0]["fsdp2_cp2"]
    assert result["mesh"] == (["fsdp", "cp"], [[0, 1], [2, 3]]), "the ranks of one CP group are neighbours"
    assert result["placements"]["model.layers.0.mlp.down_proj.weight"] == (["Shard(dim=0)"], ["fsdp_cp"])


def test_fsdp2_x_cp2_qwen2_matches_one_process(four):
    _assert_parity([r["fsdp2_cp2_qwen2"] for r in four], cp=2, kind="qwen2")


def test_cp2_x_tp2_matches_one_process(four):
    _assert_parity([r["cp2_tp2"] for r in four], cp=2, num_key_value_heads=4)
    result = four[0]["cp2_tp2"]
    assert result["mesh"][0] == ["dp", "fsdp", "cp", "tp"]
    down = result["placements"]["model.layers.0.mlp.down_proj.weight"]
    assert down[1] == ["fsdp_cp", "tp"]


def test_replicas_of_cp2_with_activation_checkpointing_match_one_process(four):
    _assert_parity([r["dp2_cp2_gc"] for r in four], cp=2)
    result = four[0]["dp2_cp2_gc"]
    assert result["mesh"] == (["dp", "fsdp", "cp"], [[[0, 1]], [[2, 3]]])
    assert result["placements"]["model.layers.0.mlp.down_proj.weight"] == (
        ["Replicate()", "Shard(dim=0)"],
        ["dp", "fsdp_cp"],
    )


def test_the_strategy_splits_sequences_like_accelerate(two):
    _assert_parity([r["strategy_cp2"] for r in two], cp=2)


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def test_a_cp2_checkpoint_resumes_exactly_and_at_fsdp4_and_in_one_process(out, two, four):
    from cp_scenarios import step
    from tp_dcp_scenarios import snapshot

    ckpt = two[0]["checkpoint"]
    assert ckpt["third"][0] == ckpt["third"][1], "the loader resumes at the third batch"
    for result in two:  # CP 2 -> CP 2: the state bitwise, then the same third step bitwise
        _assert_equal(result["checkpoint"]["loaded"]["model"], ckpt["saved"]["model"])
        _assert_equal(result["checkpoint"]["loaded"]["optim"], ckpt["saved"]["optim"])
        _assert_equal(result["checkpoint"]["resumed"]["model"], ckpt["straight"]["model"])
        assert result["checkpoint"]["losses"][0] == result["checkpoint"]["losses"][1]
    for result in four:  # CP 2 -> FSDP 4, then the third step
        _assert_equal(result["fsdp4_loaded"]["model"], ckpt["saved"]["model"])
        _assert_equal(result["fsdp4_loaded"]["optim"], ckpt["saved"]["optim"])
        resumed = result["fsdp4_resumed"]["model"]
        worst = max((value - ckpt["straight"]["model"][key]).abs().max().item() for key, value in resumed.items())
        assert worst < TOL, worst
    # CP 2 -> one process (no process group), then the third step on the whole sequences
    model = torchacc.accelerate(tiny_llama(seed=9), config=torchacc.Config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torchacc.load_checkpoint(out / "ckpt-cp2", model=model, optimizer=optimizer)
    loaded = snapshot(model, optimizer)
    _assert_equal(loaded["model"], ckpt["saved"]["model"])
    _assert_equal(loaded["optim"], ckpt["saved"]["optim"])
    dataset = token_dataset(32)
    ids = torch.stack([dataset[i]["input_ids"] for i in ckpt["third"][0]])
    assert abs(step(model, optimizer, {"input_ids": ids, "labels": ids}) - ckpt["losses"][0]) < TOL
    after = snapshot(model, optimizer)["model"]
    worst = max((value - ckpt["straight"]["model"][key]).abs().max().item() for key, value in after.items())
    assert worst < TOL, worst


def test_labels_without_shift_labels_fail_on_every_rank(two):
    for result in two:
        assert "got labels without shift_labels" in result["checkpoint"]["labels_only"]


def test_chunk_dependent_configs_are_refused_under_cp(two):
    # found by the red team, both silently wrong before: a MoE router's aux loss was divided by the number of
    # target tokens (5.01 against 6.90), and dynamic NTK rope scaled each chunk by its own positions
    for result in two:
        assert "dist.cp: MixtralForCausalLM adds its routers' load-balancing loss" in result["moe_aux_loss"]["error"]
        assert "dist.cp: LlamaForCausalLM uses dynamic NTK rope scaling" in result["dynamic_rope"]["error"]
