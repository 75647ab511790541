"""Checkpoints of tensor-parallel models: a 2-rank TP2 run and a 4-rank FSDP2 x TP2 run of tiny Llama.

One launch per layout trains, saves shards with their metadata, records the full state and loads the
shards back (tp_ckpt_scenarios.py); consolidation, resharding and the Hugging Face export run here, in
the pytest process, with no process group, and must give back the recorded state bit for bit.
"""

from pathlib import Path

import pytest
import torch
from _launch import launch

import torchacc
from torchacc.checkpoint.offline.shard_set import ShardSet
from torchacc.cli import main as cli_main

SCENARIOS = str(Path(__file__).with_name("tp_ckpt_scenarios.py"))
LAYOUTS = {"tp2": (2, 1), "fsdp2_tp2": (4, 2)}  # name -> (world size, dist.fsdp.size)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, tmp_path_factory):
    world, fsdp = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    results = launch(f"{SCENARIOS}:save_and_reload", world, out / "logs", args=(out, fsdp))
    return request.param, out / "shards", results


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def test_metadata_gives_every_ranks_block_on_both_axes(run):
    layout, _, results = run
    assert [r["bad_blocks"] for r in results] == [[]] * len(results), "offset/local_shape disagree with to_local()"
    tensors = results[-1]["meta"]["tensors"]
    assert tensors["model.layers.0.self_attn.o_proj.weight"]["placements"][-1] == "shard:1"
    if layout == "tp2":
        assert results[0]["meta"]["mesh"]["dim_names"] == ["tp"]
        assert tensors["model.norm.weight"]["placements"] == ["replicate"]
        assert not any("mesh" in entry for entry in tensors.values())
    else:
        assert results[0]["meta"]["mesh"]["dim_names"] == ["fsdp", "tp"]
        q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
        assert q_proj["placements"] == ["strided_shard:0:2", "shard:0"]
        assert (q_proj["offset"], q_proj["local_shape"]) == ([48, 0], [16, 64])  # rank 3: fsdp 1, tp 1
        assert tensors["model.norm.weight"]["mesh"] == {"shape": [2], "dim_names": ["fsdp"], "coordinate": [1]}


def test_consolidation_is_bitwise_equal_to_the_trained_state(run, tmp_path):
    _, shards, results = run
    recorded = results[0]["state"]
    full = torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(str(shards), save_model=False)
    assert_states_equal(full["model"], recorded)
    assert_states_equal(torch.load(shards / "consolidated.pth", weights_only=True)["model"], recorded)
    assert cli_main(["consolidate", "--ckpt-dir", str(shards), "--out", str(tmp_path / "cli.pth"), "--quiet"]) == 0
    assert_states_equal(torch.load(tmp_path / "cli.pth", weights_only=True)["model"], recorded)
    items = ShardSet(f"{shards}/rank-*-of-*-model.pth").items
    o_proj = next(item for item in items if item.name == "model.layers.0.self_attn.o_proj.weight")
    assert ShardSet(f"{shards}/rank-*-of-*-model.pth").byte_ranges(o_proj) is None, "dim-1 pieces are rebuilt"


@pytest.mark.parametrize("num_shards", [2, 4])
def test_resharding_to_a_plain_fsdp_layout_keeps_every_bit(run, tmp_path, num_shards):
    _, shards, results = run
    written = torchacc.reshard_checkpoint(shards, tmp_path, num_shards=num_shards)
    assert len(written) == num_shards
    meta = torch.load(written[-1], weights_only=True)["shard_metadata"]
    assert meta["mesh"]["shape"] == [num_shards]
    assert all("mesh" not in e and e["placements"] in (["shard:0"], ["replicate"]) for e in meta["tensors"].values())
    full = torchacc.consolidate(f"{tmp_path}/rank-*-of-*-model.pth")
    assert_states_equal(full["model"], results[0]["state"])


def test_the_accelerated_model_loads_the_full_state_and_its_own_shards(run):
    _, _, results = run
    for rank, result in enumerate(results):
        assert_states_equal(result["from_full"], result["state"])
        assert_states_equal(result["from_shards"], result["state"])
        assert torch.equal(result["from_full_logits"], result["logits"]), rank
        assert "a different sharding layout" in result["foreign_error"], rank


def test_hf_export_of_the_shards_reloads_with_the_trained_logits(run, tmp_path):
    from tp_ckpt_scenarios import INPUT_IDS
    from transformers import LlamaForCausalLM

    _, shards, results = run
    torchacc.export_hf(shards, tmp_path / "hf", shards)  # config.json was saved beside the shards
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert_states_equal({k: v for k, v in model.state_dict().items()}, results[0]["state"])
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
