"""Tensor parallelism must match one process on the same global batches (the parity oracle).

Two launches (2 and 4 ranks) run every scenario of tp_scenarios.py; the reference trains one unsharded
model here on the batches of the distinct data-parallel ranks (the ranks of a TP group share theirs).
"""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import TinyNet, tiny_llama, token_dataset

SCENARIOS = str(Path(__file__).with_name("tp_scenarios.py"))
TOL = 5e-5


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return launch(f"{SCENARIOS}:two_rank_suite", 2, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return launch(f"{SCENARIOS}:four_rank_suite", 4, tmp_path_factory.mktemp("tp4"))


def _reference(kind: str, batches: list[list[list[int]]]) -> tuple[list[float], list[float], dict]:
    from tp_scenarios import LR, MAX_NORM

    data, model = token_dataset(32), tiny_llama(seed=0, kind=kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(len(batches[0])):
        ids = torch.stack([data[i]["input_ids"] for rank_batches in batches for i in rank_batches[step]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def _assert_parity(results: list[dict], kind: str = "llama") -> None:
    groups: dict[str, list[dict]] = {}
    for result in results:
        groups.setdefault(str(result["indices"]), []).append(result)
    tp_size = len(results) // len(groups)
    assert all(len(group) == tp_size for group in groups.values()), "each TP group must see one stream of batches"
    data_ranks = [group[0] for group in groups.values()]
    seen = [i for r in data_ranks for step in r["indices"] for i in step]
    assert len(seen) == len(set(seen)), "data-parallel ranks must see disjoint samples"
    losses, norms, state = _reference(kind, [r["indices"] for r in data_ranks])
    mean_losses = torch.tensor([r["losses"] for r in data_ranks]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(losses), atol=TOL, rtol=0)
    for result in results:
        # one global norm, however the gradients are split (TP shards, FSDP shards, replicated norms)
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(norms), atol=TOL, rtol=1e-5)
        assert result["state"].keys() == state.keys()
        worst = max((result["state"][k] - v).abs().max().item() for k, v in state.items())
        assert worst < TOL, worst


def test_tp2_matches_one_process(two):
    _assert_parity([r["tp2"] for r in two])
    placements = two[0]["tp2"]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == (["Shard(dim=0)"], ["tp"])
    assert placements["model.layers.0.mlp.down_proj.weight"] == (["Shard(dim=1)"], ["tp"])
    assert "model.layers.0.input_layernorm.weight" not in placements, "modules outside the plan stay plain"


def test_an_optimizer_built_before_accelerate_is_moved_onto_the_split_parameters(two):
    _assert_parity([r["tp2_optimizer_first"] for r in two])


def test_qwen2_auto_plan_with_sequence_parallel_matches_one_process(two):
    _assert_parity([r["tp2_sp_qwen2"] for r in two], kind="qwen2")
    placements = two[0]["tp2_sp_qwen2"]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.bias"] == (["Shard(dim=0)"], ["tp"])
    assert placements["model.norm.weight"] == (["Replicate()"], ["tp"]), "sequence-parallel norms are DTensors"


def test_dict_plan_splits_a_plain_module(two):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in two:
        assert result["dict_plan"]["local"] == (32, 16), "fc1's 64 output features split in halves"
        for name, value in model.state_dict().items():
            torch.testing.assert_close(result["dict_plan"]["state"][name], value, atol=1e-6, rtol=0, msg=name)


def test_fsdp2_x_tp2_matches_one_process(four):
    _assert_parity([r["fsdp2_tp2"] for r in four])
    assert four[0]["fsdp2_tp2"]["mesh"] == [[[0, 1], [2, 3]]], "tp innermost: ranks 0,1 split one layer"
    placements = four[0]["fsdp2_tp2"]["placements"]
    assert placements["model.layers.0.mlp.down_proj.weight"] == (["Shard(dim=0)", "Shard(dim=1)"], ["fsdp", "tp"])
    assert placements["model.layers.0.input_layernorm.weight"] == (["Shard(dim=0)"], ["fsdp"])


def test_fsdp2_x_tp2_with_sequence_parallel_matches_one_process(four):
    _assert_parity([r["fsdp2_tp2_sp"] for r in four])


def test_replicas_of_a_tp_model_match_one_process(four):
    _assert_parity([r["dp2_tp2"] for r in four])
    placements = four[0]["dp2_tp2"]["placements"]
    assert placements["model.layers.0.mlp.down_proj.weight"][1] == ["dp", "fsdp", "tp"]
