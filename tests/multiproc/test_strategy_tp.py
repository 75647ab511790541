"""FSDP2Strategy with tensor parallelism on 2 ranks (TP2) and 4 ranks (FSDP2 x TP2): parity with one process
(accumulation, clipping), save_ckpt / load_ckpt resuming bitwise, fp16 overflow on one rank, layout errors."""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_llama, token_dataset

SCENARIOS = str(Path(__file__).with_name("tp_strategy_scenarios.py"))
ATOL, RTOL = 1e-5, 1e-4


def _launch(tmp_path_factory, world_size: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"strategy_tp{world_size}")
    return launch(f"{SCENARIOS}:tp_suite", world_size, out / "logs", args=(out,))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "fsdp2xtp2"])
def ranks(request, tmp_path_factory):
    return request.getfixturevalue("tp2") if request.param == 2 else _launch(tmp_path_factory, 4)


def reference(indices: list[list[list[int]]], accumulation_steps: int) -> tuple[list[float], list[float], dict]:
    """One unsharded model; each step on the union of every data-parallel rank's micro-batches of that step."""
    data = token_dataset(64)
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step in range(len(indices[0]) // accumulation_steps):
        micro = range(step * accumulation_steps, (step + 1) * accumulation_steps)
        ids = torch.stack([data[i]["input_ids"] for r in indices for m in micro for i in r[m]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def test_layout_data_parallel_view_and_parallelize_fn_mesh(ranks):
    world = len(ranks)
    for rank, result in enumerate(r["layout"] for r in ranks):
        assert result["mesh_names"] == ("dp", "fsdp", "tp") == result["fn_mesh_names"]
        assert result["data_parallel_size"] == world // 2 and result["tensor_parallel_size"] == 2
        assert result["sampler"] == {"num_replicas": world // 2, "rank": rank // 2}, "tp peers share a rank"
        assert result["accumulation_steps"] == 2


def test_training_matches_one_process_with_accumulation_and_clipping(ranks):
    results = [r["parity"] for r in ranks]
    assert results[0]["up_proj_placements"][-1] == "S(0)", "up_proj is split over tp"
    by_dp_rank = {}
    for result in results:  # the ranks of one TP group took the same batches and computed the same loss
        first = by_dp_rank.setdefault(result["data_parallel_rank"], result)
        assert result["indices"] == first["indices"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(first["losses"]))
    groups = [by_dp_rank[k] for k in sorted(by_dp_rank)]
    assert len(groups) == len(ranks) // 2
    ref_losses, ref_norms, ref_state = reference([g["indices"] for g in groups], 2)
    step_losses = torch.tensor([g["losses"] for g in groups]).mean(dim=0).view(-1, 2).mean(dim=1)
    torch.testing.assert_close(step_losses, torch.tensor(ref_losses), atol=ATOL, rtol=RTOL)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), atol=ATOL, rtol=RTOL)
        assert min(result["norms"]) > 0.05, "the test must actually clip"
        for name, value in ref_state.items():
            torch.testing.assert_close(result["state"][name], value, atol=ATOL, rtol=RTOL, msg=name)


def test_save_ckpt_load_ckpt_resumes_bitwise(tp2):
    for result in (r["resume"] for r in tp2):
        assert result == {
            "losses_equal": True,
            "indices_equal": True,
            "state_equal": True,
            "client_state": {"note": 1},
            "global_step": 4,
        }


def test_fp16_inf_on_one_tp_rank_skips_the_step_everywhere(ranks):
    for rank, result in enumerate(r["fp16"] for r in ranks):
        assert result["grad_is_dtensor"]
        first, overflow, last = result["steps"]
        assert first["changed"] and first["scale_after"] == first["scale"] == 2.0**16
        assert not overflow["changed"], f"rank {rank} stepped on rank 1's inf"
        assert overflow["scale_after"] == overflow["scale"] / 2, f"rank {rank} did not back off"
        assert last["changed"] and last["scale"] == overflow["scale_after"]


def test_tp_size_not_dividing_the_world_is_a_value_error_on_every_rank(ranks):
    world = len(ranks)
    for message in (r["size_error"] for r in ranks):
        assert message.startswith(f"tensor_parallel_size=3 does not divide the world size {world}"), message
