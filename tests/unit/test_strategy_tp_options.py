"""FSDP2Strategy's tensor-parallel options, written into the Config without a process group."""

import pytest

from torchacc import Config, FSDP2Strategy
from torchacc.strategy.options import apply_options


def _apply(world_size: int, **kwargs) -> Config:
    config = Config()
    options = dict(
        data_parallel_size="auto",
        sharding_strategy="FULL_SHARD",
        mp_policy=None,
        cpu_offload=False,
        activation_checkpointing_policy=None,
    )
    apply_options(config, world_size=world_size, **{**options, **kwargs})
    return config


@pytest.mark.parametrize(
    "sharding, fsdp, dp",
    [("FULL_SHARD", 4, 1), ("SHARD_GRAD_OP", 4, 1), ("NO_SHARD", 1, 4), ("HYBRID_SHARD", 2, 2)],
)
def test_sharding_strategies_lay_out_the_data_parallel_ranks_only(monkeypatch, sharding, fsdp, dp):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two emulated nodes of 4 ranks: HSDP shards over 4 / tp = 2
    config = _apply(8, tensor_parallel_size=2, sharding_strategy=sharding, data_parallel_size=4)
    assert (config.dist.dp.size, config.dist.fsdp.size, config.dist.tp.size) == (dp, fsdp, 2)
    config.validate(8)


def test_plan_and_sequence_parallel_reach_the_config():
    plan = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    config = _apply(2, tensor_parallel_size=2, tensor_parallel_plan=plan, sequence_parallel=True)
    assert config.dist.tp.plan == plan and config.dist.tp.sequence_parallel
    assert _apply(2, tensor_parallel_size=2).dist.tp.plan == "auto"
    assert _apply(2).dist.tp.size == 1, "'auto' keeps the config's size"


def test_tp_size_errors_name_the_argument(monkeypatch):
    message = r"tensor_parallel_size=3 does not divide the world size 4; choose one of \[1, 2, 4\]"
    with pytest.raises(ValueError, match=message):
        _apply(4, tensor_parallel_size=3)
    message = r"data_parallel_size=4 must equal the world size 4 / tensor_parallel_size=2 = 2"
    with pytest.raises(ValueError, match=message):
        _apply(4, tensor_parallel_size=2, data_parallel_size=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the 2 ranks of a node"):
        _apply(8, tensor_parallel_size=4, sharding_strategy="HYBRID_SHARD")


def test_single_process_tp_size_error_before_any_collective():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the world size 1"):
        FSDP2Strategy(tensor_parallel_size=2).setup_environment()
