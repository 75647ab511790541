"""Sharded training must match one process on the same global batches (the parity oracle).

One launch per world size runs every scenario (see tests/multiproc/scenarios.py; the fixtures
``two_ranks`` and ``four_ranks`` are in conftest.py); the reference runs here, in the pytest process,
on the concatenation of the ranks' batches.
"""

import pytest
import torch
from _parity import assert_parity
from torch.distributed.tensor import Replicate, Shard


@pytest.mark.parametrize("scenario", ["fsdp", "fsdp_gc", "fsdp_opt_first", "dp"])
def test_two_rank_training_matches_single_process(two_ranks, scenario):
    assert_parity([rank_result[scenario] for rank_result in two_ranks])


def test_hsdp_four_ranks_matches_single_process(four_ranks):
    assert_parity([rank_result["hsdp"] for rank_result in four_ranks])


def test_topology_decides_rank_layout(four_ranks):
    assert four_ranks[0]["hsdp"]["mesh"] == [[0, 1], [2, 3]]
    assert four_ranks[0]["hsdp_strided"]["mesh"] == [[0, 2], [1, 3]]
    assert_parity([rank_result["hsdp_strided"] for rank_result in four_ranks])


def test_every_parameter_is_sharded_in_halves(two_ranks):
    placements = two_ranks[0]["fsdp"]["placements"]
    assert len(placements) == two_ranks[0]["fsdp"]["num_params"], "every parameter must be a DTensor"
    for name, (placement, local_shape, full_shape) in placements.items():
        assert placement == (str(Shard(0)),), name
        assert local_shape[0] == -(-full_shape[0] // 2), name


def test_hsdp_parameters_are_replicated_then_sharded(four_ranks):
    for name, (placement, _, _) in four_ranks[0]["hsdp"]["placements"].items():
        assert placement == (str(Replicate()), str(Shard(0))), name


def test_dp_keeps_plain_parameters(two_ranks):
    assert two_ranks[0]["dp"]["placements"] == {}


def test_loader_batches_are_disjoint_and_cover_the_dataset(two_ranks):
    for epoch in range(2):
        per_rank = [set(r["loader"]["epochs"][epoch]) for r in two_ranks]
        assert per_rank[0].isdisjoint(per_rank[1])
        assert per_rank[0] | per_rank[1] == set(range(12))
    assert two_ranks[0]["loader"]["epochs"][0] != two_ranks[0]["loader"]["epochs"][1], "set_epoch must reshuffle"
    assert two_ranks[0]["loader"]["len"] == 2


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains_in_the_low_dtype_under_the_fsdp_policy_only(two_ranks, dtype):
    result, fp32 = two_ranks[0][dtype], two_ranks[0]["fp32"]
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    # FSDP's policy all-gathers the weights in the low dtype; no autocast runs on top of it
    assert result["inside"] == {"weight": low, "output": low, "autocast": False}
    assert fp32["inside"] == {"weight": "torch.float32", "output": "torch.float32", "autocast": False}
    assert result["out_dtype"] == low, "outputs larger than a scalar stay in the compute dtype"
    assert result["losses"][-1] < 0.2 * result["losses"][0]
    # a low-precision run is not the fp32 run (which would also lower the loss), but stays close to it
    assert result["losses"] != fp32["losses"]
    torch.testing.assert_close(torch.tensor(result["losses"][:4]), torch.tensor(fp32["losses"][:4]), rtol=0.05, atol=0)


def test_bf16_trains_alike_at_fsdp_sizes_one_and_two(two_ranks):
    runs = two_ranks[0]["bf16_sizes"]
    fsdp, dp, fp32 = (torch.tensor(runs[k]) for k in ("fsdp_bf16", "dp_bf16", "fsdp_fp32"))
    torch.testing.assert_close(fsdp, dp, rtol=2e-2, atol=0)  # bf16 rounding: 8 bits of mantissa
    assert not torch.equal(fsdp, fp32) and not torch.equal(dp, fp32)


def test_fp16_overflow_on_one_rank_is_skipped_on_all(two_ranks):
    overflows = [rank_result["fp16"]["overflow"] for rank_result in two_ranks]
    assert overflows[0]["finite_here"] and not overflows[1]["finite_here"], "the inf is on rank 1 only"
    for overflow in overflows:
        assert overflow["unchanged"], "a step with an inf gradient on any rank must not change the parameters"
        assert overflow["scale_after"] == overflow["scale_before"] / 2


def test_no_module_is_moved_to_the_device_whole_before_it_is_sharded(two_ranks):
    for rank_result in two_ranks:
        assert rank_result["moves"] == []


@pytest.mark.parametrize("layout", ["meta_fsdp4", "meta_hsdp", "meta_hsdp_rank_seeds", "meta_fsdp2_tp2_rank_seeds"])
def test_meta_init_at_four_ranks_equals_one_process(four_ranks, layout):
    """Every layout's full tensors equal one process's draw, also when each rank was seeded differently: the
    replicas of HSDP's dp axis and the parameters TP leaves whole start equal on every rank, as
    sync_module_states makes them for a model built normally."""
    import scenarios

    reference = scenarios.meta_init_state()
    for result in four_ranks:
        for model in {"gpt2", "tinynet", "llama_pad"} & result[layout].keys():
            for key, value in reference[model].items():
                assert torch.equal(result[layout][model][key], value), (model, key)


def test_the_unsharded_parameters_are_not_kept_alive(two_ranks):
    for rank_result in two_ranks:
        originals = rank_result["originals"]
        assert originals["num_params"] > 0 and originals["alive"] == [0], originals


def test_collectives(two_ranks):
    for rank, result in enumerate(two_ranks):
        c = result["collectives"]
        assert c["broadcast_obj"] == {"from": 1}
        assert c["broadcast_tensor"] == [0.0]
        assert c["reduce_mean"] == pytest.approx(1.5)
        assert c["all_reduce_sum"] == [3]
        assert c["master"] == (rank == 0)
        assert "rendezvous mismatch" in c["mismatch"] and "rank 1: 'tag-of-rank-1'" in c["mismatch"]


def test_optimizer_built_before_accelerate_fails_at_its_first_step(two_ranks):
    for rank_result in two_ranks:
        error = rank_result["stale_optimizer"]["error"]
        assert error and "replaced by sharded ones" in error and "optimizer=optimizer" in error


def test_sync_sends_only_the_tensors_that_differ(two_ranks):
    for rank_result in two_ranks:
        sync = rank_result["sync"]
        assert sync["num_agreeing"] == 0, "ranks that agree must send nothing"
        assert sync["num_mixed"] == 2, "rank 1 differs in two values swapped and in a large permutation"
        assert sync["sent"] == [64 * 48, 70_000], "exactly those tensors' elements must be broadcast"
        for got, want in zip(sync["mixed"], sync["expected"], strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        (same, num_tensors), (differ, _) = sync["engine_counts"]
        assert same == 0 and 0 < differ <= num_tensors, sync["engine_counts"]


@pytest.mark.parametrize(
    "launch, key",
    [("two_ranks", "kept_chunk_sync"), ("four_ranks", "kept_chunk_sync"), ("four_ranks", "kept_chunk_sync_strided")],
)
def test_sync_compares_only_the_chunk_each_rank_keeps(launch, key, request):
    """FSDP 2 at 2 ranks and HSDP 2 x 2 at 4: a difference in the chunk a rank keeps is sent, one in a chunk it
    drops is not (sharding discards it), and every rank's gathered model is rank 0's; each rank other than 0
    digests only its half of the weights (rank 0: the half rank 1 keeps at FSDP 2, both halves under HSDP, where
    another rank keeps rank 0's chunk; also with the topology ["fsdp", "dp"])."""
    for rank, rank_result in enumerate(request.getfixturevalue(launch)):
        sync = rank_result[key]
        assert sync["same"]["sent"] == 0 and sync["dropped"]["sent"] == 0, sync
        assert sync["kept"]["sent"] == 28, "every parameter differs in a kept chunk on some rank"
        assert all(sync[case]["equal"] for case in ("same", "kept", "dropped")), sync
        if rank or launch == "two_ranks":
            assert sync["same"]["read"] == sync["num_elements"] // 2, sync


def test_a_model_whose_output_is_a_plain_object_trains(two_ranks):
    from scenarios import _PlainOutputNet

    torch.manual_seed(0)
    model = _PlainOutputNet()
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).loss.backward()
    for rank_result in two_ranks:
        result = rank_result["plain_output"]
        assert result["error"] is None, result["error"]
        for name, param in model.named_parameters():
            torch.testing.assert_close(result["grads"][name], param.grad, msg=name)
        assert result["gathered_for_backward"], "the root unit stays gathered from forward to backward"
        assert result["sharded_after_backward"] and result["sharded_after_eval"], "and is freed when none follows"
