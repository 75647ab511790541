"""Tensor-parallel models save, load and initialize exactly (see tp_dcp_scenarios.py).

One checkpoint travels TP2 x FSDP2 (4 ranks) -> FSDP4 (4 ranks) -> one process (here) -> TP2 (2 ranks),
model and AdamW state bitwise equal at every stop. Meta-device init and ``dist.fsdp.init_from`` give the
full tensors a single process gives; ``optimizer.state_dict()`` saved and loaded with torch resumes exactly.
"""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_llama

import torchacc

SCENARIOS = str(Path(__file__).with_name("tp_dcp_scenarios.py"))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_ckpt")


@pytest.fixture(scope="module")
def four(out):
    return launch(f"{SCENARIOS}:four_rank_suite", 4, out / "logs4", args=(out,))


@pytest.fixture(scope="module")
def one(out, four):
    """The FSDP4 checkpoint loaded in this process (no process group), then saved again for TP2."""
    import tp_dcp_scenarios as s

    model, optimizer = s.fresh(s.llama_config(), seed=2)
    torchacc.load_checkpoint(out / "ckpt-fsdp4", model=model, optimizer=optimizer)
    torchacc.save_checkpoint(out / "ckpt-one", model=model, optimizer=optimizer)
    return {"loaded": s.snapshot(model, optimizer), "meta": s.meta_init(s.llama_config())}


@pytest.fixture(scope="module")
def two(out, one):
    return launch(f"{SCENARIOS}:two_rank_suite", 2, out / "logs2", args=(out,))


def assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key


def test_a_checkpoint_travels_tp_fsdp_to_fsdp_to_one_process_to_tp_bitwise(four, one, two):
    saved = four[0]["saved"]
    assert len(saved["optim"]) == 3 * len(saved["model"])  # step, exp_avg, exp_avg_sq of every parameter
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in four[0]["placements"]
    assert "(Shard(dim=0), Shard(dim=1))" in four[0]["placements"]
    assert {"(Shard(dim=0),)", "(Shard(dim=1),)", "plain"} <= two[0]["placements"]
    for result in four:
        for stage in (result["saved"], result["fsdp4"]):
            assert_equal(stage["model"], saved["model"])
            assert_equal(stage["optim"], saved["optim"])
    for stage in [one["loaded"], *(r["tp2"] for r in two)]:
        assert_equal(stage["model"], saved["model"])
        assert_equal(stage["optim"], saved["optim"])


def test_meta_init_fills_tp_shards_like_one_process(four, one, two):
    for result in [*four, *two]:
        assert_equal(result["meta"], one["meta"])


@pytest.mark.parametrize("kind", ["pth", "hf"])
def test_init_from_fills_tp_shards_with_the_files_tensors(four, two, kind):
    expected = tiny_llama(seed=11).state_dict()
    for result in [*four, *two]:
        assert_equal(result[f"init_from_{kind}"], expected)
    # rank 0 reads every tensor once and sends it (set_model_state_dict(broadcast_from_rank0=True)); the others
    # read nothing
    total = sum(v.numel() for v in expected.values())
    for ranks in (four, two):
        assert [r[f"read_{kind}"] for r in ranks] == [total] + [0] * (len(ranks) - 1)


def test_init_from_on_rank_zero_only_fills_tp_shards(two):
    expected = tiny_llama(seed=11).state_dict()
    for result in two:
        assert_equal(result["init_from_rank0"], expected)


def test_plain_optimizer_state_dict_round_trip_resumes_exactly_under_tp(four, two):
    for result in [*four, *two]:
        lines = result["seed_lines"]
        assert_equal(lines["resumed"]["model"], lines["straight"]["model"])
        assert_equal(lines["resumed"]["optim"], lines["straight"]["optim"])


def test_export_hf_of_the_live_tp_model_reloads_to_equal_logits(out, two):
    import tp_dcp_scenarios as s
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out / "tp2-export")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=s.BATCH).logits, two[0]["logits"], rtol=0, atol=1e-5)
