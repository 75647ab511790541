"""Checkpoints end to end: TorchAcc's shard files, offline consolidation, resharding, DCP, resume.

One 2-rank launch trains and saves; everything offline (consolidation, strictness) runs here, in
the pytest process, with no process group; further launches resume and load at 1 and 4 ranks.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import launch
from _models import tiny_gpt2

import torchacc
from torchacc.checkpoint.files import verify_file
from torchacc.checkpoint.offline.shard_set import ShardSet

SCENARIOS = str(Path(__file__).with_name("ckpt_scenarios.py"))


def plain_model() -> torch.nn.Module:
    model = tiny_gpt2()
    model.transformer.register_buffer("marker", torch.zeros(5))
    return model


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def test_offline_consolidation_is_bitwise_equal_to_the_gathered_state(saved):
    out, results = saved
    assert not dist.is_initialized()
    full = torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(ckpt_prefix=f"{out}/shards/", save_model=False)
    assert_states_equal(full["model"], results[0]["gathered"])
    plain_model().load_state_dict(full["model"], strict=True)


def test_a_buffer_comes_from_rank_0s_file(saved, tmp_path):
    out, _ = saved
    for rank in range(2):  # each rank's file holds its own copy of a buffer; here the copies differ
        shard = torch.load(out / "shards" / f"rank-{rank}-of-2-model.pth", weights_only=True)
        shard["model"]["transformer.marker"] = torch.arange(5.0) + 100 * rank
        torch.save(shard, tmp_path / f"rank-{rank}-of-2-model.pth")
    full = torchacc.consolidate(f"{tmp_path}/rank-*-of-*-model.pth")
    assert torch.equal(full["model"]["transformer.marker"], torch.arange(5.0))


def test_master_wrote_consolidated_file_and_the_sharded_model_reloads_it(saved):
    out, results = saved
    written = torch.load(out / "shards" / "consolidated.pth", weights_only=True)
    assert_states_equal(written["model"], results[0]["gathered"])
    assert written["model"]["lm_head.weight"].data_ptr() == written["model"]["transformer.wte.weight"].data_ptr()
    assert all(r["reload_equal"] for r in results)


def test_streaming_consolidation_writes_the_same_state(saved, tmp_path):
    out, results = saved
    target = tmp_path / "streamed.pth"
    assert torchacc.consolidate(f"{out}/shards/rank-*-of-*-model.pth", out=target, return_state=False) is None
    assert_states_equal(torch.load(target, weights_only=True, mmap=True)["model"], results[0]["gathered"])
    verify_file(target)
    shards = ShardSet(f"{out}/shards/rank-*-of-*-model.pth")
    assert all(shards.byte_ranges(item) is not None for item in shards.items), "FSDP2's shards are copied as bytes"
    safetensors = tmp_path / "model.safetensors"
    torchacc.consolidate(f"{out}/shards/rank-*-of-*-model.pth", out=safetensors, fmt="safetensors", return_state=False)
    from safetensors.torch import load_file

    assert_states_equal(load_file(safetensors), results[0]["gathered"])


def test_optimizer_shards_consolidate_to_the_full_state(saved):
    out, results = saved
    full = torch.load(out / "shards" / "consolidated_optim.pth", weights_only=True)["optimizer"]
    expected = results[0]["full_optim"]
    assert full["state"].keys() == expected["state"].keys()
    assert "lm_head.weight" not in full["state"] or "transformer.wte.weight" not in full["state"]
    for name, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(full["state"][name][key], value), (name, key)
    assert full["param_groups"] == expected["param_groups"]


def run_ids(directory: Path) -> set:
    return {
        torch.load(p, weights_only=True, mmap=True)["shard_metadata"].get("run_id") for p in directory.glob("rank-*")
    }


def test_the_shards_of_one_run_carry_one_run_id_and_resharding_keeps_it(saved, features):
    out, _ = saved
    (run_id,) = run_ids(out / "shards")  # both ranks, model and optimizer files
    assert isinstance(run_id, str) and len(run_id) == 32, run_id
    assert run_ids(out / "resharded-4") == {run_id}
    assert run_ids(features[0]) not in ({run_id}, {None}), "another accelerated model is another run"


def test_the_torchacc_optimizer_file_is_complete(saved):
    out, results = saved
    saved_optim = torch.load(out / "shards" / "optimizer.pth", weights_only=True)
    first = results[0]["full_optim"]["state"]["transformer.wte.weight"]["exp_avg"]
    assert torch.equal(saved_optim["state"][0]["exp_avg"], first), "master_only saves gather DTensors to full"


@pytest.fixture(scope="module")
def resumed(saved):
    out, _ = saved
    return launch(f"{SCENARIOS}:resume", 2, out / "logs-resume", args=(out,))


@pytest.mark.parametrize("source", ["from_shards", "from_dcp"])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(saved, resumed, source):
    _, results = saved
    reference = results[0]["reference"]
    for rank in range(2):
        run = resumed[rank][source]
        assert results[rank]["losses"] + run["losses"] == results[rank]["reference"]["losses"]
        assert_states_equal(run["state"], reference["state"])
    if source == "from_dcp":
        assert resumed[0][source]["extra"] == {"step": 3}


@pytest.mark.parametrize("world, layout", [(1, "fsdp"), (4, "fsdp"), (4, "hsdp")])
def test_other_world_sizes_load_model_and_optimizer(saved, world, layout):
    out, results = saved
    loaded = launch(f"{SCENARIOS}:load_elsewhere", world, out / f"logs-{world}-{layout}", args=(out, layout))
    expected_optim = results[0]["full_optim"]["state"]
    remaining = sorted(i for rank_result in loaded for i in rank_result.pop("remaining_indices"))
    consumed = {i for r in results for i in r["consumed_indices"]}
    assert set(remaining) == set(range(64)) - consumed and len(remaining) == 64 - 12, "re-split, never replayed"
    for source, result in loaded[0].items():
        assert_states_equal(result["state"], results[0]["gathered"])
        for name, values in expected_optim.items():
            for key, value in values.items():
                assert torch.equal(result["optim"]["state"][name][key], value), (source, name, key)
    assert ("resharded" in loaded[0]) == (world == 4 and layout == "fsdp")


# --- strictness: every broken shard set is refused with the file named, and nothing is written ---


@pytest.fixture
def shard_copy(saved, tmp_path):
    out, _ = saved
    target = tmp_path / "shards"
    target.mkdir()
    for name in ("rank-0-of-2-model.pth", "rank-1-of-2-model.pth"):
        shutil.copy(out / "shards" / name, target / name)
    return target


def rewrite(path: Path, edit) -> None:
    data = torch.load(path, weights_only=True)
    edit(data)
    torch.save(data, path)


def expect_refusal(directory: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(ckpt_prefix=f"{directory}/")
    assert not (directory / "consolidated.pth").exists()
    assert not list(directory.glob("*.tmp-*"))


def test_missing_rank(shard_copy):
    os.remove(shard_copy / "rank-1-of-2-model.pth")
    expect_refusal(shard_copy, r"missing rank\(s\) \[1\] of a 2-rank checkpoint")


def test_duplicate_rank(shard_copy):
    shutil.copy(shard_copy / "rank-0-of-2-model.pth", shard_copy / "rank-0-of-2-copy-model.pth")
    expect_refusal(shard_copy, r"duplicate rank 0: .*rank-0-of-2-model.pth")


def test_mixed_world_sizes(shard_copy):
    foreign = shard_copy / "rank-0-of-4-model.pth"
    shutil.copy(shard_copy / "rank-0-of-2-model.pth", foreign)
    rewrite(foreign, lambda d: d["shard_metadata"].update(world_size=4))
    expect_refusal(shard_copy, r"mixed world sizes: .*rank-0-of-2-model.pth is from a 2-rank run but .*rank-0-of-4")


def test_shape_mismatch(shard_copy):
    path = shard_copy / "rank-1-of-2-model.pth"
    rewrite(path, lambda d: d["model"].update({"lm_head.weight": torch.zeros(3, 3)}))
    expect_refusal(shard_copy, r"rank-1-of-2-model.pth: lm_head.weight is \(\(3, 3\), torch.float32\), expected shape")


def test_dtype_mismatch(shard_copy):
    path = shard_copy / "rank-1-of-2-model.pth"
    rewrite(path, lambda d: d["model"].update({"transformer.ln_f.bias": d["model"]["transformer.ln_f.bias"].double()}))
    expect_refusal(shard_copy, r"rank-1-of-2-model.pth: transformer.ln_f.bias is .*float64.*expected .*float32")


def test_truncated_file(shard_copy):
    path = shard_copy / "rank-1-of-2-model.pth"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_refusal(shard_copy, r"rank-1-of-2-model.pth: truncated or not a torch checkpoint")


def test_bit_flip_is_caught_by_the_checksums(shard_copy):
    path = shard_copy / "rank-0-of-2-model.pth"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    expect_refusal(shard_copy, r"rank-0-of-2-model.pth: member .* fails its CRC-32 check")


def test_not_a_shard_file(shard_copy):
    torch.save({"weights": torch.zeros(1)}, shard_copy / "rank-1-of-2-model.pth")
    expect_refusal(shard_copy, r"rank-1-of-2-model.pth: not a torchacc model shard: expected keys 'model'")


def test_no_files(tmp_path):
    expect_refusal(tmp_path, r"no checkpoint files match")


def test_shard_set_reports_world_size(shard_copy):
    assert ShardSet(f"{shard_copy}/rank-*-of-*-model.pth").world_size == 2


@pytest.fixture(scope="module")
def features(saved):
    out, _ = saved
    results = launch(f"{SCENARIOS}:features", 2, out / "logs-features", args=(out,))
    return out / "features", results[0]


def test_frozen_buffers_dtypes_and_wrapper_prefixes_consolidate(features):
    from _models import TinyNet

    from torchacc.checkpoint.offline.shard_set import canonical_name

    directory, result = features
    full = torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(ckpt_prefix=f"{directory}/", save_model=False)
    assert not [k for k in full["model"] if "_checkpoint_wrapped_module" in k]
    expected = {canonical_name(k): v for k, v in result["state"].items()}
    assert_states_equal(full["model"], expected)
    assert full["model"]["scale"].dtype == torch.bfloat16
    plain = TinyNet()
    plain.register_buffer("scale", torch.zeros(4, dtype=torch.bfloat16))
    plain.load_state_dict(full["model"], strict=True)


def test_param_groups_and_parameters_without_state_consolidate(features):
    from torchacc.checkpoint.offline.shard_set import canonical_name

    directory, result = features
    full = torchacc.dist.fsdp.consolidate_sharded_optimizer_checkpoints(
        ckpt_prefix=f"{directory}/", save_optimizer=False
    )["optimizer"]
    assert "blocks.0.fc1.weight" not in full["state"] and "head.bias" not in full["state"]
    assert [g["weight_decay"] for g in full["param_groups"]] == [0.1, 0.0]
    assert "blocks.1.fc1.weight" in full["param_groups"][0]["params"]
    for name, values in result["optim"]["state"].items():
        for key, value in values.items():
            assert torch.equal(full["state"][canonical_name(name)][key], value), (name, key)
